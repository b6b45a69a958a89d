"""FP8 training (train.fp8='rowwise'): dynamically scaled float8 e4m3 GEMMs with one scale per row.

Every GEMM operand is quantised on the device just before its GEMM, with one fp32 scale per row along the
contraction dimension (the row's amax maps to e4m3's largest value, 448; scales rounded down to a power of two,
so dequantising is exact), and no host synchronisation. The scaled GEMM multiplies the e4m3 operands, rescales
by the two scale vectors and writes bf16:

    dense projections (FP8Linear, torch._scaled_mm)       y = x W^T, dx = dy W, dW = dy^T x: all three in e4m3
    routed experts (fp8_grouped_mm, torch._scaled_grouped_mm)  forward and dgrad in e4m3; wgrad in bf16
                                                          (torch._grouped_mm: its e4m3 form needs per-group
                                                          column scales and 16-row aligned groups)

Gradients are quantised to e4m3 too (not e5m2), as torchao's float8 "rowwise" recipe does: rowwise scales give
them enough range. Fast accumulation in the forward and dgrad GEMMs, exact accumulation in the dense wgrad (as
that recipe does); rowwise torch._scaled_mm writes bf16 only, so every FP8 GEMM's output is bf16. The router, norms, embedding and LM head stay bf16 (not converted).

On CPU (tests) the same quantisation runs and the scaled GEMM is emulated: dequantise, matmul in fp32, round to
the output dtype; `torch._scaled_mm`'s CUDA kernel computes the same function up to accumulation order.

    from moelab.model.fp8_convert import enable_fp8
    enable_fp8(model)            # nn.Linear projections -> FP8Linear, experts -> FP8 grouped GEMMs
"""
from __future__ import annotations

import torch
from torch import nn

from moelab.config import ConfigError
from moelab.backends.ops import scale_rows

# True = run the emulation (dequantise, fp32 matmul) on CUDA too: the GPU check compares the kernels with it.
EMULATE = False
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
EPS = 1e-12


def quantize_rowwise(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q in e4m3, inv_scale fp32) with x ~= x_q * inv_scale; one scale per slice along `dim` (kept as size 1).

    scale = 2^floor(log2(448 / amax)): the largest element lands in (224, 448], zero rows get a finite scale."""
    amax = x.detach().abs().amax(dim=dim, keepdim=True).float().clamp(min=EPS)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    x_q = (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    # row-major whatever x's strides (the GEMMs take transposed views of these as their column-major operands)
    return x_q.contiguous(), scale.reciprocal()


def quantize_colmajor(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rowwise(x, dim) with the e4m3 copy laid out column-major over x's last two dims (the layout a
    scaled GEMM takes its second operand in, or the transpose of its first): the amax is read in x's own layout and
    the transposed layout is only the e4m3 write's, not a bf16 copy made first (compiled, one pass)."""
    x_q, inv_scale = quantize_rowwise(x, dim)
    return x_q.transpose(-2, -1).contiguous().transpose(-2, -1), inv_scale


