"""DeepEP's intranode (NVLink) normal kernels as the expert-parallel dispatcher (``backend.dispatcher=deepep``).

Shapes (docs/shapes.md): T tokens on this rank, K top-k, D hidden, W tokens received from all EP ranks (each
token once per rank that owns one of its experts), N routed rows on this rank sorted by local expert, X local
experts, R EP ranks; 32 and 16 are literal widths (the weights' rows padded to DeepEP's top-k limit, and a
32-byte bf16 row).

Same interface as moelab.model.moe.LocalDispatcher and AllToAllDispatcher: ``dispatch(x_TD, experts_TK, keep_TK,
num_experts) -> (x_ND, counts_X, ctx)`` and ``combine(y_ND, ctx, weights_TK, keep_TK, counts_X) -> y_TD``, with
the same routing and the same rows in the same order for the experts (by local expert, then source rank, then
token), so the losses match all_to_all's up to the rounding of the sums. How the exchange differs:
  1. ``get_dispatch_layout`` turns the top-k expert ids (-1 for dropped assignments) into per-rank counts;
  2. ``dispatch`` sends each token ONCE per destination rank (not once per expert); DeepEP's host waits for the
     received counts (the layer's one synchronisation, as the all-to-all path has for its split sizes);
  3. the received rows are gathered into local-expert-major order for the grouped GEMM;
  4. combine: this rank's rows of a token are summed with their router weights (fp32, sent through the same
     layout by a cached dispatch: the weights are only known at combine), and DeepEP's ``combine`` sums the ranks'
     partial outputs (in fp32, written as bf16: its combine kernel takes bf16 only, hence train.dtype=bfloat16).
Backward, as in DeepEP's examples: dispatch's backward is a combine over the same handle, combine's a cached
dispatch; the weights' gradient comes back through combine's top-k weight channel. One ``deep_ep.Buffer``
(its NVLink buffer sized by DeepEP's own hint) serves every MoE layer of the process; the trainer frees it at the
end of a run on every rank together (``close_dispatchers``: DeepEP's destroy is a barrier over NVLink). A run
that fails leaves it to the process's exit, without that barrier, so that a dead peer cannot hang it.

The module imports deep_ep only when a dispatcher is built, so the rest of moelab runs without it.

    dispatcher = DeepEPDispatcher(meshes.ep_group, hidden=cfg.model.hidden_size)
    for moe in model.moe_layers(): moe.dispatcher = dispatcher     # moelab.parallel.distributed does this
"""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moelab.backends.packages import import_package
from moelab.config import ConfigError
from moelab.model.moe import Dispatcher
from moelab.parallel.expert_parallel import DispatchCounts, ranks_per_token

WEIGHT_COLUMNS = 32  # the weights' rows: fp32, padded to DeepEP's top-k limit (rows of a multiple of 32 bytes)


class _Dispatch(torch.autograd.Function):
    """x_TD -> recv_WD. Without `layout["handle"]` it calls DeepEP's full dispatch with `layout["args"]` and
    leaves the handle, the received expert ids and per-expert counts in `layout`; with it, a cached dispatch.
    Backward: the gradients of a token's copies summed back on its rank (a combine over the same handle)."""

    @staticmethod
    def forward(ctx, x_TD, buffer, layout: dict):
        if "handle" in layout:
            recv_WD, *_ = buffer.dispatch(x_TD, handle=layout["handle"])
        else:
            recv_WD, recv_idx_WK, _, counts, handle, _ = buffer.dispatch(x_TD, **layout.pop("args"))
            layout.update(handle=handle, recv_idx_WK=recv_idx_WK, counts=counts)
        ctx.buffer, ctx.handle, ctx.dtype = buffer, layout["handle"], x_TD.dtype
        return recv_WD

    @staticmethod
    def backward(ctx, grad_WD):
        grad_TD, _, _ = ctx.buffer.combine(grad_WD.to(torch.bfloat16).contiguous(), ctx.handle)
        return grad_TD.to(ctx.dtype), None, None


class _DispatchWeights(torch.autograd.Function):
    """w_T32 (fp32 router weights, padded) -> w_W32 by a cached dispatch; backward: the fp32 gradients summed back
    through combine's top-k weight channel (its data channel takes bf16 only; a 16-column zero tensor rides it)."""

    @staticmethod
    def forward(ctx, w_T32, buffer, handle):
        w_W32, *_ = buffer.dispatch(w_T32, handle=handle)
        ctx.buffer, ctx.handle = buffer, handle
        return w_W32

    @staticmethod
    def backward(ctx, grad_W32):
        zeros_W16 = grad_W32.new_zeros(grad_W32.shape[0], 16, dtype=torch.bfloat16)
        _, grad_T32, _ = ctx.buffer.combine(zeros_W16, ctx.handle, topk_weights=grad_W32.float().contiguous())
        return grad_T32, None, None


class _Combine(torch.autograd.Function):
    """y_WD (bf16) -> y_TD: each token's rows from every rank summed; backward is a cached dispatch."""

    @staticmethod
    def forward(ctx, y_WD, buffer, handle):
        y_TD, _, _ = buffer.combine(y_WD, handle)
        ctx.buffer, ctx.handle = buffer, handle
        return y_TD

    @staticmethod
    def backward(ctx, grad_TD):
        grad_WD, *_ = ctx.buffer.dispatch(grad_TD.to(torch.bfloat16).contiguous(), handle=ctx.handle)
        return grad_WD, None, None


