"""backend.experts=sonic: SonicMoE's experts (Dao-AILab/sonic-moe on QuACK's CuTe-DSL grouped GEMMs) on the tokens
themselves: the routed rows gathered inside the first grouped GEMM, SwiGLU and its backward in the GEMMs' epilogues,
the weighted combine read straight from the down projection's rows, the minimal activations kept for backward, and
on a later micro batch the expert weights' gradients added into their .grad by the weight-gradient GEMMs (QuACK's
add-to-output epilogue: no separate `.grad +=` pass over the experts' weights).

    sonic_layout(experts)                                       # once, before the weights are materialised
    y_TD = sonic_experts(x_TD, weights_TK, experts_TK, w_gate_up_EDF2, w_down_EFD)

Shapes: T tokens, K experts per token, N = T*K routed rows (grouped by expert), E experts, D hidden, F expert width.
SonicMoE keeps expert weights as [out, in] (its [E, 2F, D] gate|up, [E, D, F] down, contiguous); moelab's are
[E, D, 2F] / [E, F, D]. ``sonic_layout`` stores moelab's parameters with SonicMoE's memory order (same shapes and
values, transposed strides), so each call hands SonicMoE a view, no copy; weights in another order (e.g. after
FSDP's resharding) are copied into SonicMoE's order each call, correct but slower, and their gradients go through
autograd. The layer is moelab's own autograd Function over SonicMoE's kernels (its fixed-K routing metadata, up and
down projections, combine and their backward), so that the weight-gradient GEMMs can write into .grad. QuACK's GEMMs
run with their default tile configs (tuned=False): autotuning compiles 30+ CuTe-DSL configs per GEMM on the first
call (over 400 s, issue 41 call 4). Its kernels cannot be traced by torch.compile: the call is a graph break.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from moelab.backends.ops import accumulates_into
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


def in_sonic_order(w: torch.Tensor) -> torch.Tensor:
    """w ([E, D, 2F] or [E, F, D]) with SonicMoE's memory order: w itself where it has it, else a copy."""
    return w if w.transpose(1, 2).is_contiguous() else w.transpose(1, 2).contiguous().transpose(1, 2)


def weight_grad_buffers(w_gate_up_EDF2: torch.Tensor, w_down_EFD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                         bool]:
    """Where backward writes the two weights' gradients: into their own .grad when both accumulate there
    (moelab.backends.ops.accumulates_into: a later micro batch, eager, no hooks) and both are in SonicMoE's order,
    returning True; else into new tensors in SonicMoE's order (moelab's shapes), returning False."""
    weights = (w_gate_up_EDF2, w_down_EFD)
    if all(accumulates_into(w) and w.transpose(1, 2).is_contiguous() for w in weights):
        return w_gate_up_EDF2.grad, w_down_EFD.grad, True
    dw1, dw2 = (torch.empty(w.shape[0], w.shape[2], w.shape[1], dtype=w.dtype, device=w.device).transpose(1, 2)
                for w in weights)
    return dw1, dw2, False


