"""The expert weights' forward FP8 operand (moelab.model.fp8.forward_operand) as one tiled Triton kernel.

The forward grouped GEMM takes each expert weight w_EKN column-major (physically [E, N, K]) in e4m3, scaled
along K. Compiled by inductor, the amax over K and the transposed e4m3 write fuse into one reduction kernel whose
writes are strided: 37.6 ms per optimizer step for the Qwen3 proxy's 4.8 G expert weights (call 5's FP8 profile,
`...profile-fp8-rowwise-compile-gbs16`), against 2.5 ms for the other operand, which needs no transpose. This
kernel gives each program BLOCK_N columns of one expert: a first pass over K takes their amax (loads coalesced
along N), a second pass scales, casts and stores each [BLOCK_K, BLOCK_N] tile transposed (Triton moves the tile
through shared memory so that the stores are coalesced along K). About 2.5 reads and 0.5 writes of the bf16
weights' bytes: ~5 ms per step at HBM speed.

Same values as quantize_colmajor(w.to(dtype), -2): the scale 2^floor(log2(448 / amax)) is taken from the exponent
bits of 448 / amax (exact; torch's log2 can round a quotient just below a power of two up to it, which then clips
that column's largest element to 448: the kernel's choice is the exact one), values round to nearest, ties to even.

    w_q, inv_scale = quantize_colmajor_kernel(w_EKN)      # CUDA, or the CPU under TRITON_INTERPRET=1
    kernel_applies(w_EKN)                                   # -> whether the kernel runs for this tensor
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

from moelab.model.fp8 import E4M3, E4M3_MAX, EPS

BLOCK_K = 64
BLOCK_N = 64


def kernel_applies(w_EKN: torch.Tensor) -> bool:
    """Whether quantize_colmajor_kernel runs for w: a 3-d CUDA tensor (or any tensor under Triton's interpreter,
    TRITON_INTERPRET=1: the tests) with triton installed."""
    on_device = w_EKN.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return on_device and w_EKN.dim() == 3 and importlib.util.find_spec("triton") is not None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def colmajor_e4m3_kernel(w_ptr, q_ptr, s_ptr, K, N, ROUND_BF16: tl.constexpr, BLOCK_K: tl.constexpr,
                             BLOCK_N: tl.constexpr):
        e = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        w_base = w_ptr + e * K * N
        amax = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            ok = (k[:, None] < K) & n_ok[None, :]
            x = tl.load(w_base + k[:, None] * N + n[None, :], mask=ok, other=0.0)
            if ROUND_BF16:  # fp32 -> nearest bf16 (ties to even) by integer ops: the interpreter's cast truncates
                b = x.to(tl.int32, bitcast=True)
                x = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=0))
        quotient = 448.0 / tl.maximum(amax, 1e-12)  # E4M3_MAX / max(amax, EPS) (moelab.model.fp8)
        biased_exp = (quotient.to(tl.int32, bitcast=True) >> 23) & 0xFF  # floor(log2(quotient)) + 127
        scale = (biased_exp << 23).to(tl.float32, bitcast=True)
        inv_scale = ((254 - biased_exp) << 23).to(tl.float32, bitcast=True)
        tl.store(s_ptr + e * N + n, inv_scale, mask=n_ok)
        q_base = q_ptr + e * N * K
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            ok = (k[:, None] < K) & n_ok[None, :]
            x = tl.load(w_base + k[:, None] * N + n[None, :], mask=ok, other=0.0)
            if ROUND_BF16:  # fp32 -> nearest bf16 (ties to even) by integer ops: the interpreter's cast truncates
                b = x.to(tl.int32, bitcast=True)
                x = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
            v = tl.clamp(x.to(tl.float32) * scale[None, :], -448.0, 448.0)
            # round to the e4m3 grid in fp32 (ties to even: fp32 addition's rounding), so the cast below is exact
            # (Triton's interpreter truncates, and drops the carry into the exponent, when the cast rounds)
            # (on |v|, the sign put back after: values that round to zero stay -0 where negative, as CUDA's cast)
            a = tl.abs(v)
            v_exp = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
            quantum_exp = tl.maximum(v_exp, -6) - 3  # e4m3: 3 mantissa bits, smallest normal 2^-6
            shift = ((quantum_exp + 150) << 23).to(tl.float32, bitcast=True) * 1.5  # 1.5 * 2^(quantum_exp + 23)
            a = (a + shift) - shift
            v = tl.where(v.to(tl.int32, bitcast=True) < 0, -a, a)  # the sign bit: -0.0 too
            tl.store(q_base + n[None, :] * K + k[:, None], v.to(tl.float8e4nv), mask=ok)

    return colmajor_e4m3_kernel


assert (E4M3_MAX, EPS) == (448.0, 1e-12), "the kernel's literals follow moelab.model.fp8's constants"


def quantize_colmajor_kernel(w_EKN: torch.Tensor, dtype: torch.dtype | None = None,
                             out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """quantize_colmajor(w_EKN.to(dtype), -2) by the tiled kernel: (e4m3 [E, K, N] column-major, inv scales
    [E, N]); `dtype`: bf16 rounds the (fp32) weights first, None or the weights' dtype takes them as they are;
    `out`: buffers of those shapes and layouts to write into (the weight cache's)."""
    import triton

    w = w_EKN.contiguous()
    E, K, N = w.shape
    if out is None:
        q = torch.empty(E, N, K, dtype=E4M3, device=w.device).transpose(-2, -1)
        s = torch.empty(E, N, dtype=torch.float32, device=w.device)
    else:
        q, s = out
        if q.shape != (E, K, N) or q.transpose(-2, -1).stride() != (N * K, K, 1) or not s.is_contiguous():
            raise ValueError(f"quantize_colmajor_kernel: out buffers {tuple(q.shape)} / {tuple(s.shape)} are not the "
                             f"column-major [E, K, N] e4m3 and contiguous [E, N] the forward operand uses")
    round_bf16 = dtype == torch.bfloat16 and w.dtype != torch.bfloat16
    grid = (E, triton.cdiv(N, BLOCK_N))
    _kernel()[grid](w, q, s, K, N, ROUND_BF16=round_bf16, BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N)
    return q, s


__all__ = ["kernel_applies", "quantize_colmajor_kernel"]
