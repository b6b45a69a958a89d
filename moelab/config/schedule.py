"""The learning-rate schedule: a function of the config and the step, so a resume, a fork and the launcher's
note on a longer run all compute the rate the trainer uses (moelab.train.optim.set_lr applies it).

    lr_at(1, cfg)              # cfg.train.lr / cfg.train.warmup_steps during warm-up
    lr_at(cfg.train.steps, cfg)  # cfg.train.lr * cfg.train.min_lr_ratio at the last step
"""
from __future__ import annotations

import math


def lr_at(step: int, cfg) -> float:
    """Linear warm-up over warmup_steps, then cosine decay to lr * min_lr_ratio at the last step (1-based).
    `cfg`: a moelab.config.Config (its train section)."""
    t = cfg.train
    if t.warmup_steps and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    span = max(t.steps - t.warmup_steps, 1)
    progress = min((step - t.warmup_steps) / span, 1.0)
    floor = t.lr * t.min_lr_ratio
    return floor + (t.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
