"""The node-aware expert dispatch (parallel.ep_dispatch=hierarchical) on gloo processes grouped into simulated
nodes (parallel.ranks_per_node): against the flat all-to-all on the same routing (outputs, gradients of tokens,
routing weights and experts), the bytes it counts crossing between nodes against moelab.planner.node_dispatch,
and whole runs against the single process (losses, routing counts, gradient norms, parameters)."""
import json
import sys
from pathlib import Path

import pytest
import torch

from moelab.launch.local import launch
from moelab.planner.node_dispatch import inter_node_row_bytes, round_robin_node_rows

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
CASES = ("random", "capacity", "node_limited")


@pytest.mark.parametrize("world,rpn", [(4, 2), (8, 4)])
def test_hierarchical_dispatch_equals_the_flat_all_to_all(world, rpn, tmp_path):
    launch([sys.executable, str(HERE / "hierarchical_worker.py"), str(tmp_path), str(rpn)], world, tmp_path / "logs")
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    nodes = world // rpn
    assert res[0]["node_of"] == [r // rpn for r in range(world)]
    assert res[0]["local_of"] == [r % rpn for r in range(world)]
    for r, got in enumerate(res):
        for case in CASES:
            flat = got[f"{case}_flat"]
            for name in (case, f"{case}_overlap"):
                hier = got[name]
                # fp32 sums in another order (a token's experts within a node, then across nodes; the experts'
                # weight gradients over rows in another order, two chunks under overlap): up to a hundred terms
                # of 6e-8 rounding each, with cancellation in some elements, so each tensor is held to 1e-5 of its
                # largest element rather than element by element
                for key in ("y", "x_grad", "w_grad"):
                    scale = max(map(abs, flat[key]))
                    assert hier[key] == pytest.approx(flat[key], rel=0, abs=1e-5 * scale), (r, name, key)
                for a, b in zip(hier["expert_grads"], flat["expert_grads"]):
                    assert a == pytest.approx(b, rel=0, abs=1e-5 * max(map(abs, b))), (r, name)
                counts = hier["counts"]
                pairs = got[f"{case}_pairs"]
                assert counts["inter_node_rows"] == [pairs], (r, name)
                assert counts["inter_node_bytes"] == [pairs * inter_node_row_bytes(8, 4, 4)]
                reached = counts["tokens_by_nodes_reached"]
                assert len(reached) == nodes + 1 and sum(reached) == 12
                if case == "node_limited":  # every token's experts on one node: one copy, if any, crosses
                    assert sum(reached[2:]) == 0 and pairs <= 12
            assert got[f"{case}"]["counts"]["intra_node_rows"][0] > 0
            # ep_overlap: chunk 1's rows and routing cross while chunk 0's experts compute, chunk 0's sums return
            # while chunk 1's compute (forward; no overlapped exchange without it)
            assert got[f"{case}_overlap"]["events"] == ["start", "start", "experts", "wait", "wait", "start",
                                                        "experts", "wait"]
            assert got[case]["events"] == ["experts"]
    # without the limit some token reaches both nodes (so the bound above is not vacuous)
    assert any(sum(got["random"]["counts"]["tokens_by_nodes_reached"][2:]) > 0 for got in res)


# Whole runs: the learned router, capacity, aux and z losses and the bias update (tests/parallel/conftest.SMALL)
HIER = ["parallel.ep_dispatch=hierarchical"]
GROUPS = ("model.moe.num_groups=2", "model.moe.topk_groups=1")  # group-limited routing: one of 2 nodes per token
LAYOUTS = {  # name: (processes, layout overrides, overrides shared with the single-process reference)
    "2x2": (4, ["parallel.ep=4", "parallel.ranks_per_node=2", *HIER], ()),
    "2x2-groups": (4, ["parallel.ep=4", "parallel.ranks_per_node=2"], GROUPS),  # auto: spans 2 nodes
    "2x2-overlap-selective": (4, ["parallel.ep=4", "parallel.ranks_per_node=2", "parallel.ep_overlap=true",
                                  "train.activation_checkpointing=selective", *HIER], ()),
    "2x1-fsdp2": (4, ["parallel.ep=2", "parallel.ranks_per_node=1", *HIER], ()),  # 2 EP groups x 2 expert-FSDP
    "pp2x2x1": (4, ["parallel.pp=2", "parallel.ep=2", "parallel.ranks_per_node=1", *HIER], ()),
}
EP_PARAM_TOL = (4e-5, 1e-5)  # tests/parallel/test_equivalence.py's EP bound (combine-side weighting)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hierarchical_layout_reproduces_single_process(name, reference, helpers, tmp_path):
    nproc, overrides, shared = LAYOUTS[name]
    ref_losses, ref_params, ref_dir = reference(*shared)
    losses, params = helpers.run_multi(helpers.small_config(*shared, *overrides), tmp_path, nproc)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    ref_ev, ev = helpers.step_events(ref_dir), helpers.step_events(tmp_path)
    for key in ("tokens_per_expert", "dropped_tokens"):
        assert [e["routing"][key] for e in ev] == [e["routing"][key] for e in ref_ev], key
    assert [e["aux_loss"] for e in ev] == pytest.approx([e["aux_loss"] for e in ref_ev], rel=1e-5)
    assert [e["grad_norm"] for e in ev] == pytest.approx([e["grad_norm"] for e in ref_ev], rel=1e-4)
    for key, ref in ref_params.items():
        assert (params[key] - ref).abs().max().item() < EP_PARAM_TOL[0], key
        assert ((params[key] - ref).norm() / ref.norm().clamp(min=1e-12)).item() < EP_PARAM_TOL[1], key
    for e in ev:  # the node-aware dispatcher ran: its counters are in the step's comm
        assert e["comm"]["inter_node_rows"] > 0 and "dispatch_rows" not in e["comm"]
        if "groups" in name:  # num_groups=2 over 2 nodes, topk_groups=1: no token reaches both
            assert e["comm"]["tokens_by_nodes_reached"][2] == 0


def test_counted_bytes_equal_the_planned_bytes(helpers, tmp_path):
    """Under the fake balanced gate each rank's routing is known, so the bytes the ranks count crossing between
    nodes (summed over ranks by the step) equal moelab.planner.node_dispatch's count exactly."""
    cfg = helpers.small_config("parallel.ep=4", "parallel.ranks_per_node=2", "backend.fake_balanced_gate=true",
                               "model.moe.top_k=4", "train.steps=1", *HIER)
    helpers.run_multi(cfg, tmp_path, 4)
    comm = helpers.step_events(tmp_path)[0]["comm"]
    t, m = cfg.train, cfg.model
    tokens = t.micro_batch_size * t.seq_len  # per rank and micro batch
    micro = t.global_batch_size // (t.micro_batch_size * 4)
    layers = m.num_layers - m.num_dense_layers
    rows = sum(round_robin_node_rows(tokens, m.moe.top_k, m.moe.num_experts, 2, r // 2) for r in range(4))
    assert rows > 0
    assert comm["inter_node_rows"] == rows * micro * layers
    assert comm["inter_node_bytes"] == rows * micro * layers * inter_node_row_bytes(m.hidden_size, 4, m.moe.top_k)
