"""Cross entropy on vocabulary-sharded logits (tensor parallelism's loss parallel): no rank holds the whole
logits, three all-reduces of [T] vectors over the TP group take the place of the gather.

Shapes: B batch, L sequence, T = B x L tokens, V vocabulary, Vr = V / tp this rank's vocabulary rows.

The logits arrive as a DTensor sharded on its last dimension (moelab.parallel.tensor shards the LM head by
vocabulary rows); the loss is the token mean over the targets that count (not -100) on every TP rank, in fp32,
as moelab.backends.full_loss computes it from the whole logits. Only the order of the sums over the vocabulary
differs from one process (the max and the sum of exponentials are taken per shard, then combined).

    loss = vocab_parallel_cross_entropy(logits_BLV, targets_BL)     # logits_BLV: DTensor, Shard(2) over TP
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from moelab.data.sft import IGNORE_INDEX


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of local logits [T, Vr] whose columns start at global vocabulary index `v0`; the
    gradient (softmax - one-hot) / count is computed in forward and only scaled in backward."""

    @staticmethod
    def forward(ctx, logits_TVr, targets_T, v0: int, group):
        logits_TVr = logits_TVr.float()
        max_T = logits_TVr.max(dim=-1).values
        dist.all_reduce(max_T, op=dist.ReduceOp.MAX, group=group)
        exp_TVr = (logits_TVr - max_T[:, None]).exp()
        sum_T = exp_TVr.sum(dim=-1)
        dist.all_reduce(sum_T, group=group)
        Vr = logits_TVr.shape[-1]
        mine_T = (targets_T >= v0) & (targets_T < v0 + Vr)
        index_T1 = (targets_T - v0).clamp(0, Vr - 1)[:, None]
        target_T = torch.where(mine_T, logits_TVr.gather(1, index_T1)[:, 0], 0.0)
        dist.all_reduce(target_T, group=group)
        valid_T = targets_T != IGNORE_INDEX
        count = valid_T.sum().clamp(min=1)
        loss = ((sum_T.log() + max_T - target_T) * valid_T).sum() / count
        grad_TVr = exp_TVr / sum_T[:, None]
        grad_TVr.scatter_add_(1, index_T1, -mine_T.to(grad_TVr.dtype)[:, None])
        ctx.save_for_backward(grad_TVr * (valid_T[:, None] / count))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad_TVr,) = ctx.saved_tensors
        return grad_TVr * grad_loss, None, None, None


def vocab_parallel_cross_entropy(logits_BLV, targets_BL: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss of DTensor logits sharded on the vocabulary (the last dimension) over one mesh
    dimension; the same value on every rank of that mesh."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    (placement,) = logits_BLV.placements
    if not (isinstance(placement, Shard) and placement.dim in (-1, logits_BLV.dim() - 1)):
        raise ValueError(f"vocab_parallel_cross_entropy needs logits sharded on the vocabulary, not {placement}")
    _, offset = compute_local_shape_and_global_offset(logits_BLV.shape, logits_BLV.device_mesh,
                                                      logits_BLV.placements)
    local_BLVr = logits_BLV.to_local()
    return _VocabParallelCrossEntropy.apply(local_BLVr.flatten(0, 1), targets_BL.flatten(), int(offset[-1]),
                                            logits_BLV.device_mesh.get_group())
