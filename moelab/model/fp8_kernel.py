"""The expert weights' two FP8 operands (moelab.model.fp8.forward_operand, dgrad_operand) by one tiled Triton kernel.

Each operand is a rowwise quantisation of w_EKN along one axis: the forward's along K, written column-major
(physically [E, N, K]), the dgrad's along N, written row-major (w's own layout). Compiled by inductor for the
weight cache, the forward operand's amax and transposed write fused into one reduction kernel whose writes were
strided: 37.6 ms per optimizer step for the Qwen3 proxy's 4.8 G expert weights (call 5's FP8 profile), 3.31 ms
per layer for gate_up against 0.64 with this kernel (call 7's check); compiled alone, the dgrad operand took
0.85 ms per gate_up. The kernel gives each program BLOCK_J positions of the kept axis of one expert: a first
pass over the reduced axis takes their amax, a second scales, casts and stores each tile in the operand's layout
(Triton moves a tile through shared memory where load and store run along different axes). About 2.5 reads and
0.5 writes of the bf16 weights' bytes per operand.

Same values as moelab.model.fp8's quantisation of w.to(dtype): the scale 2^floor(log2(448 / amax)) is taken from
the exponent bits of 448 / amax (exact; torch's log2 can round a quotient just below a power of two up to it,
which then clips that slice's largest element to 448: the kernel's choice is the exact one), values round to
nearest, ties to even, negative values that round to zero keep their sign.

    w_q, inv_scale = quantize_weight_kernel(w_EKN, dim=-2)   # forward operand; dim=-1: the dgrad operand's
    kernel_applies(w_EKN)                                      # -> whether the kernel runs for this tensor
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch

from moelab.model.fp8 import E4M3, E4M3_MAX, EPS

BLOCK_R = 64  # along the reduced axis
BLOCK_J = 64  # along the kept axis


def kernel_applies(w_EKN: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether quantize_weight_kernel runs for w computed in `dtype`: a 3-d CUDA tensor (or any tensor under
    Triton's interpreter, TRITON_INTERPRET=1: the tests) with triton installed, and a dtype the kernel can take
    (w's own, fp32 of any w: exact, or bf16 of fp32 weights: rounded in the kernel)."""
    on_device = w_EKN.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    takes = dtype in (None, w_EKN.dtype, torch.float32) or (dtype == torch.bfloat16 and w_EKN.dtype == torch.float32)
    return on_device and takes and w_EKN.dim() == 3 and importlib.util.find_spec("triton") is not None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rowwise_e4m3_kernel(w_ptr, q_ptr, s_ptr, R, J, w_r, w_j, q_r, q_j, ROUND_BF16: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr):
        # expert e's [R, J] slice, reduced along r: w at r * w_r + j * w_j, q at r * q_r + j * q_j, scales [E, J]
        e = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
        j_ok = j < J
        w_base = w_ptr + e * R * J
        amax = tl.zeros([BLOCK_J], dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            ok = (r[:, None] < R) & j_ok[None, :]
            x = tl.load(w_base + r[:, None] * w_r + j[None, :] * w_j, mask=ok, other=0.0)
            if ROUND_BF16:  # fp32 -> nearest bf16 (ties to even) by integer ops: the interpreter's cast truncates
                b = x.to(tl.int32, bitcast=True)
                x = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=0))
        quotient = 448.0 / tl.maximum(amax, 1e-12)  # E4M3_MAX / max(amax, EPS) (moelab.model.fp8)
        biased_exp = (quotient.to(tl.int32, bitcast=True) >> 23) & 0xFF  # floor(log2(quotient)) + 127
        scale = (biased_exp << 23).to(tl.float32, bitcast=True)
        inv_scale = ((254 - biased_exp) << 23).to(tl.float32, bitcast=True)
        tl.store(s_ptr + e * J + j, inv_scale, mask=j_ok)
        q_base = q_ptr + e * R * J
        for r0 in range(0, R, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            ok = (r[:, None] < R) & j_ok[None, :]
            x = tl.load(w_base + r[:, None] * w_r + j[None, :] * w_j, mask=ok, other=0.0)
            if ROUND_BF16:
                b = x.to(tl.int32, bitcast=True)
                x = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
            v = tl.clamp(x.to(tl.float32) * scale[None, :], -448.0, 448.0)
            # round to the e4m3 grid in fp32 (ties to even: fp32 addition's rounding), so the cast below is exact
            # (Triton's interpreter truncates, and drops the carry into the exponent, when the cast rounds), on
            # |v| with the sign put back after: values that round to zero stay -0 where negative, as CUDA's cast
            a = tl.abs(v)
            v_exp = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
            quantum_exp = tl.maximum(v_exp, -6) - 3  # e4m3: 3 mantissa bits, smallest normal 2^-6
            shift = ((quantum_exp + 150) << 23).to(tl.float32, bitcast=True) * 1.5  # 1.5 * 2^(quantum_exp + 23)
            a = (a + shift) - shift
            # v's sign bit onto a by integer ops (-0.0 too; compiled, -a of 0.0 can come out +0: 0.0 - a)
            v = (a.to(tl.int32, bitcast=True) | (v.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32,
                                                                                               bitcast=True)
            tl.store(q_base + r[:, None] * q_r + j[None, :] * q_j, v.to(tl.float8e4nv), mask=ok)

    return rowwise_e4m3_kernel


assert (E4M3_MAX, EPS) == (448.0, 1e-12), "the kernel's literals follow moelab.model.fp8's constants"


def _operand_empty(w: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    E, K, N = w.shape
    if dim == -2:  # forward operand: [E, K, N] column-major, scales [E, N]
        return (torch.empty(E, N, K, dtype=E4M3, device=w.device).transpose(-2, -1),
                torch.empty(E, N, dtype=torch.float32, device=w.device))
    return (torch.empty(E, K, N, dtype=E4M3, device=w.device).transpose(-2, -1),  # dgrad: w^T as [E, N, K]
            torch.empty(E, K, dtype=torch.float32, device=w.device))


def quantize_weight_kernel(w_EKN: torch.Tensor, dim: int, dtype: torch.dtype | None = None,
                           out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The e4m3 operand of w_EKN.to(dtype) scaled along `dim`, by the tiled kernel: dim=-2 the forward operand
    (forward_operand: [E, K, N] column-major, scales [E, N]), dim=-1 the dgrad operand (dgrad_operand: w^T as
    [E, N, K] column-major, scales [E, K]). `dtype`: bf16 rounds (fp32) weights first, None or the weights' dtype
    takes them as they are; `out`: buffers of those shapes and layouts to write into (the weight cache's)."""
    import triton

    if not kernel_applies(w_EKN, dtype):
        raise ValueError(f"quantize_weight_kernel: not for {w_EKN.dtype} {tuple(w_EKN.shape)} weights on "
                         f"{w_EKN.device} computed in {dtype} (kernel_applies); moelab.model.fp8's quantisation is")
    if dim not in (-2, -1):
        raise ValueError(f"quantize_weight_kernel: dim={dim}; -2 (the forward operand) or -1 (the dgrad operand)")
    w = w_EKN.contiguous()
    E, K, N = w.shape
    q, s = _operand_empty(w, dim) if out is None else out
    if out is not None:
        ref_q, ref_s = _operand_empty(torch.empty(w.shape, device="meta"), dim)  # the layouts, no memory
        if (q.shape, q.stride(), q.dtype, s.shape) != (ref_q.shape, ref_q.stride(), E4M3, ref_s.shape) \
                or not s.is_contiguous():
            raise ValueError(f"quantize_weight_kernel: out buffers {tuple(q.shape)} {q.stride()} / {tuple(s.shape)}"
                             f" are not the e4m3 operand and contiguous scales of dim={dim} (moelab.model.fp8)")
    if dim == -2:  # reduce K (stride N), keep N (stride 1); q[e, k, n] at n * K + k
        R, J, w_r, w_j, q_r, q_j = K, N, N, 1, 1, K
    else:  # reduce N (stride 1), keep K (stride N); q row-major like w
        R, J, w_r, w_j, q_r, q_j = N, K, 1, N, 1, N
    round_bf16 = dtype == torch.bfloat16 and w.dtype != torch.bfloat16
    _kernel()[(E, triton.cdiv(J, BLOCK_J))](w, q, s, R, J, w_r, w_j, q_r, q_j, ROUND_BF16=round_bf16,
                                            BLOCK_R=BLOCK_R, BLOCK_J=BLOCK_J)
    return q, s


__all__ = ["kernel_applies", "quantize_weight_kernel"]
