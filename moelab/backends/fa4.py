"""backend.attention=fa4: FlashAttention-4's kernels (flash_attn.cute, Dao-AILab's CuTe-DSL attention; Hopper and
newer) for plain causal attention, the path `auto` takes where the package is installed and applies
(moelab.backends.auto_attention).

    o_BHLD = fa4_causal_attention(q_BHLD, k_BGLD, v_BGLD)    # GQA: H query heads over G kv heads

The kernels run as two torch.library custom ops (the forward, which also returns the log-sum-exp, and the backward),
so that torch.compile keeps a block whole around them (no graph break) and AOTAutograd saves q, k, v, the output
and the log-sum-exp as SDPA's flash kernels do. They take the (B, L, heads, Dh) views of moelab's (B, heads, L, Dh)
tensors as they are (strided: no copies); GQA runs in the kernels (no repeated k and v). Windows, sinks, packed
documents and MLA's unequal head dims take the sdpa path's choices (moelab.model.attention.causal_attention).
Checked against fp32 beside SDPA on the GPU, forward and every gradient, eager and compiled:
gallery/scripts/gpu_attention.py (`ok`).
"""
from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("moelab::fa4_causal", mutates_args=())
def fa4_causal(q_BLHD: Tensor, k_BLGD: Tensor, v_BLGD: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Causal attention's output [B, L, H, Dv] and log-sum-exp [B, H, L] (fp32) by FlashAttention-4's forward."""
    from flash_attn.cute.interface import _flash_attn_fwd

    out_BLHD, lse_BHL = _fa4_outputs(q_BLHD, v_BLGD)
    _flash_attn_fwd(q_BLHD, k_BLGD, v_BLGD, softmax_scale=scale, causal=True, return_lse=True, out=out_BLHD,
                    lse=lse_BHL)
    return out_BLHD, lse_BHL


def _fa4_outputs(q_BLHD: Tensor, v_BLGD: Tensor) -> tuple[Tensor, Tensor]:
    B, L, H, _ = q_BLHD.shape
    return (q_BLHD.new_empty(B, L, H, v_BLGD.shape[-1]),
            q_BLHD.new_empty(B, H, L, dtype=torch.float32))


@fa4_causal.register_fake
def _(q_BLHD, k_BLGD, v_BLGD, scale):
    return _fa4_outputs(q_BLHD, v_BLGD)


@torch.library.custom_op("moelab::fa4_causal_backward", mutates_args=())
def fa4_causal_backward(dout_BLHD: Tensor, q_BLHD: Tensor, k_BLGD: Tensor, v_BLGD: Tensor, out_BLHD: Tensor,
                        lse_BHL: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of q, k and v (each in its input's layout) by FlashAttention-4's backward."""
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _grads_like(q_BLHD, k_BLGD, v_BLGD)
    _flash_attn_bwd(q_BLHD, k_BLGD, v_BLGD, out_BLHD, dout_BLHD, lse_BHL, scale, True, dq=dq, dk=dk, dv=dv)
    return dq, dk, dv


def _grads_like(q_BLHD: Tensor, k_BLGD: Tensor, v_BLGD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q_BLHD), torch.empty_like(k_BLGD), torch.empty_like(v_BLGD)


@fa4_causal_backward.register_fake
def _(dout_BLHD, q_BLHD, k_BLGD, v_BLGD, out_BLHD, lse_BHL, scale):
    return _grads_like(q_BLHD, k_BLGD, v_BLGD)


def _setup_context(ctx, inputs, output) -> None:
    q_BLHD, k_BLGD, v_BLGD, scale = inputs
    out_BLHD, lse_BHL = output
    ctx.save_for_backward(q_BLHD, k_BLGD, v_BLGD, out_BLHD, lse_BHL)
    ctx.scale = scale


def _backward(ctx, dout_BLHD, dlse_BHL):
    # the log-sum-exp is an output only for the backward's sake: nothing downstream takes its gradient
    q_BLHD, k_BLGD, v_BLGD, out_BLHD, lse_BHL = ctx.saved_tensors
    dq, dk, dv = fa4_causal_backward(dout_BLHD.contiguous(), q_BLHD, k_BLGD, v_BLGD, out_BLHD, lse_BHL, ctx.scale)
    return dq, dk, dv, None


fa4_causal.register_autograd(_backward, setup_context=_setup_context)


def fa4_causal_attention(q_BHLD: Tensor, k_BGLD: Tensor, v_BGLD: Tensor, scale: float | None = None) -> Tensor:
    """Causal attention [B, H, L, Dv] by FlashAttention-4 on (B, heads, L, Dh) tensors, as SDPA takes them (their
    (B, L, heads, Dh) views go to the kernels). `scale`: 1/sqrt(Dh) where None."""
    scale = q_BHLD.shape[-1] ** -0.5 if scale is None else float(scale)
    out_BLHD, _ = fa4_causal(q_BHLD.transpose(1, 2), k_BGLD.transpose(1, 2), v_BGLD.transpose(1, 2), scale)
    return out_BLHD.transpose(1, 2)
