"""Selective recompute under expert parallelism keeps what the dispatch delivered (moelab.model.recompute): a MoE
layer exchanges its rows as often with recompute as without, counted on the ranks (rank_entry.count_collectives:
all_to_all_single calls that move floating-point rows), and the run still matches the one without recompute."""
import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent

SELECTIVE = "train.activation_checkpointing=selective"
# (processes, layout, row exchanges per MoE layer and micro batch). Flat: dispatch and combine, forward and
# backward. Hierarchical: per direction the rows to the nodes and their routing, the node's rows to its experts
# and back, the node's sums back to the token.
LAYOUTS = {"ep2": (2, ["parallel.ep=2"], 4),
           "2x2-hierarchical": (4, ["parallel.ep=4", "parallel.ranks_per_node=2",
                                    "parallel.ep_dispatch=hierarchical"], 10)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_selective_recompute_runs_no_second_exchange(name, helpers, tmp_path):
    nproc, layout, per_layer = LAYOUTS[name]
    counted = {}
    for recompute in ("none", "selective"):
        cfg = helpers.small_config(*layout, f"train.activation_checkpointing={recompute}", "train.steps=2")
        run_dir = tmp_path / recompute
        losses, _ = helpers.run_multi(cfg, run_dir, nproc)
        steps = json.loads((run_dir / "placement_rank0.json").read_text())["collectives"]
        counted[recompute] = losses, [s["row_all_to_alls"] for s in steps]
    t, m = cfg.train, cfg.model
    micro = t.global_batch_size // (t.micro_batch_size * nproc)
    want = per_layer * (m.num_layers - m.num_dense_layers) * micro
    assert counted["none"][1] == counted["selective"][1] == [want, want]
    assert counted["selective"][0] == pytest.approx(counted["none"][0], rel=1e-6)


def test_selective_keeps_what_the_dispatch_delivered_and_it_scales_with_tokens_only(tmp_path):
    """Held bytes per token of one MoE block (saved_ep_worker.py: the heap's growth over the forward): the same at
    two sequence lengths (nothing quadratic: the fused attention kernel keeps its output and log-sum-exp); without
    recompute, the planner's count; with selective recompute under EP, more than one process's selective by at
    least the rows the dispatch delivered ([T*K, D], the experts piece's input) and at most those and the rows the
    combine weights (another [T*K, D]) with their int64 indices: what moelab.model.recompute keeps."""
    import subprocess
    import sys

    from moelab.config import load_config
    from moelab.planner.saved import saved_per_token

    out = tmp_path / "held.json"
    subprocess.run([sys.executable, str(HERE / "saved_ep_worker.py"), str(out)], check=True, timeout=600,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE),
                                                                                  os.environ.get("PYTHONPATH")]))})
    held = json.loads(out.read_text())
    shapes = held.pop("shapes")
    for case in ("local-none", "local-selective", "ep-none", "ep-selective"):
        assert held[f"1024-{case}"] == pytest.approx(held[f"512-{case}"], rel=0.01), case
    for ep in (1, 2):  # allocator rounding and small buffers: 3%, as tests/planner/test_saved.py
        cfg = load_config("tiny", shapes + [f"parallel.ep={ep}"])
        planned = sum(v for k, v in saved_per_token(cfg, True, 2).items() if k != "input")
        assert held[f"512-{'ep' if ep > 1 else 'local'}-none"] == pytest.approx(planned, rel=0.03)
    m = load_config("tiny", shapes).model
    rows = m.moe.top_k * 2 * m.hidden_size  # one [T*K, D] bf16 tensor, per token
    extra = held["512-ep-selective"] - held["512-local-selective"]
    assert rows <= extra <= 2 * rows + 3 * 8 * m.moe.top_k, held
