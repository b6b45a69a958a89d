"""What one token sends in one expert exchange (a dispatch, or the combine that mirrors it), by the dispatcher that
runs and the routing that picks its experts: rows leaving the GPU over NVLink (to a GPU of its node) and over
InfiniBand (to another node), for moelab.planner.plan's bytes and moelab.planner.speed's times; torch-free.

    x = exchange_rows(load_config("deepseek-v3").model.moe, ep=64, ranks_per_node=8, dispatcher="hierarchical",
                      fake_balanced=False)
    x.inter, x.intra        # rows per token: 3.1 to other nodes (<= topk_groups 4), 7 inside a node

The EP group is ep consecutive ranks (moelab.layout.dims), so min(ep, g) of them share a node of g GPUs and the
group spans ep / g nodes. Routing is balanced: a token's destinations are uniform over the group's ranks (the
bytes a rank sends are the mean over its tokens; a token stays on its own rank with probability 1/ep, on its own
node with g/ep). Dispatchers:

- flat (moelab's all_to_all, parallel.ep_dispatch=flat, and auto inside one node): one row per routed expert,
  top_k rows, each to the rank of its expert.
- hierarchical (parallel.ep_dispatch=hierarchical, and auto when the group spans nodes): one copy of the token
  to each other node that holds one of its experts (deduplicated; landing on the GPU of the same local rank), then
  one row per routed expert from there to the expert's GPU inside the node (top_k rows, (g - 1) / g of them to
  another GPU). The combine runs the same rows back (reduced inside the node first).
- once per rank (backend.dispatcher=deepep): one row per destination rank.

Distinct destinations per token: the fake balanced gate (backend.fake_balanced_gate) gives a token top_k
consecutive experts (moelab.model.router's round robin), counted exactly; a learned router is taken as uniform
over the experts, E/n experts per block: n (1 - C(E - E/n, K) / C(E, K)) of n blocks reached; node-limited
routing (model.moe.num_groups = the group's nodes, topk_groups = M < nodes) draws the K experts from M nodes:
M (1 - C((M - 1) X, K) / C(M X, K)), X = E / nodes, so at most M copies cross between nodes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from moelab.planner.node_dispatch import nodes_per_token

@dataclass(frozen=True)
class ExchangeRows:
    """Rows of hidden size one token sends in one exchange, by link, and the dispatcher they were counted for.

        ExchangeRows(intra=7.0, inter=0.875, dispatcher="hierarchical", stages=2)
    """
    intra: float  # rows to other GPUs of the node (NVLink)
    inter: float  # rows to other nodes (InfiniBand)
    dispatcher: str  # "flat", "hierarchical" or "deepep"
    stages: int  # collectives in line per exchange (hierarchical: between nodes, then inside)


def _blocks_reached(E: int, K: int, n: int) -> float:
    """Expected distinct blocks among n equal blocks of E experts holding K distinct uniform picks."""
    return n * (1 - math.comb(E - E // n, K) / math.comb(E, K)) if n > 1 else 1.0


def _consecutive_reached(E: int, K: int, n: int, noise: bool) -> float:
    """Mean distinct blocks (n blocks of E/n) holding K consecutive experts (mod E) from the fake gate's starts:
    multiples of K (its round robin), or any expert with noise (fake_gate_noise shifts the start)."""
    size = E // n
    starts = range(E) if noise else range(0, E * K // math.gcd(E, K), K)
    return sum(len({((s + j) % E) // size for j in range(K)}) for s in starts) / len(starts)


def destinations(moe, blocks: int, fake_balanced: bool, noise: bool = False, nodes: int = 0) -> float:
    """Distinct blocks (ranks, or nodes) of `blocks` one token's top_k experts reach; `nodes`: the EP group's node
    count, for node-limited routing (model.moe.num_groups equal to it, topk_groups < it)."""
    E, K = moe.num_experts, moe.top_k
    if blocks <= 1:
        return 1.0
    if fake_balanced:
        return _consecutive_reached(E, K, blocks, noise)
    G, M = moe.num_groups, moe.topk_groups
    if nodes > 1 and G == nodes and 0 < M < G:  # node-limited: K experts among the M chosen nodes' experts
        per_node = blocks // nodes  # blocks of this count inside one node (1 when counting nodes)
        return _blocks_reached(M * E // G, K, M * per_node)
    return _blocks_reached(E, K, blocks)


def exchange_rows(moe, ep: int, ranks_per_node: int, dispatcher: str, fake_balanced: bool,
                  noise: bool = False) -> ExchangeRows:
    """Rows per token of one exchange on a rank of an EP group of `ep` ranks, `ranks_per_node` GPUs a node;
    `dispatcher`: "flat", "hierarchical" (as it runs: moelab.layout.dims.hierarchical_dispatch) or "deepep" (once
    per rank)."""
    K, g = moe.top_k, ranks_per_node
    if ep <= 1:
        return ExchangeRows(0.0, 0.0, dispatcher, 1)
    on_node = min(ep, g)  # the group's ranks on this rank's node
    nodes = max(ep // g, 1)
    if dispatcher == "hierarchical" and nodes > 1:  # the nodes reached: the dispatcher's own count
        reached = destinations(moe, nodes, True, noise) if fake_balanced else nodes_per_token(moe, nodes)
        return ExchangeRows(K * (g - 1) / g, reached * (nodes - 1) / nodes, dispatcher, 2)
    rows = destinations(moe, ep, fake_balanced, noise, nodes) if dispatcher == "deepep" else float(K)
    return ExchangeRows(rows * (on_node - 1) / ep, rows * (ep - on_node) / ep,
                        "flat" if dispatcher == "hierarchical" else dispatcher, 1)
