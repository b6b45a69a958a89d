"""Honest gallery rows: every record's router kind (stated, or inferred and marked so, with what it was inferred
from), an entry's row says when its record ran other settings, and the router sweep's table renders from its
records. Which records are current: tests/gallery/test_current.py."""
import json

from moelab.gallery import get_entry, load_entries, render_report
from moelab.gallery.records import RouterOf, router_of


def _rec(system="moelab", workload="qwen3-moe-30b-a3b-proxy", **kw):
    d = {"system": system, "workload": workload, "gpus": 1, "gpu_name": "NVIDIA H200", "global_batch_size": 2,
         "micro_batch_size": 2, "seq_len": 4096, "tokens_per_s_per_gpu": 1000.0, "tflops_per_gpu": 5.0,
         "peak_memory_gb": 40.0, "flops_convention": "test", "command": "synthetic", "commit": "aaaaaaa",
         "torch_version": "2.11", "date": "2026-11-30T10:00:00Z", "router": "learned"}
    d.update(kw)
    return d


def _write(root, name, **kw):
    (root / "results" / f"{name}.json").write_text(json.dumps(_rec(**kw)))


def test_router_kind_of_a_record_stated_or_inferred():
    entries = {e.name: e for e in load_entries()}
    assert router_of({"router": "fake_noise=0.5"}) == RouterOf("fake_noise=0.5", inferred=False)
    assert router_of({"router": "fake with noise 0.5"}) == RouterOf("fake_noise=0.5", inferred=False)
    assert router_of({"router": "fake balanced"}) == RouterOf("fake_balanced", inferred=False)
    old = {"system": "moelab", "workload": "x", "command": "python script.py"}
    assert router_of({**old, "fake_balanced_gate": True}) == RouterOf("fake_balanced", True)
    assert router_of({**old, "fake_balanced_gate": True, "fake_gate_noise": 0.1}) == RouterOf("fake_noise=0.1", True)
    assert router_of({**old, "fake_balanced_gate": False}) == RouterOf("learned", True)
    # from the --set overrides of its command (moelab bench / gpu_run.sh records)
    cmd = "moelab bench qwen3-moe-30b-a3b-proxy --set backend.fake_balanced_gate=true --set backend.fake_gate_noise=1"
    assert router_of({**old, "command": cmd}) == RouterOf("fake_noise=1", True)
    # a `moelab` command, or a recorded override list, that leaves the gate alone ran the default: learned
    assert router_of({**old, "command": "moelab bench tiny --steps 3"}) == RouterOf("learned", True)
    assert router_of({**old, "overrides": ["train.compile=true"]}) == RouterOf("learned", True)
    # a preset's default
    assert router_of({"system": "moelab", "workload": "qwen3-moe-30b-a3b-proxy"}) == RouterOf("learned", True)
    # a gallery entry's config (here one written with the fake gate)
    assert entries["qwen3-moe-30b-a3b-8gpu"].config().backend.fake_balanced_gate
    assert router_of({"system": "moelab", "workload": "qwen3-moe-30b-a3b-8gpu"}, entries) == \
        RouterOf("fake_balanced", True)
    assert router_of(old) == RouterOf("unknown", True)  # nothing says: not guessed
    assert str(RouterOf("fake_balanced", True)) == "fake_balanced (inferred)"
    # what an inferred kind was read from (the history table of gallery/perf-notes.md shows it)
    assert router_of({**old, "fake_balanced_gate": True}).how == \
        "fake_balanced (inferred from the fake_balanced_gate field)"
    assert router_of({**old, "command": cmd}).how == "fake_noise=1 (inferred from the --set override)"
    assert router_of({"system": "moelab", "workload": "qwen3-moe-30b-a3b-proxy"}).how == \
        "learned (inferred from the preset default)"
    assert router_of({"router": "learned"}).how == "learned"


