"""Expert parallelism: each of `ep` ranks owns num_experts/ep experts, and tokens travel to them by all-to-all.

Shapes: T tokens on this rank, K top-k, D hidden, E experts (global), R = ep ranks, X = E/R local experts,
N rows this rank sends (kept assignments), W rows it receives (docs/shapes.md).

    moe.dispatcher = AllToAllDispatcher(ep_group)     # moelab.parallel.distributed installs it per MoE layer
    shard_experts(moe.experts, ep_rank, ep)           # keep only this rank's experts (on the meta device)
    scale_expert_gradients(moe.experts, ep)           # the data-parallel mean of their gradients (see below)

One MoE layer's forward, implementing the dispatcher interface of moelab.model.moe (LocalDispatcher):
  1. sort the T*K assignments by expert (dropped ones, when capacity is on, sort last and are not sent);
  2. exchange the per-expert counts with an all-to-all of a tiny [R, X] tensor;
  3. ONE device-to-host copy per layer: the split sizes of the uneven exchange (and the received counts) are
     needed as Python ints by ``all_to_all_single``; this is the layer's only host synchronisation;
  4. an autograd-aware uneven ``all_to_all_single`` (``_AllToAll``) sends the rows;
  5. the rows arrive rank-major ([from rank 0: its rows for my experts 0..X-1], [from rank 1: ...]) and are
     permuted to local-expert-major for the grouped GEMM;
  6. combine reverses 5 and 4 and sums the top-k rows of each token weighted by the router weights.
The backward pass of 4 is the mirrored all-to-all, so gradients take the same route back.

Gradient scale of the experts: each rank's loss is a mean over its own tokens, and an expert's gradient is the
sum over every EP peer's tokens routed to it; FSDP then averages over the expert-FSDP mesh ((dp*cp)/ep ranks).
The data-parallel mean needs 1/(dp*cp), i.e. another 1/ep. ``scale_expert_gradients`` applies it around the
experts module, whatever the dispatcher (gradient into the experts x 1/ep, gradient out of them x ep): exact
for powers of two, and independent of FSDP's custom divide factors (gloo has no PREMUL_SUM, and the factor's
handling on one-rank meshes changed between torch releases).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `scale` in backward."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class _AllToAll(torch.autograd.Function):
    """Uneven all_to_all_single whose backward is the mirrored exchange (output splits <-> input splits)."""

    @staticmethod
    def forward(ctx, x_ND, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        y_WD = x_ND.new_empty((sum(out_splits),) + tuple(x_ND.shape[1:]))
        dist.all_to_all_single(y_WD, x_ND.contiguous(), out_splits, in_splits, group=group)
        return y_WD

    @staticmethod
    def backward(ctx, grad_WD):
        out_splits, in_splits = ctx.splits
        grad_ND = grad_WD.new_empty((sum(in_splits),) + tuple(grad_WD.shape[1:]))
        dist.all_to_all_single(grad_ND, grad_WD.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_ND, None, None, None


def all_to_all(x_ND, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x_ND, out_splits, in_splits, group)


class AllToAllDispatcher:
    """Token dispatch over an expert-parallel process group with torch.distributed's all-to-all.

    The MoE layer keeps `num_experts` global (routing picks among all experts); the experts module holds only
    this rank's X = E/R experts, and receives `counts_X` for them.

        moe.dispatcher = AllToAllDispatcher(meshes.ep_group)
    """

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.me = dist.get_rank(group)
        self.counts = DispatchCounts(self.ep)

    def dispatch(self, x_TD, experts_TK, keep_TK, num_experts):
        T, K = experts_TK.shape
        R, X = self.ep, num_experts // self.ep
        flat_TK = experts_TK.reshape(-1)
        if keep_TK is not None:  # dropped assignments sort last, behind a sentinel expert, and stay here
            flat_TK = torch.where(keep_TK.reshape(-1), flat_TK, num_experts)
        order_TK = torch.argsort(flat_TK, stable=True)
        send_RX = torch.bincount(flat_TK, minlength=num_experts + 1)[:num_experts].view(R, X)
        recv_RX = torch.empty_like(send_RX)
        dist.all_to_all_single(recv_RX, send_RX, group=self.group)  # recv[r, x]: rows from rank r for expert x
        # The one device-to-host copy of this layer (see the module docstring), with the ranks each token reaches.
        host = torch.cat([send_RX.sum(1), recv_RX.sum(1), recv_RX.reshape(-1),
                          ranks_per_token(flat_TK.view(T, K), X, R)]).tolist()
        send_splits, recv_splits = host[:R], host[R:2 * R]
        self.counts.add(send_splits, host[2 * R + R * X:], self.me, x_TD.shape[-1] * x_TD.element_size())
        N, W = sum(send_splits), sum(recv_splits)
        order_N = order_TK[:N]
        x_send_ND = x_TD[order_N // K]
        x_recv_WD = all_to_all(x_send_ND, recv_splits, send_splits, self.group)
        # rank-major -> local-expert-major: a stable sort of the received rows by their local expert
        expert_of_row_W = torch.repeat_interleave(torch.arange(R * X, device=x_TD.device) % X,
                                                  recv_RX.reshape(-1), output_size=W)
        perm_W = torch.argsort(expert_of_row_W, stable=True)
        ctx = (order_N, perm_W, send_splits, recv_splits, T, K)
        return x_recv_WD[perm_W], recv_RX.sum(0), ctx

    def combine(self, y_WD, ctx, weights_TK, keep_TK, counts_X):
        order_N, perm_W, send_splits, recv_splits, T, K = ctx
        y_recv_WD = torch.empty_like(y_WD).index_copy(0, perm_W, y_WD)  # back to rank-major
        y_back_ND = all_to_all(y_recv_WD, send_splits, recv_splits, self.group)
        # dropped assignments were never sent: their rows stay zero (and their weights are zero too)
        y_TKD = y_back_ND.new_zeros(T * K, y_back_ND.shape[-1]).index_copy(0, order_N, y_back_ND)
        return (y_TKD.view(T, K, -1) * weights_TK[..., None]).sum(1)


def ranks_per_token(experts_TK: torch.Tensor, X: int, R: int) -> torch.Tensor:
    """[R ranks, then R + 1 counts]: for each rank, how many tokens send it at least one row; then how many
    tokens reach exactly 0, 1, ..., R ranks. Expert ids >= R * X (dropped assignments) reach no rank."""
    T = experts_TK.shape[0]
    dest_TK = (experts_TK // X).clamp(max=R)
    hit_TR = torch.zeros(T, R + 1, dtype=torch.bool, device=experts_TK.device).scatter_(1, dest_TK, True)[:, :R]
    return torch.cat([hit_TR.sum(0), torch.bincount(hit_TR.sum(1), minlength=R + 1)])


class DispatchCounts:
    """What this rank's dispatches sent since the last ``pop``, counted from the split sizes (host ints the
    dispatcher reads anyway): rows for other ranks and their bytes (one row per kept token-expert assignment,
    what AllToAllDispatcher sends), token-rank pairs for other ranks and their bytes (what a dispatcher that
    sends each token once per destination rank, like DeepEP, would send), and how many tokens reached
    exactly 0..R ranks (own rank included). Forward dispatch only; combine and backward mirror it.

        counts = DispatchCounts(ep=2); counts.add([3, 5], [2, 4, 0, 1, 3], me=0, row_bytes=256)
        counts.pop()["dispatch_bytes"]     # [1280.0]: 5 rows to rank 1
    """

    def __init__(self, ep: int):
        self.ep = ep
        self.pop()

    def add(self, send_splits: list[int], per_token: list[int], me: int, row_bytes: int) -> None:
        R = self.ep
        pairs_R, hist = per_token[:R], per_token[R:]
        rows, pairs = sum(send_splits) - send_splits[me], sum(pairs_R) - pairs_R[me]
        for key, value in (("dispatch_rows", rows), ("dispatch_bytes", rows * row_bytes),
                           ("dispatch_token_ranks", pairs), ("dispatch_once_per_rank_bytes", pairs * row_bytes)):
            self.values[key][0] += value
        self.values["tokens_by_ranks_reached"] = [a + b for a, b in zip(self.values["tokens_by_ranks_reached"], hist)]

    def pop(self) -> dict[str, list[float]]:
        out = getattr(self, "values", None)
        self.values = {k: [0.0] for k in ("dispatch_rows", "dispatch_bytes", "dispatch_token_ranks",
                                          "dispatch_once_per_rank_bytes")}
        self.values["tokens_by_ranks_reached"] = [0.0] * (self.ep + 1)
        return out


def shard_experts(experts: nn.Module, ep_rank: int, ep: int) -> None:
    """Keep experts [ep_rank * X, (ep_rank + 1) * X) of a stacked-experts module built on the meta device:
    every parameter's dim 0 is the expert. `expert_offset` tells init_weights which global experts these are."""
    E = experts.num_experts
    if E % ep:
        raise ValueError(f"moelab.parallel.expert_parallel: {E} experts cannot be split over ep={ep} ranks")
    X = E // ep
    for name, p in list(experts.named_parameters(recurse=False)):
        if p.shape[0] != E:
            raise ValueError(f"moelab.parallel.expert_parallel: {name} has dim 0 = {p.shape[0]}, expected the "
                             f"expert dimension {E}")
        local = torch.empty((X,) + tuple(p.shape[1:]), dtype=p.dtype, device=p.device)
        setattr(experts, name, nn.Parameter(local, requires_grad=p.requires_grad))
    experts.num_experts = X
    experts.expert_offset = ep_rank * X


def scale_expert_gradients(experts: nn.Module, ep: int) -> None:
    """Identity in the forward pass; in backward, the experts' weights get 1/ep of their gradient and the rows
    leaving them get it back (x ep), so only the expert parameters are scaled (see the module docstring)."""

    def pre_hook(module, args):
        return (_ScaleGrad.apply(args[0], float(ep)),) + tuple(args[1:])

    def post_hook(module, args, output):
        return _ScaleGrad.apply(output, 1.0 / ep)

    experts.register_forward_pre_hook(pre_hook)
    experts.register_forward_hook(post_hook)
