"""The planner's rows per token of an expert exchange (moelab.planner.dispatch) against the experts moelab's real
router picks (moelab.model.router.Router): the fake balanced gate's destinations exactly, a learned router's
within the sampling error of the tokens drawn, node-limited routing never above its limit; and the plan's bytes
are those rows times the tokens, the hidden size and the exchanges."""
import math

import pytest
import torch

from moelab.config import load_config
from moelab.config.schema import MoEConfig
from moelab.model.router import Router
from moelab.layout.dims import hierarchical_dispatch
from moelab.planner.dispatch import destinations, exchange_rows
from moelab.planner.node_dispatch import nodes_per_token
from moelab.planner.plan import plan

SEED = 0


def routed(moe: MoEConfig, tokens: int, fake: bool) -> torch.Tensor:
    """experts_TK of a real router over random inputs (a learned router with random weights: scores iid)."""
    torch.manual_seed(SEED)
    router = Router(32, moe, fake_balanced_gate=fake)
    torch.nn.init.normal_(router.weight)
    router.reset_buffers()
    with torch.no_grad():
        return router(torch.randn(1, tokens, 32))[1]


def reached(experts_TK: torch.Tensor, block: int) -> torch.Tensor:
    """Distinct blocks of `block` consecutive experts per token."""
    b = experts_TK // block
    return torch.tensor([len(set(row.tolist())) for row in b], dtype=torch.float64)


