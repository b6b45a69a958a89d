"""The full language-model loss (`backend.loss: full`, and the reference the fused loss is tested against):
token-mean cross entropy on fp32 logits.

Shapes: B batch, L sequence, V vocabulary.

On CUDA, where the caller gives the logits up (`backward_scale`: the LM head's own loss, moelab.backends.loss), one
Triton kernel computes the loss and writes the logits' gradient over them (moelab.backends.loss_kernel). Otherwise,
with train.compile, the loss is compiled: inductor fuses the fp32 upcast into the log-sum-exp and the gradient
(softmax - one-hot) into one pass writing bf16, instead of materialising fp32 copies of the logits (at vocabulary
151,936 and 8,192 tokens each fp32 copy is 5 GB; eager spends about 10 ms per step there on an H200).

    loss = cross_entropy(logits_BLV, targets_BL, compiled=cfg.train.compile, pad_token_id=cfg.model.pad_token_id)
    loss = cross_entropy(logits_BLV, targets_BL, backward_scale=ctx.loss_scale)   # the logits are the gradient now

Targets equal to -100 or to `pad_token_id` are left out (the mean is over the others). Logits that are a DTensor
sharded on the vocabulary (tensor parallelism) take moelab.backends.vocab_parallel: the same loss, no gather.
"""
from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from moelab.data.sft import IGNORE_INDEX  # targets left out of the loss

IN_PLACE = True  # the in-place kernel where it applies; gpu_perf turns it off to time the compiled loss beside it


def loss_mask(targets_BL: torch.Tensor, pad_token_id: int = -1) -> torch.Tensor | None:
    """Bool [B, L]: the targets that count (neither -100 nor the pad id), or None when the model has no pad id
    (moelab's data never holds -100 then, and the step pays for no mask)."""
    if pad_token_id < 0:
        return None
    return (targets_BL != IGNORE_INDEX) & (targets_BL != pad_token_id)


def _cross_entropy(logits_BLV: torch.Tensor, targets_BL: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BLV.float().flatten(0, 1), targets_BL.flatten())


def _masked_cross_entropy(logits_BLV: torch.Tensor, targets_BL: torch.Tensor) -> torch.Tensor:
    # the mean over the targets that count; a micro batch of padding only gives 0, not nan
    flat = targets_BL.flatten()
    total = F.cross_entropy(logits_BLV.float().flatten(0, 1), flat, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (flat != IGNORE_INDEX).sum().clamp(min=1)


def _is_dtensor(x: torch.Tensor) -> bool:
    """Whether `x` is a DTensor, without importing torch.distributed.tensor on the one-process path (a DTensor
    exists only once that module is loaded)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


@functools.cache
def _compiled_cross_entropy():
    # built on first use: importing torch's compiler costs seconds, which runs that never compile should not pay
    return torch.compile(_cross_entropy, dynamic=False)


def cross_entropy(logits_BLV: torch.Tensor, targets_BL: torch.Tensor, compiled: bool = False,
                  pad_token_id: int = -1, backward_scale: float | None = None) -> torch.Tensor:
    """The mean loss; `backward_scale` given, the caller gives the logits up to the in-place kernel where it applies
    (the scale backward is expected to bring; see the module docstring)."""
    if pad_token_id >= 0:  # the pad id's targets left out as -100's are
        targets_BL = targets_BL.masked_fill(targets_BL == pad_token_id, IGNORE_INDEX)
    if _is_dtensor(logits_BLV):  # vocabulary-sharded logits (tensor parallelism's loss parallel)
        from moelab.backends.vocab_parallel import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(logits_BLV, targets_BL)
    if backward_scale is not None and IN_PLACE:
        from moelab.backends import loss_kernel

        if loss_kernel.applies(logits_BLV.flatten(0, 1)):
            return loss_kernel.cross_entropy_in_place(logits_BLV.flatten(0, 1), targets_BL.flatten(), backward_scale)
    if pad_token_id >= 0:
        return _masked_cross_entropy(logits_BLV, targets_BL)
    if compiled and logits_BLV.is_cuda:
        return _compiled_cross_entropy()(logits_BLV, targets_BL)
    return _cross_entropy(logits_BLV, targets_BL)
