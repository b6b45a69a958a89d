"""gallery/scripts/router_sweep.py on CPU (the tiny preset): one model timed with the learned router and the fake
gate at each noise, one record per variant stating its router kind, rendered as the gallery's imbalance table."""
import importlib.util
import json
import shutil

from moelab.gallery import default_root, render_report
from moelab.gallery.records import router_of


def _script():
    spec = importlib.util.spec_from_file_location("router_sweep", default_root() / "scripts" / "router_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_router_sweep_writes_one_record_per_router_and_renders(tmp_path):
    root = tmp_path / "gallery"
    shutil.copytree(default_root() / "entries", root / "entries")
    out = root / "results"
    assert _script().main(["--out", str(out), "--cpu", "--gbs", "8", "--steps", "1", "--warmup", "0",
                           "--noise", "0,1"]) == 0
    recs = {p.name: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}
    assert sorted(recs) == ["tiny--moelab--router-fake_balanced-gbs8.json", "tiny--moelab--router-fake_noise-1-gbs8.json",
                            "tiny--moelab--router-learned-gbs8.json"]
    by_kind = {r["router"]: r for r in recs.values()}
    assert set(by_kind) == {"learned", "fake_balanced", "fake_noise=1"}
    assert len({r["sweep_id"] for r in recs.values()}) == 1 and all(r["sweep"] == "router" for r in recs.values())
    for kind, r in by_kind.items():
        assert router_of(r).kind == kind and not router_of(r).inferred
        assert r["tokens_per_s_per_gpu"] > 0 and r["global_batch_size"] == 8 and r["workload"] == "tiny"
        assert r["commit"] and r["torch_version"] and "router_sweep.py" in r["command"] and "error" not in r
    # the routing each variant produced: round-robin is exactly balanced, the noise unbalances it
    assert by_kind["fake_balanced"]["load_max_over_mean"] == 1.0
    assert by_kind["fake_noise=1"]["load_max_over_mean"] > 1.0 and by_kind["fake_noise=1"]["fake_gate_noise"] == 1.0
    assert by_kind["learned"]["fake_balanced_gate"] is False and by_kind["learned"]["load_max_over_mean"] > 1.0
    table = render_report(root, plots=False).split("## What imbalance costs")[1]
    rows = [x.split(" | ") for x in table.splitlines() if x.startswith("| ") and not x.startswith("| router")]
    assert [r[0].lstrip("| ") for r in rows] == ["learned", "fake_balanced", "fake_noise=1"]
    learned = by_kind["learned"]["tokens_per_s_per_gpu"]
    assert [r[2] for r in rows] == [f"{by_kind[k]['tokens_per_s_per_gpu'] / learned:.3f}"
                                    for k in ("learned", "fake_balanced", "fake_noise=1")]