class _SonicExperts(torch.autograd.Function):
    """SonicMoE's up projection (gather, GEMM, SwiGLU), down projection and weighted combine, forward and backward;
    the weight-gradient GEMMs write into .grad or add to it (weight_grad_buffers)."""

    @staticmethod
    def forward(ctx, x_TD, scores_N, experts_TK, w_gate_up_EDF2, w_down_EFD):
        from sonicmoe.functional.forward import _down_projection_forward, _up_projection_forward
        from sonicmoe.functional.reduction_over_k_gather import token_gather_and_sum_varlen_K_triton
        from sonicmoe.functional.triton_kernels import TC_topk_router_metadata_triton

        (T, D), (_, K), E = x_TD.shape, experts_TK.shape, w_gate_up_EDF2.shape[0]
        F, N, dev = w_down_EFD.shape[1], T * K, x_TD.device
        offsets_E1 = torch.empty(E + 1, dtype=torch.int32, device=dev)  # each expert's first grouped row
        gather_N, scatter_N, reverse_N = (torch.empty(N, dtype=torch.int32, device=dev) for _ in range(3))
        TC_topk_router_metadata_triton(experts_TK.int().contiguous(), E, torch.empty(E, dtype=torch.int32, device=dev),
                                       offsets_E1, gather_N, scatter_N, reverse_N)
        w1_F2DE = in_sonic_order(w_gate_up_EDF2).permute(2, 1, 0)  # SonicMoE's argument views
        w2_DFE = in_sonic_order(w_down_EFD).permute(2, 1, 0)
        h_NF2, a_NF = x_TD.new_empty(N, 2 * F), x_TD.new_empty(N, F)
        _up_projection_forward(x_TD, w1_F2DE, h_NF2, a_NF, None, offsets_E1, gather_N, "swiglu", False, True)
        y_ND, out_TD = x_TD.new_empty(N, D), x_TD.new_empty(T, D)
        _down_projection_forward(w2_DFE, a_NF, y_ND, None, offsets_E1)
        token_gather_and_sum_varlen_K_triton(y_ND, scores_N, out_TD, reverse_N, None, T, K, D, False)
        ctx.save_for_backward(x_TD, h_NF2, scores_N, w_gate_up_EDF2, w_down_EFD, offsets_E1, gather_N, scatter_N,
                              reverse_N)
        ctx.K = K
        return out_TD

    @staticmethod
    def backward(ctx, g_TD):
        from quack.gemm_interface import gemm, gemm_add_inplace
        from sonicmoe.functional.backward import (_down_projection_backward_act, _token_broadcast_backward,
                                                  _up_projection_backward_act)

        x_TD, h_NF2, scores_N, w1, w2, offsets_E1, gather_N, scatter_N, reverse_N = ctx.saved_tensors
        (T, D), N, F = x_TD.shape, h_NF2.shape[0], h_NF2.shape[1] // 2
        g_TD = g_TD.to(x_TD.dtype).contiguous()
        w1_F2DE, w2_DFE = in_sonic_order(w1).permute(2, 1, 0), in_sonic_order(w2).permute(2, 1, 0)
        dh_NF2, a_NF, dscores_N = torch.empty_like(h_NF2), x_TD.new_empty(N, F), torch.empty_like(scores_N)
        _down_projection_backward_act(g_TD, h_NF2, w2_DFE, dh_NF2, dscores_N, None, None, a_NF, scores_N, offsets_E1,
                                      gather_N, scatter_N, "swiglu")
        dx_ND = x_TD.new_empty(N, D)
        _up_projection_backward_act(w1_F2DE, dx_ND, dh_NF2, None, offsets_E1, True, True)
        dw1_EDF2, dw2_EFD, accumulate = weight_grad_buffers(w1, w2)
        for A_MN, B_NK, out, concat in ((x_TD.T, dh_NF2, dw1_EDF2, ("out",)), (g_TD.T, a_NF, dw2_EFD.transpose(1, 2),
                                                                               None)):
            if accumulate:  # out += A @ B per expert, in the GEMM's epilogue
                gemm_add_inplace(A_MN, B_NK, out, cu_seqlens_k=offsets_E1, A_idx=gather_N, tuned=False,
                                 concat_layout=concat)
            else:
                gemm(A_MN, B_NK, out=out, cu_seqlens_k=offsets_E1, A_idx=gather_N, tuned=False, concat_layout=concat)
        dx_TD = torch.empty_like(x_TD)
        _token_broadcast_backward(dx_TD, dx_ND, reverse_N, None, ctx.K, D, False)
        return dx_TD, dscores_N, None, *((None, None) if accumulate else (dw1_EDF2, dw2_EFD))


@torch.compiler.disable
def sonic_experts(x_TD: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor,
                  w_gate_up_EDF2: torch.Tensor, w_down_EFD: torch.Tensor) -> torch.Tensor:
    """y_TD = sum over each token's K experts of weight * SwiGLU expert(x), by SonicMoE's kernels (bf16 tokens and
    weights; weights_TK fp32, as the router gives them)."""
    _sonic()
    y_TD = _SonicExperts.apply(x_TD.contiguous(), weights_TK.float().reshape(-1).contiguous(), experts_TK,
                               w_gate_up_EDF2, w_down_EFD)
    return y_TD
