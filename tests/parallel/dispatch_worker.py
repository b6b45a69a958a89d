"""Rank side of test_dispatcher.py: the all-to-all dispatcher on hand-made routing (4 experts over 2 ranks).

    python dispatch_worker.py OUT_DIR      (2 ranks, started by moelab.launch.local.launch)

Token t of rank r has features [label, -label] with label = 10 * r + t + 1. The stand-in "experts" multiply
each row by a per-expert scalar s_e = e + 1 (global id), a parameter, so its gradient is checked too. Each rank
writes what it received and computed to OUT_DIR/rank{r}.json; the overlapped dispatcher (parallel.ep_overlap)
runs the same cases through its two-chunk ``route`` (3 tokens: chunks of 1 and 2).
"""
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moelab.launch.entry import end_process
from moelab.model.experts import GroupedExperts
from moelab.parallel import expert_parallel
from moelab.parallel.expert_parallel import AllToAllDispatcher, OverlappedAllToAllDispatcher, shard_experts

EXPERTS_TK = {0: [[0, 2], [1, 3], [2, 0]], 1: [[3, 1], [2, 3], [0, 1]]}
KEEP_TK = {0: [[True, False], [True, True], [True, True]], 1: [[True, True], [True, True], [True, False]]}


def run_case(rank, group, keep, overlap=False):
    T, E, X = 3, 4, 2
    labels = torch.tensor([10.0 * rank + t + 1 for t in range(T)])
    x_TD = torch.stack([labels, -labels], dim=1).requires_grad_()
    experts_TK = torch.tensor(EXPERTS_TK[rank])
    keep_TK = torch.tensor(KEEP_TK[rank]) if keep else None
    weights_TK = torch.tensor([[0.75, 0.25]] * T)
    if keep_TK is not None:
        weights_TK = weights_TK * keep_TK
    scale_X = torch.tensor([rank * X + 1.0, rank * X + 2.0], requires_grad=True)  # this rank's experts
    seen, events = [], []

    def experts(x_MD, counts_X):
        c = len(seen)
        seen.append((x_MD[:, 0].tolist(), counts_X.tolist()))
        events.append(f"experts {c}")
        x_MD = _Mark.apply(x_MD, events, f"experts {c} backward")
        return x_MD * scale_X[torch.repeat_interleave(torch.arange(X), counts_X)][:, None]

    d = (OverlappedAllToAllDispatcher if overlap else AllToAllDispatcher)(group)
    with _log_exchanges(events):
        y_TD = d.route(experts, x_TD, weights_TK, experts_TK, keep_TK, E)
        events.append("backward")
        y_TD[:, 0].sum().backward()  # the first feature only (the second is its negative)
    received = [v for rows, _ in seen for v in rows]
    counts = [sum(c) for c in zip(*[c for _, c in seen])]
    return {"received": received, "counts": counts, "y": y_TD[:, 0].tolist(), "x_grad": x_TD.grad[:, 0].tolist(),
            "scale_grad": scale_X.grad.tolist(), "calls": len(seen), "sent": d.counts.pop(), "events": events}


def run_nothing_arrives(rank, group, overlap):
    """Every token picks experts 0 and 1 (rank 0's): rank 1's real grouped-GEMM experts receive no rows."""
    experts = GroupedExperts(4, 4, 4)
    shard_experts(experts, rank, 2)
    gen = torch.Generator().manual_seed(rank)
    for p in experts.parameters():
        p.data.normal_(generator=gen)
    x_TD = torch.randn(3, 4, generator=gen).requires_grad_()
    d = (OverlappedAllToAllDispatcher if overlap else AllToAllDispatcher)(group)
    y_TD = d.route(experts, x_TD, torch.tensor([[0.75, 0.25]] * 3), torch.tensor([[0, 1], [1, 0], [0, 1]]), None, 4)
    y_TD.square().sum().backward()
    return {"y": y_TD.reshape(-1).tolist(), "x_grad": x_TD.grad.reshape(-1).tolist(),
            "expert_grads": [p.grad.abs().sum().item() for p in experts.parameters()]}


class _Mark(torch.autograd.Function):
    """Identity; notes `label` in `events` when its backward runs."""

    @staticmethod
    def forward(ctx, x, events, label):
        ctx.note = events, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        events, label = ctx.note
        events.append(label)
        return grad, None, None


@contextlib.contextmanager
def _log_exchanges(events):
    """Notes in `events` when an overlapped exchange starts and when it is waited for."""
    start, wait = expert_parallel._Travel.start, expert_parallel._Travel.wait
    expert_parallel._Travel.start = lambda self, *a: (events.append("start"), start(self, *a))[1]
    expert_parallel._Travel.wait = lambda self: (events.append("wait"), wait(self))[1]
    try:
        yield
    finally:
        expert_parallel._Travel.start, expert_parallel._Travel.wait = start, wait


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"plain": run_case(rank, dist.group.WORLD, keep=False),
              "capacity": run_case(rank, dist.group.WORLD, keep=True),
              "overlap": run_case(rank, dist.group.WORLD, keep=False, overlap=True),
              "overlap_capacity": run_case(rank, dist.group.WORLD, keep=True, overlap=True),
              "nothing_arrives": run_nothing_arrives(rank, dist.group.WORLD, overlap=False),
              "nothing_arrives_overlap": run_nothing_arrives(rank, dist.group.WORLD, overlap=True)}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank tears down its connections while a peer's last transfer is in flight
    dist.destroy_process_group()
    # Results are written: end as a moelab rank ends, not through the interpreter's teardown, where a gloo worker
    # still freeing a collective's tensors aborts the process ("terminate called without an active exception")
    end_process(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