def test_the_repository_records_all_state_or_infer_a_router():
    """Every throughput record in gallery/results/ has a router kind; the old proxy rows are fake_balanced."""
    from moelab.gallery import load_results

    entries = {e.name: e for e in load_entries()}
    results = load_results()
    kinds = {r["_file"]: router_of(r, entries) for r in results if r.get("tokens_per_s_per_gpu")}
    assert kinds and all(k.kind != "unknown" for k in kinds.values()), \
        [f for f, k in kinds.items() if k.kind == "unknown"]
    old = next((r for r in results if r["_file"] == "qwen3-moe-30b-a3b-proxy-1gpu--moelab--eager-fake-gate.json"), None)
    if old is not None and "router" not in old:  # the eager fake-gate record of commit 6751221
        assert kinds[old["_file"]] == RouterOf("fake_balanced", inferred=True)


def test_an_entry_row_says_its_router_and_when_its_record_ran_other_settings(gallery):
    """The 1-GPU proxies are written compiled with the learned router; an old eager fake-gate record shows,
    labelled, until a newer record replaces it."""
    e = get_entry("qwen3-moe-30b-a3b-proxy-1gpu", gallery)
    cfg = e.config()
    assert cfg.train.compile and cfg.backend.router_kind == "learned" and cfg.train.param_dtype == "bfloat16"
    _write(gallery, f"{e.name}--moelab", workload=e.name, router=None, fake_balanced_gate=True, compile=False,
           param_dtype="bfloat16", tokens_per_s_per_gpu=42001.0, commit="6751221766e6")

    def row():
        text = render_report(gallery, plots=False)
        return [x for x in text.splitlines() if x.startswith(f"| {e.name} |")][0].split(" | ")

    r = row()
    assert r[9] == "42,001" and r[11] == "fake_balanced (inferred)"
    assert "commit 6751221766e6" in r[13] and "compile=False, router=fake_balanced" in r[13] and "re-run" in r[13]
    _write(gallery, f"{e.name}--moelab", workload=e.name, router="learned", fake_balanced_gate=False, compile=True,
           param_dtype="bfloat16", tokens_per_s_per_gpu=61002.0, commit="abcdef0", date="2026-12-02T00:00:00Z")
    r = row()
    assert r[9] == "61,002" and r[11] == "learned" and "re-run" not in r[13] and "commit abcdef0" in r[13]
    # a newer `moelab bench` run of the entry's preset with the entry's settings replaces it; a script's does not
    t = cfg.train
    same = dict(workload=e.preset, global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                seq_len=t.seq_len, dtype=t.dtype, param_dtype=t.param_dtype, compile=True, router="learned")
    _write(gallery, "script", **same, command="python gallery/scripts/x.py", tokens_per_s_per_gpu=99003.0,
           date="2026-12-04T00:00:00Z")
    assert row()[9] == "61,002"
    _write(gallery, "bench", **same, command="moelab bench qwen3-moe-30b-a3b-proxy --set train.compile=true",
           tokens_per_s_per_gpu=63004.0, date="2026-12-03T00:00:00Z")
    assert row()[9] == "63,004" and "bench.json" in row()[13]


def test_router_sweep_table_renders_from_its_records(gallery):
    assert "No router sweep records yet" in render_report(gallery, plots=False)
    for kind, noise, tps, date in (("learned", 0, 50000.0, "T1"), ("fake_balanced", 0, 60000.0, "T2"),
                                   ("fake_noise=0.1", 0.1, 58000.0, "T3"), ("fake_noise=1", 1.0, 40000.0, "T4")):
        _write(gallery, f"sweep-{kind}", variant=f"router-{kind}", router=kind, fake_gate_noise=noise,
               sweep="router", sweep_id="s1", tokens_per_s_per_gpu=tps, load_max_over_mean=1.0 + noise,
               date=f"2026-12-02{date}")
    _write(gallery, "sweep-old", router="learned", sweep="router", sweep_id="s0", tokens_per_s_per_gpu=1.0,
           date="2026-12-01T00")
    text = render_report(gallery, plots=False).split("## What imbalance costs")[1]
    rows = [x.split(" | ") for x in text.splitlines() if x.startswith("| ") and not x.startswith("| router")]
    assert [(r[0].lstrip("| "), r[1], r[2], r[5]) for r in rows] == [
        ("learned", "50,000", "1.000", "1.00"), ("fake_balanced", "60,000", "1.200", "1.00"),
        ("fake_noise=0.1", "58,000", "1.160", "1.10"), ("fake_noise=1", "40,000", "0.800", "2.00")]
