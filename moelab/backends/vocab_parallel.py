"""Cross entropy on vocabulary-sharded logits (tensor parallelism's loss parallel): no rank holds the whole
logits, two all-reduces of [T] vectors over the TP group take the place of the gather.

Shapes: B batch, L sequence, T = B x L tokens, V vocabulary, Vr = V / tp this rank's vocabulary rows, D hidden,
C tokens of one chunk.

Two losses, the TP forms of moelab.backends.loss's `full` and `chunked`, both the token mean over the targets that
count (not -100) on every TP rank, in fp32:

- full: the logits arrive as a DTensor sharded on its last dimension (moelab.parallel.tensor shards the LM head by
  vocabulary rows).
- chunked: the head's weight shard [Vr, D] and the hidden states, gathered over the sequence once; per chunk of C
  tokens this rank's logits [C, Vr] only, their loss terms and both gradients in forward, as the one-process
  chunked loss computes them (never [T, V], nor [T, Vr]). The hidden gradient is this rank's partial sum over its
  vocabulary rows: it is reduce-scattered back to the sequence shards; the weight gradient is this rank's rows.

Only the order of the sums over the vocabulary differs from one process (the max and the sum of exponentials are
taken per shard, then combined).

    loss = vocab_parallel_cross_entropy(logits_BLV, targets_BL)     # logits_BLV: DTensor, Shard(2) over TP
    loss = vocab_parallel_linear_cross_entropy(h_BLD, head.weight, targets_BL, chunk=0, dtype=torch.float32)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from moelab.backends.head_grad import add_weight_grad, weight_grad
from moelab.data.sft import IGNORE_INDEX


def _shard_terms(logits_TVr: torch.Tensor, targets_T: torch.Tensor, v0: int, group):
    """(summed loss of the counted targets, d logits [T, Vr] fp32 = softmax - one-hot, zero on the targets left
    out) of fp32 local logits whose columns start at global vocabulary index `v0`: the max over the vocabulary,
    then the sum of exponentials and the target's logit, each all-reduced over `group`."""
    max_T = logits_TVr.max(dim=-1).values
    dist.all_reduce(max_T, op=dist.ReduceOp.MAX, group=group)
    exp_TVr = (logits_TVr - max_T[:, None]).exp()
    Vr = logits_TVr.shape[-1]
    mine_T = (targets_T >= v0) & (targets_T < v0 + Vr)
    index_T1 = (targets_T - v0).clamp(0, Vr - 1)[:, None]
    sums_2T = torch.stack([exp_TVr.sum(dim=-1), torch.where(mine_T, logits_TVr.gather(1, index_T1)[:, 0], 0.0)])
    dist.all_reduce(sums_2T, group=group)  # the sum of exponentials and the target's logit (on one rank only)
    sum_T, target_T = sums_2T
    valid_T = targets_T != IGNORE_INDEX
    loss = ((sum_T.log() + max_T - target_T) * valid_T).sum()
    d_TVr = exp_TVr / sum_T[:, None]
    d_TVr.scatter_add_(1, index_T1, -mine_T.to(d_TVr.dtype)[:, None])
    return loss, d_TVr * valid_T[:, None]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of local logits [T, Vr] whose columns start at global vocabulary index `v0`; the
    gradient (softmax - one-hot) / count is computed in forward and only scaled in backward."""

    @staticmethod
    def forward(ctx, logits_TVr, targets_T, v0: int, group):
        count = (targets_T != IGNORE_INDEX).sum().clamp(min=1)
        loss, d_TVr = _shard_terms(logits_TVr.float(), targets_T, v0, group)
        ctx.save_for_backward(d_TVr.div_(count))
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss):
        (grad_TVr,) = ctx.saved_tensors
        return grad_TVr * grad_loss, None, None, None


def _vocab_offset(x) -> int:
    """The global vocabulary index of this rank's first row/column of a DTensor sharded on the vocabulary over
    one mesh dimension (the logits' last dimension, or the head weight's first)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    (placement,) = x.placements
    dim = 0 if x.dim() == 2 else x.dim() - 1
    if not (isinstance(placement, Shard) and placement.dim in (dim, dim - x.dim())):
        raise ValueError(f"the vocabulary-parallel loss needs a tensor sharded on the vocabulary (dimension {dim}), "
                         f"not {placement}")
    _, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
    return int(offset[dim])


