"""What one forward needs to know about its batch besides the tokens and their positions.

The trainer builds one per micro batch and passes it down the forward call (model -> blocks -> attention and
MoE layers), so no module holds per-batch state between calls: a reader sees everything a layer depends on in
its arguments, and a pipeline schedule hands it to every stage as a keyword argument (replicated over the
micro batches: it holds only what is the same for all of them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchContext:
    """The per-batch inputs of a forward other than the tokens: which tokens count, the packed documents, and the
    weight of this micro batch in the step's loss (the router losses' gradient scale). None of them: the default.

        ctx = BatchContext(token_mask_BL=targets_BL != pad_id, loss_scale=1 / micro_batches)
        logits_BLV = model(tokens_BL, positions_L, ctx=ctx)
    """
    # Bool [B, L]: the tokens that count (moelab.backends.full_loss.loss_mask); padding stays out of the router's aux and
    # z losses and statistics. None: every token.
    token_mask_BL: torch.Tensor | None = None
    # Long [B, L]: each token's document in a packed sequence (moelab.data.sft_batches); attention stays within
    # a document. None: plain causal attention.
    documents_BL: torch.Tensor | None = None
    # The router losses' weight in backward (moelab.model.moe.AttachLoss): 1 / micro batches per step.
    loss_scale: float = 1.0


NO_CONTEXT = BatchContext()