def dequantize(x_q: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    return x_q.float() * inv_scale


def scaled_mm(a_MK, sa_M1, b_KN, sb_1N, out_dtype, fast_accum: bool) -> torch.Tensor:
    """a_MK (row-major e4m3) @ b_KN (column-major e4m3), rescaled by the row / column scales, in out_dtype."""
    if a_MK.is_cuda and not EMULATE:
        return torch._scaled_mm(a_MK, b_KN, scale_a=sa_M1, scale_b=sb_1N, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    return (dequantize(a_MK, sa_M1) @ dequantize(b_KN, sb_1N)).to(out_dtype)


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """The GEMM's output dtype: autocast's compute dtype where it is on, else the input's."""
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return x.dtype


class _FP8Matmul(torch.autograd.Function):
    """y_MN = x_MK @ w_NK^T with all three GEMMs (forward, dgrad, wgrad) in rowwise-scaled e4m3."""

    @staticmethod
    def forward(ctx, x_MK, w_NK, out_dtype):
        x_q, sx_M1 = quantize_rowwise(x_MK, -1)
        w_q, sw_N1 = quantize_rowwise(w_NK, -1)
        ctx.save_for_backward(x_MK, w_NK)
        ctx.out_dtype = out_dtype
        return scaled_mm(x_q, sx_M1, w_q.t(), sw_N1.t().contiguous(), out_dtype, fast_accum=True)

    @staticmethod
    def backward(ctx, g_MN):
        x_MK, w_NK = ctx.saved_tensors
        g_MN = g_MN.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dx_MK = g_MN @ w_NK: w scaled along N (its columns), column-major
            g_q, sg_M1 = quantize_rowwise(g_MN, -1)
            w_q, sw_1K = quantize_colmajor(w_NK, 0)
            dx = scaled_mm(g_q, sg_M1, w_q, sw_1K, ctx.out_dtype, fast_accum=True).to(x_MK.dtype)
        if ctx.needs_input_grad[1]:  # dw_NK = g_MN^T @ x_MK: both scaled along M (the tokens)
            g_q, sg_1N = quantize_colmajor(g_MN, 0)  # g^T row-major
            x_q, sx_1K = quantize_colmajor(x_MK, 0)
            dw = scaled_mm(g_q.t(), sg_1N.t().contiguous(), x_q, sx_1K, ctx.out_dtype,
                           fast_accum=False).to(w_NK.dtype)
        return dx, dw, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with rowwise-scaled e4m3 GEMMs (leading dims of x flattened); the bias is added in bf16."""
    out_dtype = _out_dtype(x)
    y = _FP8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, out_dtype).view(*x.shape[:-1], weight.shape[0])
    return y + bias.to(y.dtype) if bias is not None else y


class FP8Linear(nn.Linear):
    """nn.Linear whose matmuls run in rowwise-scaled FP8 (same parameters, same state dict).

        lin = nn.Linear(2048, 4096, bias=False); lin.__class__ = FP8Linear   # or enable_fp8(model)
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias)


def scaled_grouped_mm(a_MK, sa_M, b_EKN, sb_EN, offs_E, out_dtype) -> torch.Tensor:
    """Per expert e: rows offs[e-1]:offs[e] of a_MK (row-major e4m3) @ b_EKN[e] (column-major e4m3), rescaled;
    rows past offs[-1] are zero (CPU emulation) or unspecified (CUDA), as torch._grouped_mm leaves them."""
    if a_MK.is_cuda and not EMULATE:
        return torch._scaled_grouped_mm(a_MK, b_EKN, sa_M, sb_EN, offs=offs_E, out_dtype=out_dtype,
                                        use_fast_accum=True)
    a = dequantize(a_MK, sa_M[:, None])
    b = dequantize(b_EKN, sb_EN[:, None, :])
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float32, device=a.device)
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        out[start:end] = a[start:end] @ b[e]
        start = end
    return out.to(out_dtype)


def _grouped_wgrad(x_MK, g_MN, offs_E, num_experts) -> torch.Tensor:
    """dw_EKN[e] = x[rows of e]^T @ g[rows of e], in the inputs' dtype (bf16 on the GPU)."""
    if x_MK.is_cuda and not EMULATE:
        return torch._grouped_mm(x_MK.t(), g_MN, offs=offs_E)
    out = torch.zeros(num_experts, x_MK.shape[1], g_MN.shape[1], dtype=torch.float32, device=x_MK.device)
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        out[e] = x_MK[start:end].float().t() @ g_MN[start:end].float()
        start = end
    return out


