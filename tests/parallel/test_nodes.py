"""How nodes split the ranks (parallel.ranks_per_node, parallel.ep_dispatch; moelab.layout.dims): what the
launcher says, what a config sets, when the node-aware dispatcher is chosen, and the layouts it cannot run,
refused with the field, the value and the fix."""
import pytest

from moelab.config import ConfigError, load_config
from moelab.layout.dims import ParallelDims, hierarchical_dispatch, resolve_ranks_per_node
from moelab.planner.node_dispatch import nodes_per_token, round_robin_node_rows


BATCH = ["train.micro_batch_size=1", "train.global_batch_size=48"]  # splits over 6, 8 and 24 ranks


def layout(*overrides, world=8):
    return ParallelDims.build(load_config("tiny", [*BATCH, *overrides]), world).layout


@pytest.mark.parametrize("environ,want", [({"LOCAL_WORLD_SIZE": "4"}, 4), ({"SLURM_NTASKS_PER_NODE": "2"}, 2),
                                          ({"SLURM_TASKS_PER_NODE": "4(x2)"}, 4), ({}, 8)])
def test_ranks_per_node_come_from_the_launcher(environ, want):
    assert resolve_ranks_per_node(layout("parallel.ep=8"), 8, environ) == want


def test_the_config_overrides_the_launcher_to_simulate_nodes():
    assert resolve_ranks_per_node(layout("parallel.ep=4", "parallel.ranks_per_node=2"), 8,
                                  {"LOCAL_WORLD_SIZE": "8"}) == 2


@pytest.mark.parametrize("overrides,rpn,want", [
    (["parallel.ep=8"], 4, True),  # auto: the EP group spans two nodes
    (["parallel.ep=4"], 4, False),  # auto: within one node
    (["parallel.ep=8", "parallel.ep_dispatch=flat"], 4, False),
    (["parallel.ep=4", "parallel.ep_dispatch=hierarchical"], 8, True),  # asked for: one node of 4 EP ranks
    (["parallel.ep=1"], 1, False),
])
def test_auto_picks_the_node_aware_dispatch_when_the_ep_group_spans_nodes(overrides, rpn, want):
    assert hierarchical_dispatch(layout(*overrides), rpn) is want


@pytest.mark.parametrize("overrides,world,field", [
    (["parallel.ranks_per_node=3"], 8, "parallel.ranks_per_node=3: must divide the world size 8"),
    (["parallel.ep=8", "parallel.ranks_per_node=3"], 24, "spans nodes of 3 ranks unevenly"),
    (["parallel.ep=2", "parallel.ranks_per_node=3"], 6, "would straddle two nodes"),
    (["parallel.ranks_per_node=-1"], 8, "parallel.ranks_per_node=-1"),
    (["parallel.ep_dispatch=hierarchical"], 8, "needs parallel.ep > 1"),
    (["parallel.ep=2", "parallel.ep_dispatch=hierarchical", "backend.dispatcher=deepep"], 8,
     "backend.dispatcher='deepep'"),
])
def test_layouts_the_nodes_cannot_run_are_refused(overrides, world, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(")):
        layout(*overrides, world=world)


def test_the_node_count_formulas():
    moe = load_config("tiny", ["model.moe.top_k=4"]).model.moe
    # uniform routing over 2 nodes of 8 experts: 2 * (1 - C(8, 4) / C(16, 4)) = 2 * (1 - 70/1820)
    assert nodes_per_token(moe, 2) == pytest.approx(2 * (1 - 70 / 1820))
    limited = load_config("tiny", ["model.moe.top_k=4", "model.moe.num_groups=2", "model.moe.topk_groups=1"]).model.moe
    assert nodes_per_token(limited, 2) == pytest.approx(1.0)
    assert nodes_per_token(moe, 1) == 1.0
    # round robin, 16 experts, top-4, 2 nodes: tokens 0-1 on node 0, 2-3 on node 1, and so on
    assert round_robin_node_rows(8, 4, 16, 2, own_node=0) == 4
    assert round_robin_node_rows(9, 4, 16, 2, own_node=1) == 5
    assert round_robin_node_rows(4, 3, 16, 2, own_node=0) == 2  # token 2 (experts 6-8) straddles, token 3 (9-11)
