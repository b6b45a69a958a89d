"""Held-out evaluation (train.eval_every): the mean next-token loss on train.eval_batches global batches of the
validation data, and its perplexity, as an ``eval`` event.

The evaluation batches are fixed (moelab.train.data.eval_batch) and split over the data-parallel ranks exactly
as training batches are, and the losses are summed through the same weighting as the training loss: the same
number on every layout. The forward runs without gradient and in eval mode (no router losses); the routing
statistics it leaves in the routers are discarded, so the next training step reports only its own routing.

    ev = Evaluator(trainer); ev.run(step=100)     # {"step": 100, "loss": 2.31, "perplexity": 10.1, ...}
"""
from __future__ import annotations

import math

import torch

from moelab.train.data import eval_batch, make_eval_dataset
from moelab.train.loss import cross_entropy


class Evaluator:
    """Evaluates the trainer's model on the held-out data (see the module docstring).

        Evaluator(trainer).run(step)["perplexity"]
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.dataset = make_eval_dataset(trainer.cfg, trainer.dataset, progress=trainer.progress)

    @torch.no_grad()
    def run(self, step: int) -> dict:
        tr = self.trainer
        t, par, dev = tr.cfg.train, tr.par, tr.env.device
        model = tr.model
        was_training = model.training
        model.eval()
        loss_sum = torch.zeros((), device=dev)
        try:
            for b in range(t.eval_batches):
                for i in range(tr.micro_per_rank):
                    first = (par.dp_rank * tr.micro_per_rank + i) * t.micro_batch_size
                    batch = eval_batch(self.dataset, tr.cfg, b, first, t.micro_batch_size).to(dev)
                    inputs, targets = par.shard_sequence(batch[:, :-1]), par.shard_sequence(batch[:, 1:])
                    with torch.autocast(dev.split(":")[0], dtype=tr.dtype,
                                        enabled=tr.dtype != torch.float32 and not par.casts_params):
                        logits = model(inputs, par.positions(t.seq_len, dev))
                    loss_sum += cross_entropy(logits, targets, compiled=False).float()
        finally:
            model.train(was_training)
            for moe in par.moe_layers:
                moe.router.pop_stats()  # this forward's routing is not the next step's
        total = par.all_reduce_sum(par.loss_contribution(loss_sum)).item()
        loss = total / (t.eval_batches * tr.micro_per_rank * par.dp_size)
        return {"step": step, "loss": loss, "perplexity": math.exp(min(loss, 700.0)),
                "batches": t.eval_batches, "tokens": t.eval_batches * t.global_batch_size * t.seq_len}