@pytest.mark.parametrize("E, K, ep", [(256, 8, 64), (128, 4, 64), (384, 8, 32), (64, 8, 8), (24, 4, 16)])
def test_the_fake_gates_destinations_are_counted_exactly(E, K, ep):
    moe = MoEConfig(num_experts=E, top_k=K)
    experts = routed(moe, 4 * E, fake=True)
    for blocks in (ep, max(ep // 8, 1)):  # ranks, nodes of 8
        got = reached(experts, E // blocks).mean().item()
        assert destinations(moe, blocks, fake_balanced=True) == pytest.approx(got, rel=1e-12), blocks


def test_a_learned_routers_destinations_are_the_uniform_count_within_sampling_error():
    moe = MoEConfig(num_experts=64, top_k=8)
    n = 4096
    per_token = reached(routed(moe, n, fake=False), 64 // 8)
    bound = 4 * per_token.std().item() / math.sqrt(n)  # 4 standard errors of the mean of n tokens
    assert destinations(moe, 8, fake_balanced=False) == pytest.approx(per_token.mean().item(), abs=bound)


def test_node_limited_routing_caps_the_copies_between_nodes():
    # 8 nodes of the EP group, experts grouped by node, each token's experts from at most 4 of them
    moe = MoEConfig(num_experts=64, top_k=8, num_groups=8, topk_groups=4)
    per_token = reached(routed(moe, 2048, fake=False), 64 // 8)
    assert per_token.max().item() <= 4
    # the chosen groups hold the best scores, so they share the K more evenly than uniform picks: the count is
    # a lower bound, within the sampling error below the limit
    planned = destinations(moe, 8, fake_balanced=False, nodes=8)
    assert planned <= per_token.mean().item() + 4 * per_token.std().item() / math.sqrt(2048)
    x = exchange_rows(moe, ep=64, ranks_per_node=8, dispatcher="hierarchical", fake_balanced=False)
    assert x.inter == pytest.approx(planned * 7 / 8) and x.inter < 4
    free = exchange_rows(MoEConfig(num_experts=64, top_k=8), 64, 8, "hierarchical", False)
    assert free.inter > x.inter


def test_hierarchical_sends_a_token_once_per_other_node_and_fans_out_inside():
    moe = load_config("deepseek-v3").model.moe
    flat = exchange_rows(moe, 64, 8, "flat", fake_balanced=False)
    hier = exchange_rows(moe, 64, 8, "hierarchical", fake_balanced=False)
    assert flat.inter == pytest.approx(8 * 56 / 64) and flat.intra == pytest.approx(8 * 7 / 64)
    assert hier.inter < moe.topk_groups and hier.inter < flat.inter / 2
    assert hier.intra == pytest.approx(8 * 7 / 8) and hier.stages == 2
    # inside one node nothing crosses the fabric and auto keeps the flat exchange
    auto = load_config("deepseek-v3", {"parallel.ep": 8}).parallel
    assert not hierarchical_dispatch(auto, 8) and hierarchical_dispatch(load_config("deepseek-v3").parallel, 8)
    # the planner's nodes per token are the dispatcher's own count (moelab.planner.node_dispatch)
    assert hier.inter == pytest.approx(nodes_per_token(moe, 8) * 7 / 8)
    assert exchange_rows(moe, 8, 8, "flat", False).inter == 0


def test_the_plan_counts_rows_times_tokens_hidden_and_exchanges():
    cfg = load_config("deepseek-v3", {"train.optimizer_state": "bf16_moments"})
    p = plan(cfg, gpus=256, gpu="h100")
    c, T, D = p.comm, 4096, cfg.model.hidden_size
    x = exchange_rows(cfg.model.moe, 64, 8, "hierarchical", fake_balanced=False)
    assert c["ep_dispatch"] == "hierarchical" and c["exchanges_per_moe_layer"] == 6  # full recompute reruns them
    assert c["all_to_all_inter_node_bytes_per_moe_layer"] == int(6 * T * D * 2 * x.inter)
    assert c["all_to_all_intra_node_bytes_per_moe_layer"] == int(6 * T * D * 2 * x.intra)
    assert c["all_to_all_bytes_per_moe_layer"] == (c["all_to_all_inter_node_bytes_per_moe_layer"]
                                                   + c["all_to_all_intra_node_bytes_per_moe_layer"])
    sel = plan(cfg.replace(**{"train.activation_checkpointing": "selective"}), gpus=256, gpu_memory_gb=1e4).comm
    assert sel["exchanges_per_moe_layer"] == 4
    # DeepEP's intranode dispatcher sends a token once per destination rank, fewer rows than one per expert
    once = exchange_rows(cfg.model.moe, 8, 8, "deepep", False)
    assert once.intra < exchange_rows(cfg.model.moe, 8, 8, "flat", False).intra


def test_the_hierarchical_exchange_times_its_two_collectives_in_line_at_the_published_fabric_rate():
    from moelab.planner.gpus import gpu_kind
    from moelab.planner.rates import H200_MEASURED, PUBLISHED, rates

    # Qwen3-30B-A3B with its EP group over two nodes: parallel.ep_dispatch=auto runs the hierarchical exchange
    cfg = load_config("qwen3-moe-30b-a3b", {"parallel.ep": 16, "parallel.fsdp": 16, "train.global_batch_size": 64,
                                            "train.activation_checkpointing": "selective"})
    p = plan(cfg, gpus=16, gpu="h100", gpu_memory_gb=1e4)
    c, n, m = p.comm, p.comm["exchanges_per_moe_layer"], p.micro_batches_per_step
    assert c["ep_dispatch"] == "hierarchical" and n == 4 and c["exchange_stages"] == 2
    r = rates(gpu_kind("h100"), balanced=False)
    assert r.ib == pytest.approx(50e9 * PUBLISHED["ib_fraction"][0])
    one = (c["all_to_all_intra_node_bytes_per_moe_layer"] / n / r.nvlink
           + c["all_to_all_inter_node_bytes_per_moe_layer"] / n / r.ib + 2 * H200_MEASURED["exchange_s"][0])
    assert p.speed.parts_s["all_to_all"] == pytest.approx(m * 48 * n * one, rel=1e-9)
    # the flat exchange of the same layout sends top_k rows, 8 of 15 partners on the other node
    flat = exchange_rows(cfg.model.moe, 16, 8, "flat", fake_balanced=False)
    rows = exchange_rows(cfg.model.moe, 16, 8, "hierarchical", fake_balanced=False)
    assert rows.inter < flat.inter / 3
