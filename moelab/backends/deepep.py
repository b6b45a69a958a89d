"""DeepEP's intranode (NVLink) normal kernels as the expert-parallel dispatcher.

Shapes (docs/shapes.md): T tokens on this rank, K top-k, D hidden, W tokens received from all EP ranks (each
token once per rank that owns one of its experts), N routed rows on this rank sorted by local expert, X local experts.

Same interface as moelab.model.moe.LocalDispatcher: ``dispatch(x_TD, experts_TK, keep_TK, num_experts) ->
(x_ND, counts_X, ctx)`` and ``combine(y_ND, ctx, weights_TK, keep_TK, counts_X) -> y_TD``. DeepEP sends each token
once per destination rank (not once per expert) and sums the ranks' results on the way back, so the top-k
weights are applied on the expert side: they travel through the same cached layout at combine time (bf16, the
dtype MoE computes them in, so nothing is lost). Dispatch and combine are autograd functions whose backward is
the other one over the same handle. DeepEP reads the received counts on the host (one synchronisation per
layer, as the all-to-all path does for its split sizes).

    dispatcher = DeepEPDispatcher(ep_group)   # one buffer per process serves every layer
    for moe in model.moe_layers(): moe.dispatcher = dispatcher
"""
from __future__ import annotations

import torch

from moelab.backends.packages import import_package
from moelab.model.moe import Dispatcher


def buffer_bytes(hidden: int, num_ranks: int, dtype_bytes: int = 2) -> int:
    """NVLink buffer size: DeepEP's configs keep at most a few thousand tokens of `hidden` in flight per
    channel pair; 1 GB (what DeepEP's own tests use) covers hidden <= 7168 on up to 8 ranks."""
    return max(int(1e9), 2 * num_ranks * 4096 * hidden * dtype_bytes)


class _Dispatch(torch.autograd.Function):
    """x_TD -> recv_WD. The first call of a layer passes DeepEP's layout arguments in `layout["args"]` and leaves
    the handle, received expert ids and counts in `layout`; later calls reuse the handle (cached mode)."""

    @staticmethod
    def forward(ctx, x_TD, buffer, layout: dict):
        if "handle" in layout:
            recv_WD, *_ = buffer.dispatch(x_TD, handle=layout["handle"])
        else:
            recv_WD, recv_idx_WK, _, counts, handle, _ = buffer.dispatch(x_TD, **layout.pop("args"))
            layout.update(handle=handle, recv_idx_WK=recv_idx_WK, counts=counts)
        ctx.buffer, ctx.handle = buffer, layout["handle"]
        return recv_WD

    @staticmethod
    def backward(ctx, grad_recv):
        grad_x, _, _ = ctx.buffer.combine(grad_recv.contiguous(), ctx.handle)
        return grad_x, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_WD, buffer, handle):
        y_TD, _, _ = buffer.combine(y_WD, handle)
        ctx.buffer, ctx.handle = buffer, handle
        return y_TD

    @staticmethod
    def backward(ctx, grad_TD):
        grad_W, *_ = ctx.buffer.dispatch(grad_TD.contiguous(), handle=ctx.handle)
        return grad_W, None, None


class DeepEPDispatcher(Dispatcher):
    """Expert-parallel dispatch/combine through DeepEP over `group` (the EP process group).

        moe.dispatcher = DeepEPDispatcher(ep_group, hidden=cfg.model.hidden_size)   # backend.dispatcher=deepep
    """

    def __init__(self, group, hidden: int = 7168):
        deep_ep = import_package("deep_ep")
        self.group = group
        self.buffer = deep_ep.Buffer(group, buffer_bytes(hidden, group.size()), 0)

    def dispatch(self, x_TD, experts_TK, keep_TK, num_experts):
        T, K = experts_TK.shape
        topk_idx = experts_TK.to(torch.int64)
        if keep_TK is not None:
            topk_idx = torch.where(keep_TK, topk_idx, -1)
        buf = self.buffer
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
        ones_TK = torch.ones(T, K, dtype=torch.float32, device=x_TD.device)
        layout = {"args": dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=ones_TK)}
        recv_x = _Dispatch.apply(x_TD.contiguous(), buf, layout)
        handle, recv_idx_WK, counts_list = layout["handle"], layout["recv_idx_WK"], layout["counts"]
        # Expert-major order of the valid (row, slot) pairs on this rank.
        flat_N = recv_idx_WK.reshape(-1)
        key_N = torch.where(flat_N >= 0, flat_N, num_experts // self.group.size())
        total = sum(counts_list)  # already on the host: DeepEP waited for the counts
        order_N = torch.argsort(key_N, stable=True)[:total]
        counts_X = torch.tensor(counts_list, dtype=torch.int64, device=x_TD.device)
        ctx = (handle, order_N, recv_x.shape[0], K)
        return recv_x[order_N // K], counts_X, ctx

    def combine(self, y_ND, ctx, weights_TK, keep_TK, counts_X):
        handle, order_N, R, K = ctx
        w_TK = weights_TK.to(y_ND.dtype)
        if keep_TK is not None:
            w_TK = w_TK * keep_TK
        # The top-k weights, as bf16 rows of K, through the same layout (backward: combine of their gradients).
        recv_w_WK = _Dispatch.apply(w_TK.contiguous(), self.buffer, {"handle": handle})
        w_N = recv_w_WK.reshape(-1)[order_N]
        y_WD = torch.zeros(R, y_ND.shape[1], dtype=y_ND.dtype, device=y_ND.device)
        y_WD = y_WD.index_add(0, order_N // K, y_ND[: order_N.shape[0]] * w_N[:, None])
        return _Combine.apply(y_WD, self.buffer, handle)
