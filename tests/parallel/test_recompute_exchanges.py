"""Selective recompute under expert parallelism keeps what the dispatch delivered (moelab.model.recompute): a MoE
layer exchanges its rows as often with recompute as without, counted on the ranks (rank_entry.count_collectives:
all_to_all_single calls that move floating-point rows), and the run still matches the one without recompute."""
import json

import pytest

pytestmark = pytest.mark.slow

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
