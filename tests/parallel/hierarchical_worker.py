"""Rank side of test_ep_hierarchical.py: the node-aware dispatcher against the flat all-to-all on the same routing.

    python hierarchical_worker.py OUT_DIR RANKS_PER_NODE      (4 or 8 ranks, started by moelab.launch.local.launch)

Each rank routes T random tokens to top-K of E experts held X per rank by real grouped-GEMM experts (the same
weights on every layout: drawn from the global seed, then sharded). Both dispatchers run the same inputs; each
rank writes to OUT_DIR/rank{r}.json the outputs, the gradients of tokens, weights and expert weights, the
counts the hierarchical dispatcher kept and the (token, other node) pairs counted from the routing here.
Cases: learned-like random routing, with capacity drops (a keep mask), node-limited (each token's experts on one
node), and each of them through ep_overlap's two-chunk node-local exchange.
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moelab.launch.entry import end_process
from moelab.model.experts import GroupedExperts
from moelab.parallel import expert_parallel
from moelab.parallel.ep_hierarchical import HierarchicalDispatcher, NodeGroups
from moelab.parallel.expert_parallel import AllToAllDispatcher, shard_experts

T, K, D, F = 12, 4, 8, 16


def routing(rank, world, E, case):
    gen = torch.Generator().manual_seed(100 + rank)
    x_TD = torch.randn(T, D, generator=gen)
    scores_TE = torch.rand(T, E, generator=gen)
    if case == "node_limited":  # two nodes' worth of experts: each token keeps to one half of them
        half_T = torch.randint(0, 2, (T, 1), generator=gen)
        owner_E = torch.arange(E) // (E // 2)
        scores_TE = torch.where(owner_E[None] == half_T, scores_TE, -1.0)
    w_TK, experts_TK = scores_TE.topk(K, dim=-1)
    w_TK = w_TK.softmax(-1)
    keep_TK = torch.rand(T, K, generator=gen) > 0.25 if case == "capacity" else None
    return x_TD, w_TK, experts_TK, keep_TK


def run(dispatcher, experts, x_TD, w_TK, experts_TK, keep_TK, E):
    x_TD = x_TD.clone().requires_grad_()
    w_TK = w_TK.clone().requires_grad_()
    for p in experts.parameters():
        p.grad = None
    weights_TK = w_TK if keep_TK is None else w_TK * keep_TK
    events = []

    def logged(*args):
        events.append("experts")
        return experts(*args)

    start, wait = expert_parallel._Travel.start, expert_parallel._Travel.wait
    expert_parallel._Travel.start = lambda self, *a: (events.append("start"), start(self, *a))[1]
    expert_parallel._Travel.wait = lambda self: (events.append("wait"), wait(self))[1]
    try:
        y_TD = dispatcher.route(logged, x_TD, weights_TK, experts_TK, keep_TK, E)
    finally:
        expert_parallel._Travel.start, expert_parallel._Travel.wait = start, wait
    (y_TD * torch.linspace(-1, 1, D)).square().sum().backward()
    return {"y": y_TD.reshape(-1).tolist(), "x_grad": x_TD.grad.reshape(-1).tolist(),
            "w_grad": w_TK.grad.reshape(-1).tolist(),
            "expert_grads": [p.grad.reshape(-1).tolist() for p in experts.parameters()], "events": events}


def other_node_pairs(experts_TK, keep_TK, X, rpn, rank):
    """The (token, other node) pairs, counted from the routing alone (what moelab.planner.node_dispatch counts)."""
    node_TK = experts_TK // X // rpn
    own = rank // rpn
    kept = keep_TK if keep_TK is not None else torch.ones_like(experts_TK, dtype=torch.bool)
    return sum(len({int(n) for n, k in zip(node_TK[t], kept[t]) if k} - {own}) for t in range(T))


def main(out: Path, rpn: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    E = 2 * world
    X = E // world
    full = GroupedExperts(E, D, F)
    torch.manual_seed(0)
    for p in full.parameters():
        p.data.normal_()
    experts = GroupedExperts(E, D, F)
    shard_experts(experts, rank, world)
    for p, q in zip(experts.parameters(), full.parameters()):
        p.data.copy_(q.data[rank * X:(rank + 1) * X])
    group = dist.group.WORLD
    nodes = NodeGroups.build(group, rpn)
    result = {"node_of": nodes.node_of, "local_of": nodes.local_of}
    for case in ("random", "capacity", "node_limited"):
        args = routing(rank, world, E, case)
        for overlap in (False, True):
            hier = HierarchicalDispatcher(group, nodes, overlap=overlap)
            got = run(hier, experts, *args, E)
            got["counts"] = hier.counts.pop()
            result[f"{case}{'_overlap' if overlap else ''}"] = got
        result[f"{case}_flat"] = run(AllToAllDispatcher(group), experts, *args, E)
        result[f"{case}_pairs"] = other_node_pairs(args[2], args[3], X, rpn, rank)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    end_process(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
