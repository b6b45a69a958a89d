"""The optimizer, and applying the learning rate (its schedule: moelab.config.schedule.lr_at)."""
from __future__ import annotations

import torch

from moelab.config import Config
from moelab.planner.states import moment_dtype
from moelab.train.adamw_moments import MomentsAdamW


def param_kind(p: torch.Tensor) -> str:
    """'plain' for a torch.Tensor, else the DTensor's mesh: 'mesh[0, 1]' (its ranks, by name in the layout)."""
    mesh = getattr(p, "device_mesh", None)
    return "plain" if mesh is None else f"mesh{mesh.mesh.flatten().tolist()}"


def optimizer_kind(setting: str, on_cuda: bool) -> str:
    """train.optimizer resolved for this run: 'adamw' or 'adamw_triton' (auto: Triton's kernels on CUDA when
    triton imports). adamw_triton runs its kernels on CUDA tensors, or on CPU ones under Triton's interpreter
    (TRITON_INTERPRET=1, the tests); anywhere else it is refused rather than quietly being torch's AdamW."""
    from moelab.config import ConfigError
    from moelab.backends.flat import kernel_devices, triton_available

    if setting == "adamw":
        return "adamw"
    if setting == "auto":
        return "adamw_triton" if on_cuda and triton_available() else "adamw"
    if setting != "adamw_triton":
        raise ConfigError(f"train.optimizer={setting!r}: choose auto, adamw or adamw_triton")
    if not triton_available():
        raise ConfigError("train.optimizer='adamw_triton' needs the package 'triton' (pip install triton; it comes "
                          "with torch's CUDA wheels); set train.optimizer=adamw or auto")
    if not on_cuda and "cpu" not in kernel_devices():
        raise ConfigError("train.optimizer='adamw_triton' runs Triton kernels on CUDA tensors (on CPU only under "
                          "TRITON_INTERPRET=1); this run's parameters are on the CPU: set train.optimizer=adamw "
                          "or auto")
    return "adamw_triton"


def build_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW; no weight decay on vectors (norms, biases, sinks); torch's fused kernels on CUDA (foreach on CPU),
    or moelab's Triton kernel per large tensor (train.optimizer, ``optimizer_kind``). Both keep torch's
    state dict (`step`, `exp_avg`, `exp_avg_sq`), so a checkpoint of one resumes with the other. Moments in the dtype train.optimizer_state names
    (bf16_moments beside fp32 weights: moelab.train.adamw_moments.MomentsAdamW, or the Triton kernel's own).

    One group per (decay, kind): plain tensors and the DTensors of each mesh apart, because fused and foreach
    AdamW refuse a group that mixes DTensor and plain parameters (a model whose one-rank meshes skip FSDP2 has
    both: moelab.parallel.fsdp). The grouping does not change the update, which is per element.

        opt = build_optimizer(model, load_config("tiny", ["train.optimizer=adamw"]))"""
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
    moments = torch.bfloat16 if moment_dtype(t) == "bfloat16" and t.param_dtype == "float32" else None
    if optimizer_kind(t.optimizer, on_cuda) == "adamw_triton":
        from moelab.train.adamw_triton import TritonAdamW

        return TritonAdamW(out, moment_dtype=moments, lr=t.lr, betas=(t.beta1, t.beta2), fused=on_cuda or None)
    if moments is not None:  # train.optimizer_state=bf16_moments
        return MomentsAdamW(out, moment_dtype=moments, lr=t.lr, betas=(t.beta1, t.beta2))
    return torch.optim.AdamW(out, lr=t.lr, betas=(t.beta1, t.beta2), fused=on_cuda or None)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
