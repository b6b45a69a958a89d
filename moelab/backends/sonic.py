"""backend.experts=sonic: SonicMoE's experts (Dao-AILab/sonic-moe on QuACK's CuTe-DSL grouped GEMMs) on the tokens
themselves: the routed rows gathered inside the first grouped GEMM, SwiGLU and its backward in the GEMMs' epilogues,
the weighted combine fused into the down projection's output, the minimal activations kept for backward.

    sonic_layout(experts)                                       # once, before the weights are materialised
    y_TD = sonic_experts(x_TD, weights_TK, experts_TK, w_gate_up_EDF2, w_down_EFD)

SonicMoE keeps expert weights as [out, in] (its [E, 2F, D] gate|up, [E, D, F] down, contiguous); moelab's are
[E, D, 2F] / [E, F, D]. ``sonic_layout`` stores moelab's parameters with SonicMoE's memory order (same shapes and
values, transposed strides), so each call hands SonicMoE a view, no copy; weights in another order (e.g. after
FSDP's resharding) are copied into SonicMoE's order each call, correct but slower. QuACK's GEMMs run with their
default tile configs (tuned=False): autotuning compiles 30+ CuTe-DSL configs per GEMM on the first call (over 400 s,
issue 41 call 4). Its kernels cannot be traced by torch.compile: the call is a graph break.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from moelab.backends.packages import import_package


@functools.cache
def _sonic():
    """sonicmoe, with QuACK's GEMMs called on their default config unless a caller passes `tuned`."""
    sonic = import_package("sonic")
    import sonicmoe.functional as sf
    import sonicmoe.functional.backward as sb
    import sonicmoe.functional.forward as sfw

    for mod in (sf, sb, sfw):
        for name in ("gemm", "gemm_gated", "gemm_dgated"):
            if hasattr(mod, name):
                def default_config(*a, _f=getattr(mod, name), **k):
                    k.setdefault("tuned", False)
                    return _f(*a, **k)
                setattr(mod, name, functools.wraps(getattr(mod, name))(default_config))
    return sonic


def sonic_layout(experts) -> None:
    """Store a GroupedExperts' two weights in SonicMoE's memory order ([E, 2F, D] and [E, D, F] contiguous, seen
    as moelab's [E, D, 2F] and [E, F, D]); values kept (a meta module stays meta: materialising keeps strides)."""
    for name in ("w_gate_up_EDF2", "w_down_EFD"):
        p = getattr(experts, name)
        store = torch.empty(p.shape[0], p.shape[2], p.shape[1], dtype=p.dtype, device=p.device).transpose(1, 2)
        if p.device.type != "meta":
            store.copy_(p.detach())
        setattr(experts, name, nn.Parameter(store, requires_grad=p.requires_grad))


@torch.compiler.disable
def sonic_experts(x_TD: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor,
                  w_gate_up_EDF2: torch.Tensor, w_down_EFD: torch.Tensor) -> torch.Tensor:
    """y_TD = sum over each token's K experts of weight * SwiGLU expert(x), by SonicMoE's
    moe_general_routing_inputs (bf16 tokens and weights; weights_TK fp32, as the router gives them)."""
    _sonic()
    from sonicmoe import moe_general_routing_inputs
    from sonicmoe.enums import ActivationType

    T, K = experts_TK.shape
    w1_EF2D, w2_EDF = w_gate_up_EDF2.transpose(1, 2), w_down_EFD.transpose(1, 2)
    if not (w1_EF2D.is_contiguous() and w2_EDF.is_contiguous()):  # not in sonic_layout's order: a copy
        w1_EF2D, w2_EDF = w1_EF2D.contiguous(), w2_EDF.contiguous()
    token_N = torch.arange(T, device=x_TD.device, dtype=torch.int32).repeat_interleave(K)
    y_TD, _ = moe_general_routing_inputs(
        x_TD.contiguous(), weights_TK.reshape(-1), token_N, experts_TK.reshape(-1).int(),
        w1_EF2D.permute(1, 2, 0), None, w2_EDF.permute(1, 2, 0), None, w_gate_up_EDF2.shape[0],
        torch.cuda.current_stream().cuda_stream, ActivationType.SWIGLU,
        False, True)  # not inference (keeps what backward needs); gate|up concatenated, as moelab's swiglu
    return y_TD
