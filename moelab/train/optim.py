"""Optimizer and learning-rate schedule."""
from __future__ import annotations

import math

import torch

from moelab.config import Config
from moelab.planner.states import moment_dtype
from moelab.train.adamw_moments import MomentsAdamW


def param_kind(p: torch.Tensor) -> str:
    """'plain' for a torch.Tensor, else the DTensor's mesh: 'mesh[0, 1]' (its ranks, by name in the layout)."""
    mesh = getattr(p, "device_mesh", None)
    return "plain" if mesh is None else f"mesh{mesh.mesh.flatten().tolist()}"


def build_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW; no weight decay on vectors (norms, biases, sinks); fused kernels on CUDA; moments in the dtype
    train.optimizer_state names (bf16_moments: moelab.train.adamw_moments.MomentsAdamW).

    One group per (decay, kind): plain tensors and the DTensors of each mesh apart, because fused and foreach
    AdamW refuse a group that mixes DTensor and plain parameters (a model whose one-rank meshes skip FSDP2 has
    both: moelab.parallel.fsdp). The grouping does not change the update, which is per element."""
    t = cfg.train
    groups: dict[tuple[bool, str], list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.requires_grad:
            groups.setdefault((p.ndim >= 2, param_kind(p)), []).append(p)
    kinds = list(dict.fromkeys(kind for _, kind in groups))
    out = []
    for decay in (True, False):
        for kind in kinds:
            if (decay, kind) in groups:
                name = ("decay" if decay else "no_decay") + ("" if len(kinds) == 1 else f"/{kind}")
                out.append({"params": groups[decay, kind], "weight_decay": t.weight_decay if decay else 0.0,
                            "name": name, "lr_scale": 1.0})
    on_cuda = any(p.is_cuda for g in out for p in g["params"])
    if moment_dtype(t) == "bfloat16" and t.param_dtype == "float32":  # train.optimizer_state=bf16_moments
        return MomentsAdamW(out, moment_dtype=torch.bfloat16, lr=t.lr, betas=(t.beta1, t.beta2))
    return torch.optim.AdamW(out, lr=t.lr, betas=(t.beta1, t.beta2), fused=on_cuda or None)


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
