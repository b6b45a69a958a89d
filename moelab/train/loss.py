"""The language-model loss, as the trainer's modules import it: token-mean cross entropy in fp32 (-100 and the pad
id left out). It lives with the LM head in moelab.backends.loss (the model computes its loss inside its forward,
backend.loss: the fused chunked loss by default, or the whole logits); this module re-exports the logits form.

    loss = cross_entropy(logits_BLV, targets_BL, compiled=cfg.train.compile, pad_token_id=cfg.model.pad_token_id)
"""
from __future__ import annotations

from moelab.backends.loss import IGNORE_INDEX, cross_entropy, loss_mask  # noqa: F401