def check_one_node(group) -> None:
    """DeepEP's intranode kernels map the peers' buffers over NVLink (CUDA IPC): every EP rank on one host."""
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) > 1:
        raise ConfigError(f"backend.dispatcher='deepep': the EP ranks are on hosts {sorted(set(hosts))}; DeepEP's "
                          f"intranode kernels need every EP rank on one node (NVLink). Keep parallel.ep within "
                          f"one node's GPUs, or set backend.dispatcher=all_to_all")


class DeepEPDispatcher(Dispatcher):
    """Expert-parallel dispatch/combine through DeepEP's intranode kernels over `group` (2, 4 or 8 EP ranks).

        moe.dispatcher = DeepEPDispatcher(ep_group, hidden=cfg.model.hidden_size)   # backend.dispatcher=deepep
    """

    exchanges = True

    def __init__(self, group, hidden: int):
        deep_ep = import_package("deep_ep")
        check_one_node(group)
        self.group, self.ep, self.me = group, dist.get_world_size(group), dist.get_rank(group)
        row_bytes = hidden * 2  # bf16 rows
        configs = (deep_ep.Buffer.get_dispatch_config(self.ep), deep_ep.Buffer.get_combine_config(self.ep))
        nvl_bytes = max(c.get_nvl_buffer_size_hint(row_bytes, self.ep) for c in configs)
        self.buffer = deep_ep.Buffer(group, nvl_bytes, 0, explicitly_destroy=True)
        self.counts = DispatchCounts(self.ep)

    def close(self) -> None:
        """Free DeepEP's buffer: collective, every EP rank calls it (its destroy synchronises them over NVLink)."""
        if self.buffer is not None:
            self.buffer.destroy()
            self.buffer = None

    def dispatch(self, x_TD, experts_TK, keep_TK, num_experts):
        T, K = experts_TK.shape
        R, X = self.ep, num_experts // self.ep
        idx_TK = experts_TK.to(torch.int64).contiguous()  # deep_ep.topk_idx_t (64 bits; TOPK_IDX_BITS=32 builds differ)
        if keep_TK is not None:  # dropped assignments: -1, sent nowhere
            idx_TK = torch.where(keep_TK, idx_TK, -1)
        per_rank_R, _, per_expert_E, in_rank_TR, _ = self.buffer.get_dispatch_layout(idx_TK, num_experts)
        self._count(idx_TK, X, R, x_TD)
        ones_TK = torch.ones(T, K, dtype=torch.float32, device=x_TD.device)
        layout = {"args": dict(num_tokens_per_rank=per_rank_R, is_token_in_rank=in_rank_TR,
                               num_tokens_per_expert=per_expert_E, topk_idx=idx_TK, topk_weights=ones_TK)}
        recv_WD = _Dispatch.apply(x_TD.contiguous(), self.buffer, layout)
        handle, recv_idx_WK, counts_X = layout["handle"], layout["recv_idx_WK"], layout["counts"]
        # Local-expert-major order of the received (token, slot) pairs; slots for other ranks' experts are -1.
        flat_WK = recv_idx_WK.reshape(-1)
        key_WK = torch.where(flat_WK >= 0, flat_WK, X)
        order_N = torch.argsort(key_WK, stable=True)[:sum(counts_X)]  # counts are host ints already
        ctx = (handle, order_N, recv_WD.shape[0], K)
        return recv_WD[order_N // K], torch.tensor(counts_X, dtype=torch.int64, device=x_TD.device), ctx

    def combine(self, y_ND, ctx, weights_TK, keep_TK, counts_X):
        handle, order_N, W, K = ctx
        if keep_TK is not None:
            weights_TK = weights_TK * keep_TK
        w_T32 = F.pad(weights_TK.float(), (0, WEIGHT_COLUMNS - K))
        w_W32 = _DispatchWeights.apply(w_T32.contiguous(), self.buffer, handle)
        w_N = w_W32[:, :K].reshape(-1)[order_N]
        # this rank's share of each received token: its local rows, weighted (fp32), then bf16 for DeepEP
        y_WD = y_ND.new_zeros(W, y_ND.shape[1], dtype=torch.float32)
        y_WD = y_WD.index_add(0, order_N // K, y_ND.float() * w_N[:, None])
        y_TD = _Combine.apply(y_WD.to(torch.bfloat16), self.buffer, handle)
        return y_TD.to(torch.promote_types(y_ND.dtype, weights_TK.dtype))  # the dtype all_to_all returns

    def _count(self, idx_TK, X: int, R: int, x_TD) -> None:
        """What DispatchCounts records for the all-to-all path (one small host copy per layer)."""
        flat = torch.where(idx_TK >= 0, idx_TK, R * X).reshape(-1)
        rows_R = torch.bincount(flat // X, minlength=R + 1)[:R]
        host = torch.cat([rows_R, ranks_per_token(torch.where(idx_TK >= 0, idx_TK, R * X), X, R)]).tolist()
        self.counts.add(host[:R], host[R:], self.me, x_TD.shape[-1] * x_TD.element_size())


def close_dispatchers(moe_layers) -> None:
    """Close each distinct dispatcher of these MoE layers that holds resources (DeepEP's buffer); the others
    (local, all-to-all) have nothing to close. Called by the trainer at the end of a run, on every rank."""
    seen = {id(m.dispatcher): m.dispatcher for m in moe_layers}
    for dispatcher in seen.values():
        if hasattr(dispatcher, "close"):
            dispatcher.close()
