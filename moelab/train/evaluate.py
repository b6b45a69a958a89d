"""Held-out evaluation (train.eval_every): the mean next-token loss on train.eval_batches global batches of the
validation data, and its perplexity, as an ``eval`` event.

The evaluation batches are fixed (moelab.data.batches.eval_batch) and split over the data-parallel ranks exactly
as training batches are, and the losses are summed through the same weighting as the training loss: the same
number on every layout. Each micro batch's loss is the training loss: the model's own loss path (backend.loss;
the fused one never holds the logits), padding and -100 targets left out and the same token mask given to the
routers (moelab.backends.full_loss.loss_mask). The forward runs without gradient and in eval mode (no router
losses); the routing statistics it leaves in the routers are discarded, so the next training step reports only
its own routing.

    ev = Evaluator(trainer); ev.run(step=100)     # {"step": 100, "loss": 2.31, "perplexity": 10.1, ...}
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from moelab.backends.full_loss import loss_mask
from moelab.data.batches import eval_batch, make_eval_dataset
from moelab.data.transfer import to_device
from moelab.model.batch_context import BatchContext


class Evaluator:
    """Evaluates the trainer's model on the held-out data (see the module docstring).

        Evaluator(trainer).run(step)["perplexity"]
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.dataset = make_eval_dataset(trainer.cfg, trainer.dataset, progress=trainer.progress)

    def run(self, step: int) -> dict:
        tr = self.trainer
        t, par, dev = tr.cfg.train, tr.par, tr.env.device
        loss_sum = torch.zeros((), device=dev)
        with inspecting(tr):
            for b in range(t.eval_batches):
                for first in rank_micro_batches(tr):
                    batch = to_device(eval_batch(self.dataset, tr.cfg, b, first, t.micro_batch_size), dev)
                    loss_sum += inspect_forward(tr, batch[:, :-1], batch[:, 1:]).float()
        total = par.all_reduce_sum(par.loss_contribution(loss_sum)).item()
        loss = total / (t.eval_batches * tr.micro_per_rank * par.dp_size)
        return {"step": step, "loss": loss, "perplexity": math.exp(min(loss, 700.0)),
                "batches": t.eval_batches, "tokens": t.eval_batches * t.global_batch_size * t.seq_len}


def rank_micro_batches(trainer) -> range:
    """The first sample index of each of this rank's micro batches (its data-parallel share, as in training)."""
    mb, n = trainer.cfg.train.micro_batch_size, trainer.micro_per_rank
    first = trainer.par.dp_rank * n * mb
    return range(first, first + n * mb, mb)


@contextmanager
def inspecting(trainer):
    """A gradient-free forward pass outside training: eval mode (no router losses), and the routing statistics
    it leaves in the routers discarded afterwards, so the next step reports only its own routing."""
    model = trainer.model
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
        for moe in trainer.par.moe_layers:
            moe.router.pop_stats()


def inspect_forward(trainer, inputs_BL: torch.Tensor, targets_BL: torch.Tensor | None = None) -> torch.Tensor:
    """The model's logits for this rank's share (sequence-sharded under CP) of `inputs_BL`, as training computes
    them (autocast where training uses it); with `targets_BL`, the mean loss instead, as training computes it
    (the model's loss path, padding and -100 left out of it and out of routing)."""
    par, dev, dtype = trainer.par, trainer.env.device, trainer.dtype
    ctx = None
    if targets_BL is not None:
        targets_BL = par.shard_sequence(targets_BL)
        ctx = BatchContext(token_mask_BL=loss_mask(targets_BL, trainer.cfg.model.pad_token_id))
    with torch.autocast(dev.split(":")[0], dtype=dtype, enabled=dtype != torch.float32 and not par.casts_params):
        return trainer.model(par.shard_sequence(inputs_BL), par.positions(trainer.cfg.train.seq_len, dev),
                             targets_BL=targets_BL, ctx=ctx)
