"""The language-model loss: token-mean cross entropy on fp32 logits.

Shapes: B batch, L sequence, V vocabulary.

With train.compile the loss is compiled too: inductor fuses the fp32 upcast into the log-sum-exp and the
gradient (softmax - one-hot) into one pass writing bf16, instead of materialising fp32 copies of the logits
(at vocabulary 151,936 and 8,192 tokens each fp32 copy is 5 GB; eager spends about 10 ms per step there on an
H200).

    loss = cross_entropy(logits_BLV, targets_BL, compiled=cfg.train.compile)
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def _cross_entropy(logits_BLV: torch.Tensor, targets_BL: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BLV.float().flatten(0, 1), targets_BL.flatten())


@functools.cache
def _compiled_cross_entropy():
    # built on first use: importing torch's compiler costs seconds, which runs that never compile should not pay
    return torch.compile(_cross_entropy, dynamic=False)


def cross_entropy(logits_BLV: torch.Tensor, targets_BL: torch.Tensor, compiled: bool = False) -> torch.Tensor:
    if compiled and logits_BLV.is_cuda:
        return _compiled_cross_entropy()(logits_BLV, targets_BL)
    return _cross_entropy(logits_BLV, targets_BL)
