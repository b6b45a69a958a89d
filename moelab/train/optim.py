"""Optimizer and learning-rate schedule."""
from __future__ import annotations

import math

import torch

from moelab.config import Config


def build_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW; no weight decay on vectors (norms, biases, sinks); fused kernels on CUDA."""
    t = cfg.train
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": t.weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    on_cuda = any(p.is_cuda for p in decay)
    for g in groups:
        g["lr_scale"] = 1.0
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=t.lr, betas=(t.beta1, t.beta2),
                             fused=on_cuda or None)


def lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up over warmup_steps, then cosine decay to lr * min_lr_ratio at the last step (1-based)."""
    t = cfg.train
    if t.warmup_steps and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    span = max(t.steps - t.warmup_steps, 1)
    progress = min((step - t.warmup_steps) / span, 1.0)
    floor = t.lr * t.min_lr_ratio
    return floor + (t.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