def vocab_parallel_cross_entropy(logits_BLV, targets_BL: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss of DTensor logits sharded on the vocabulary (the last dimension) over one mesh
    dimension; the same value on every rank of that mesh."""
    v0 = _vocab_offset(logits_BLV)
    return _VocabParallelCrossEntropy.apply(logits_BLV.to_local().flatten(0, 1), targets_BL.flatten(), v0,
                                            logits_BLV.device_mesh.get_group())


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of (h_TD @ w_VrD^T) over the whole vocabulary, this rank holding rows v0.. of the head,
    chunked over tokens; both gradients computed in forward (moelab.backends.loss.ChunkedLinearCrossEntropy's
    scheme) and only scaled in backward: d h is this rank's partial sum, d w its own rows."""

    @staticmethod
    def forward(ctx, h_TD, w_VrD, targets_T, v0: int, group, chunk: int, dtype: torch.dtype):
        w_c = w_VrD.to(dtype)
        count = (targets_T != IGNORE_INDEX).sum().clamp(min=1).float()
        loss = torch.zeros((), dtype=torch.float32, device=h_TD.device)
        dh_TD = torch.empty(h_TD.shape, dtype=dtype, device=h_TD.device)
        dw_VrD = None
        for s in range(0, h_TD.shape[0], chunk):
            h_CD = h_TD[s:s + chunk].to(dtype)
            loss_c, d_CVr = _shard_terms((h_CD @ w_c.t()).float(), targets_T[s:s + chunk], v0, group)
            loss += loss_c
            d_CVr = (d_CVr / count).to(dtype)
            torch.mm(d_CVr, w_c, out=dh_TD[s:s + chunk])
            if dw_VrD is None:
                dw_VrD = weight_grad(d_CVr, h_CD)
            else:
                add_weight_grad(dw_VrD, d_CVr, h_CD)
        ctx.dh_TD, ctx.dw_VrD = dh_TD.to(h_TD.dtype), dw_VrD.to(w_VrD.dtype)
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss):
        dh_TD, dw_VrD = ctx.dh_TD, ctx.dw_VrD
        del ctx.dh_TD, ctx.dw_VrD
        return (dh_TD.mul_(grad_loss.to(dh_TD.dtype)), dw_VrD.mul_(grad_loss.to(dw_VrD.dtype)),
                None, None, None, None, None)


def vocab_parallel_linear_cross_entropy(h_BLD, w_VD, targets_BL: torch.Tensor, chunk: int = 0,
                                        dtype: torch.dtype | None = None) -> torch.Tensor:
    """The mean next-token loss of hidden states `h_BLD` (a DTensor, sequence-sharded or replicated) through a
    head weight `w_VD` that is a DTensor sharded by vocabulary rows over one mesh dimension, chunk by chunk;
    `chunk`: backend.loss_chunk_tokens (0 = auto, for this rank's Vr rows); `dtype`: the matmuls' (default h's)."""
    from torch.distributed.tensor import Partial, Replicate

    from moelab.planner.loss import chunk_tokens

    mesh = w_VD.device_mesh
    v0 = _vocab_offset(w_VD)
    # gathered over the sequence once; its gradient, a partial sum over this rank's vocabulary rows, is
    # reduce-scattered back to the sequence shards
    h_TD = h_BLD.redistribute(mesh, (Replicate(),)).to_local(grad_placements=(Partial(),)).flatten(0, 1)
    w_VrD, targets_T = w_VD.to_local(), targets_BL.flatten()
    C = chunk_tokens(w_VrD.shape[0], h_TD.shape[0], chunk)
    # without gradients (evaluation) the same forward runs and what it keeps for backward is dropped with it
    return _VocabParallelLinearCrossEntropy.apply(h_TD, w_VrD, targets_T, v0, mesh.get_group(), C,
                                                  dtype or h_TD.dtype)
