"""Turn a model's matmuls to FP8 in place (train.fp8): the projections to FP8Linear, the experts to FP8 grouped
GEMMs with a cached FP8 copy of their weights. The kernels are moelab.model.fp8, the weight cache
moelab.model.fp8_cache; this module applies them to a model.

    from moelab.model.fp8_convert import enable_fp8
    enable_fp8(model)            # {'linears': ..., 'experts': ...}
"""
from __future__ import annotations

from torch import nn

from moelab.config import ConfigError
from moelab.model.experts import GroupedExperts
from moelab.model.fp8 import PROJECTIONS, FP8Linear
from moelab.model.fp8_cache import attach


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