def forward_operand(w_EKN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward GEMM's e4m3 weight: [E, K, N] column-major, scaled along K (scales [E, N])."""
    w_q, s_E1N = quantize_colmajor(w_EKN, -2)
    return w_q, s_E1N.squeeze(-2)


def dgrad_operand(w_EKN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The dgrad GEMM's e4m3 weight: w^T as [E, N, K] column-major (w's own row-major bytes), scaled along N
    (scales [E, K])."""
    w_q, s_EK1 = quantize_rowwise(w_EKN.contiguous(), -1)
    return w_q.transpose(-2, -1), s_EK1.squeeze(-1)


def quantize_expert_weight(w_EKN: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The e4m3 operands of one stacked expert weight: (forward operand, its scales) and (dgrad operand, its
    scales), as forward_operand and dgrad_operand make them."""
    return (*forward_operand(w_EKN), *dgrad_operand(w_EKN))


class _FP8GroupedMM(torch.autograd.Function):
    """y_MN = grouped x_MK @ w_EKN (rows sorted by expert, offs_E = cumulative row counts); forward and dgrad in
    rowwise-scaled e4m3, wgrad in the weights' precision. wq_f, s_f, wq_b, s_b: the weight's operands from
    quantize_expert_weight when cached for the optimizer step (ExpertWeightCache), else None (quantised here)."""

    @staticmethod
    def forward(ctx, x_MK, w_EKN, offs_E, out_dtype, wq_f=None, s_f=None, wq_b=None, s_b=None):
        x_q, sx_M1 = quantize_rowwise(x_MK, -1)
        if wq_f is None:  # w scaled along K (per expert and output column)
            wq_f, s_f = forward_operand(w_EKN)
        ctx.save_for_backward(x_MK, w_EKN, offs_E, wq_b, s_b)
        ctx.out_dtype = out_dtype
        return scaled_grouped_mm(x_q, sx_M1.squeeze(-1), wq_f, s_f, offs_E, out_dtype)

    @staticmethod
    def backward(ctx, g_MN):
        x_MK, w_EKN, offs_E, wq_b, s_b = ctx.saved_tensors
        g_MN = g_MN.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dx_MK = g_MN @ w_EKN^T: w scaled along N; its transpose is column-major
            g_q, sg_M1 = quantize_rowwise(g_MN, -1)
            if wq_b is None:
                wq_b, s_b = dgrad_operand(w_EKN)
            dx = scaled_grouped_mm(g_q, sg_M1.squeeze(-1), wq_b, s_b, offs_E, ctx.out_dtype).to(x_MK.dtype)
        if ctx.needs_input_grad[1]:
            dw = _grouped_wgrad(x_MK.to(g_MN.dtype), g_MN, offs_E, w_EKN.shape[0]).to(w_EKN.dtype)
        return dx, dw, None, None, None, None, None, None


def fp8_grouped_mm(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor, cached=None) -> torch.Tensor:
    """Grouped x_MK @ w_EKN in FP8; `cached`: the weight's quantize_expert_weight operands, or None."""
    return _FP8GroupedMM.apply(x_MK, w_EKN, offs_E, _out_dtype(x_MK), *(cached or (None,) * 4))


def fp8_grouped_swiglu(x_ND, w_gate_up_EDF2, w_down_EFD, counts_E, act, cached=None, scale_N=None) -> torch.Tensor:
    """moelab.model.experts.grouped_mm_swiglu (no biases) with FP8 grouped GEMMs; `cached`: the two weights'
    quantised operands (ExpertWeightCache.operands) or None; `scale_N`: each row's routing weight, applied to
    the activation before it is quantised for the down projection (moelab.backends.ops.scale_rows)."""
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    c1, c2 = cached if cached is not None else (None, None)
    h_NF2 = fp8_grouped_mm(x_ND, w_gate_up_EDF2, offs_E, c1)
    gate_NF, up_NF = h_NF2.chunk(2, dim=-1)
    return fp8_grouped_mm(scale_rows(act(gate_NF, up_NF), scale_N).contiguous(), w_down_EFD, offs_E, c2)


def fp8_experts(module, x_ND, w_gate_up_EDF2, w_down_EFD, counts_E, act, scale_N=None) -> torch.Tensor:
    """GroupedExperts.forward under train.fp8: the cached weight operands while a cache is valid."""
    cache = getattr(module, "fp8_cache", None)  # moelab.model.fp8_cache
    return fp8_grouped_swiglu(x_ND, w_gate_up_EDF2, w_down_EFD, counts_E, act,
                              cache.operands(w_gate_up_EDF2.dtype) if cache is not None else None, scale_N)


__all__ = ["FP8Linear", "fp8_experts", "fp8_grouped_mm", "fp8_grouped_swiglu", "fp8_linear", "quantize_expert_weight",
           "quantize_rowwise"]
