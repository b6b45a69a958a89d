"""The bytes of the node-aware expert dispatch (parallel.ep_dispatch=hierarchical, moelab.parallel.ep_hierarchical)
that cross between nodes and inside them: the one count the dispatcher's counters and the planner share.

Per MoE layer, micro batch and rank, in the forward dispatch (combine sends the same rows back, as the summed
output of each node; backward mirrors both), with N nodes in the EP group, G EP ranks per node, D hidden, b the
activation's bytes per element and K top-k:
  - between nodes: one row per (token, other node that holds at least one of its kept experts), each row
    D * b bytes of activation plus its routing, K expert ids and K weights in fp32 (8 K bytes);
  - inside the destination node: one row per (row received, kept expert on another rank of that node), D * b
    bytes (the flat all-to-all of that node's G ranks).

    row = inter_node_row_bytes(hidden=2048, act_bytes=2, top_k=8)                 # 4160
    nodes_per_token(MoEConfig(num_experts=128, top_k=8), nodes=4)                # 3.63 (uniform routing)
    round_robin_node_rows(tokens=8, top_k=2, num_experts=16, nodes=2, own_node=0)  # 4 (fake balanced gate)
"""
from __future__ import annotations

import math


def inter_node_row_bytes(hidden: int, act_bytes: int, top_k: int) -> int:
    """Bytes of one row the dispatch sends to another node: the activation and its K expert ids and K weights
    (fp32, one tensor beside the rows)."""
    return hidden * act_bytes + 8 * top_k


def inter_node_bytes(other_node_rows: float, hidden: int, act_bytes: int, top_k: int) -> float:
    """Forward-dispatch bytes one rank sends to other nodes for `other_node_rows` (token, other node) pairs; the
    combine returns as many rows of D * b bytes (without the routing columns)."""
    return other_node_rows * inter_node_row_bytes(hidden, act_bytes, top_k)


def nodes_per_token(moe, nodes: int) -> float:
    """Nodes a token's top_k experts sit on, expected under uniform routing: nodes * (1 - C(E - E/nodes, K) /
    C(E, K)). Node-limited routing bounds it when its blocks nest in nodes: group-limited (num_groups a multiple
    of `nodes`, topk_groups = M) or rank-limited (routing_ranks a multiple of `nodes`, max_routed_ranks = M):
    M * (1 - C((M - 1) Y, K) / C(M Y, K)) with Y = E/nodes when there is one block per node, else at most
    min(M, the unlimited figure). A share (nodes - 1)/nodes of them are other nodes (symmetric placement).

        nodes_per_token(MoEConfig(num_experts=64, top_k=8, num_groups=8, topk_groups=2), nodes=8)   # 2.00
    """
    E, K = moe.num_experts, moe.top_k
    if nodes <= 1:
        return 1.0
    free = nodes * (1 - math.comb(E - E // nodes, K) / math.comb(E, K))
    limits = [(moe.num_groups, moe.topk_groups)] if moe.num_groups > 1 else []
    if getattr(moe, "max_routed_ranks", 0):
        limits.append((moe.routing_ranks, moe.max_routed_ranks))
    for blocks, M in limits:
        if blocks % nodes == 0 and M < nodes:
            if blocks == nodes:
                Y = E // nodes
                return M * (1 - math.comb((M - 1) * Y, K) / math.comb(M * Y, K))
            return min(float(M), free)
    return free


def round_robin_node_rows(tokens: int, top_k: int, num_experts: int, nodes: int, own_node: int) -> int:
    """Exact (token, other node) pairs one rank sends under backend.fake_balanced_gate (no noise): token t of the
    rank's micro batch picks experts (t K + k) mod E, and node n holds experts [n E/N, (n + 1) E/N). Counted over
    one period of E / gcd(E, K) tokens and its remainder."""
    E, K, per_node = num_experts, top_k, num_experts // nodes

    def rows(count: int) -> int:
        return sum(len({((t * K + k) % E) // per_node for k in range(K)} - {own_node}) for t in range(count))

    period = E // math.gcd(E, K)
    full, rest = divmod(tokens, period)
    return full * rows(period) + rows(rest)
