"""train.fp8 on a model: which modules become FP8 (moelab.model.fp8's GEMMs), and whether this device can run
them. Kept apart from the GEMMs, which moelab.model.experts calls, so the imports run one way.

    check_fp8(cfg, "cuda:0")            # ConfigError on CPU or below compute capability 9.0
    enable_fp8(model)                   # {'linears': ..., 'experts': ...}
"""
from __future__ import annotations

import torch
from torch import nn

from moelab.config import ConfigError
from moelab.model.experts import GroupedExperts
from moelab.model.fp8 import FP8Linear
from moelab.model.fp8_cache import attach


# Module names (attributes) of the projections converted: attention (GQA, MLA) and dense SwiGLU MLPs.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj",
               "gate_proj", "up_proj", "down_proj")


def enable_fp8(model: nn.Module, lm_head: bool = False) -> dict:
    """Convert in place: the attention and dense projections (PROJECTIONS) to FP8Linear, every GroupedExperts
    to FP8 grouped GEMMs (with an ExpertWeightCache, used under moelab.model.fp8_cache.expert_weights_cached).
    The router, norms and embedding are left in bf16, and the LM head (`output`) unless lm_head. Returns counts."""
    linears = experts = 0
    for module in model.modules():
        for name in PROJECTIONS:
            child = getattr(module, name, None)
            if type(child) is nn.Linear:
                child.__class__ = FP8Linear
                linears += 1
        if isinstance(module, GroupedExperts):
            if module.b_gate_up_EF2 is not None:
                raise ConfigError("train.fp8='rowwise': the FP8 expert GEMMs take no expert biases (GPT-OSS "
                                  "experts); set train.fp8=off for this model")
            module.fp8 = True
            experts += 1
    if lm_head and type(getattr(model, "output", None)) is nn.Linear:
        model.output.__class__ = FP8Linear
        linears += 1
    attach(model)
    return {"linears": linears, "experts": experts}


def fp8_supported(device: "str | torch.device") -> tuple[bool, str]:
    """(ok, why not): FP8 GEMMs need a CUDA GPU of compute capability 8.9 or newer (9.0 for grouped GEMMs)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"FP8 GEMMs need a CUDA GPU (this run is on {device.type})"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (9, 0):
        return False, (f"FP8 grouped GEMMs (torch._scaled_grouped_mm) need compute capability 9.0+ "
                       f"(this GPU: {major}.{minor})")
    if not hasattr(torch, "_scaled_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    return True, ""


def check_fp8(cfg, device: "str | torch.device") -> None:
    """Refuse train.fp8 on a device that cannot run it (called on every rank when the model is built)."""
    ok, why = fp8_supported(device)
    if not ok:
        raise ConfigError(f"train.fp8={cfg.train.fp8!r}: {why}; set train.fp8=off")
