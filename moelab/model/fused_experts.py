"""SwiGLU experts on the tokens themselves (backend.experts=triton_fused): ScatterMoE-style Triton kernels that read
each routed row straight from the token it came from and write it back to its token's slot, so no permuted copy
of the tokens, nor of the gradients, is ever made.

Shapes: T tokens, K experts per token, N = T*K routed rows in expert order, D hidden, F expert width, E experts.
`order_N`: the flat assignments (t*K + k) sorted by expert (moelab.model.rows); row r belongs to token
order_N[r] // K. Weights as GroupedExperts stores them: w_gate_up_EDF2 = [gate | up], w_down_EFD.

Forward (two kernels):
    up:   h_NF2 = x_TD[tok_N] @ W1[e]          the gather in the GEMM's loads; epilogue a_NF = silu(g) * u * w_N
    down: y_(TK)D[order_N] = a_NF @ W2[e]       the routing weight is already in a: each row lands in its token's
                                                slot, and y_TD is the sum over K of the slots (one pass over [T, K, D])
Backward (four kernels; only x_TD, h_NF2 and the routing weights are kept, not x_ND, a_NF nor y):
    da:   g_TD[tok_N] @ W2[e]^T, epilogue: dSwiGLU from the kept h (dh_NF2), the weights' gradient <da, a> and the
          weighted activation a_NF again (for dW2)
    dW2[e] = a_NF^T @ g_TD[tok_N],  dW1[e] = x_TD[tok_N]^T @ dh_NF2   (rows of expert e; gathers in the loads)
    dx:   dx_(TK)D[order_N] = dh_NF2 @ W1[e]^T, then the sum over K
Each kernel accumulates in fp32 and rounds once. When a weight already holds a gradient (the second and later micro
batches of a step, eager), the weight-gradient kernels start their fp32 sums from it and write the total into
`.grad` in place (one rounding; no new gradient tensor and no separate `.grad +=` pass over the weights); see
`accumulates_into`. The expert of each M block is found on the device (no host sync).

    y_TD = fused_experts(x_TD, w_flat, w_gate_up_EDF2, w_down_EFD, order_N, counts_E, K)

The ops are torch.library custom ops, so torch.compile keeps them whole (opaque to inductor) with their autograd.
On a CPU they run only under Triton's interpreter (TRITON_INTERPRET=1; the tests do that, at small shapes).
"""
from __future__ import annotations

import os

import torch

from moelab.backends.ops import accumulates_into

try:
    import triton
    import triton.language as tl
except ImportError:  # the backend then refuses (moelab.backends)
    triton = None


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def fused_applies(x: torch.Tensor) -> bool:
    """Whether the kernels can run on x's device: a CUDA GPU (sm80+, bf16 or fp16), or Triton's interpreter."""
    if triton is None:
        return False
    if x.device.type == "cuda":
        return x.dtype in (torch.bfloat16, torch.float16) and torch.cuda.get_device_capability(x.device)[0] >= 8
    return x.device.type == "cpu" and interpreted()


if triton is not None:

    @triton.jit
    def _up_kernel(x_ptr, tok_ptr, w1_ptr, scale_ptr, h_ptr, a_ptr, blk_e_ptr, blk_start_ptr, ends_ptr,
                   D, F, s_x, s_we, s_wd, s_wf, s_h, s_a,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)  # N fastest: an M block's rows stay in L2
        e = tl.load(blk_e_ptr + pid_m)
        if e >= 0:
            rows = tl.load(blk_start_ptr + pid_m) + tl.arange(0, BM)
            rmask = rows < tl.load(ends_ptr + e)
            tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
            cols = pid_n * BN + tl.arange(0, BN)
            cmask = cols < F
            acc_g = tl.zeros((BM, BN), dtype=tl.float32)
            acc_u = tl.zeros((BM, BN), dtype=tl.float32)
            w_base = w1_ptr + e.to(tl.int64) * s_we
            for k0 in range(0, D, BK):
                ks = k0 + tl.arange(0, BK)
                kmask = ks < D
                xt = tl.load(x_ptr + tok[:, None] * s_x + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
                wmask = kmask[:, None] & cmask[None, :]
                wg = tl.load(w_base + ks[:, None] * s_wd + cols[None, :] * s_wf, mask=wmask, other=0.0)
                wu = tl.load(w_base + ks[:, None] * s_wd + (cols[None, :] + F) * s_wf, mask=wmask, other=0.0)
                acc_g = tl.dot(xt, wg, acc_g)
                acc_u = tl.dot(xt, wu, acc_u)
            omask = rmask[:, None] & cmask[None, :]
            g = acc_g.to(h_ptr.dtype.element_ty)
            u = acc_u.to(h_ptr.dtype.element_ty)
            h_rows = h_ptr + rows.to(tl.int64)[:, None] * s_h
            tl.store(h_rows + cols[None, :], g, mask=omask)
            tl.store(h_rows + F + cols[None, :], u, mask=omask)
            gf, uf = g.to(tl.float32), u.to(tl.float32)
            scale = tl.load(scale_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            a = gf * tl.sigmoid(gf) * uf
            a = a.to(a_ptr.dtype.element_ty).to(tl.float32) * scale[:, None]  # scale_rows' rounding
            tl.store(a_ptr + rows.to(tl.int64)[:, None] * s_a + cols[None, :], a.to(a_ptr.dtype.element_ty), mask=omask)

    @triton.jit
    def _rows_kernel(a_ptr, src_ptr, b_ptr, out_ptr, dst_ptr, blk_e_ptr, blk_start_ptr, ends_ptr,
                     KD, ND, s_a, s_be, s_bk, s_bn, s_o,
                     GATHER: tl.constexpr, SCATTER: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """out[dst[r]] = A[src[r]] @ B[e] for the rows r of M block pid_m (src / dst: identity unless GATHER /
        SCATTER)."""
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)  # N fastest: an M block's rows stay in L2
        e = tl.load(blk_e_ptr + pid_m)
        if e >= 0:
            rows = tl.load(blk_start_ptr + pid_m) + tl.arange(0, BM)
            rmask = rows < tl.load(ends_ptr + e)
            src = rows.to(tl.int64)
            if GATHER:
                src = tl.load(src_ptr + rows, mask=rmask, other=0).to(tl.int64)
            cols = pid_n * BN + tl.arange(0, BN)
            cmask = cols < ND
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            b_base = b_ptr + e.to(tl.int64) * s_be
            for k0 in range(0, KD, BK):
                ks = k0 + tl.arange(0, BK)
                kmask = ks < KD
                at = tl.load(a_ptr + src[:, None] * s_a + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
                bt = tl.load(b_base + ks[:, None] * s_bk + cols[None, :] * s_bn, mask=kmask[:, None] & cmask[None, :],
                             other=0.0)
                acc = tl.dot(at, bt, acc)
            dst = rows.to(tl.int64)
            if SCATTER:
                dst = tl.load(dst_ptr + rows, mask=rmask, other=0).to(tl.int64)
            tl.store(out_ptr + dst[:, None] * s_o + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def _da_kernel(g_ptr, tok_ptr, w2_ptr, h_ptr, scale_ptr, dh_ptr, a_ptr, dscale_ptr,
                   blk_e_ptr, blk_start_ptr, ends_ptr, D, F, s_g, s_we, s_wf, s_wd, s_h, s_a,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """da = g_TD[tok] @ W2[e]^T over F columns; epilogue: dSwiGLU into dh_NF2, a_NF = w * silu(g) * u, and
        <da, silu(g) * u> added into dscale_N (the routing weights' gradient)."""
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)  # N fastest: an M block's rows stay in L2
        e = tl.load(blk_e_ptr + pid_m)
        if e >= 0:
            rows = tl.load(blk_start_ptr + pid_m) + tl.arange(0, BM)
            rmask = rows < tl.load(ends_ptr + e)
            tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
            cols = pid_n * BN + tl.arange(0, BN)
            cmask = cols < F
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            w_base = w2_ptr + e.to(tl.int64) * s_we
            for k0 in range(0, D, BK):
                ks = k0 + tl.arange(0, BK)
                kmask = ks < D
                gt = tl.load(g_ptr + tok[:, None] * s_g + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
                wt = tl.load(w_base + ks[:, None] * s_wd + cols[None, :] * s_wf, mask=kmask[:, None] & cmask[None, :],
                             other=0.0)  # W2[e]^T tile [BK (D), BN (F)]
                acc = tl.dot(gt, wt, acc)
            omask = rmask[:, None] & cmask[None, :]
            r64 = rows.to(tl.int64)[:, None]
            gf = tl.load(h_ptr + r64 * s_h + cols[None, :], mask=omask, other=0.0).to(tl.float32)
            uf = tl.load(h_ptr + r64 * s_h + F + cols[None, :], mask=omask, other=0.0).to(tl.float32)
            scale = tl.load(scale_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(gf)
            silu = gf * sig
            a0 = (silu * uf).to(a_ptr.dtype.element_ty).to(tl.float32)
            da = acc.to(a_ptr.dtype.element_ty).to(tl.float32)  # the bf16 gradient autograd hands scale_rows
            tl.atomic_add(dscale_ptr + rows, tl.sum(tl.where(omask, da * a0, 0.0), axis=1), mask=rmask)
            da0 = (da * scale[:, None]).to(a_ptr.dtype.element_ty).to(tl.float32)
            dg = da0 * uf * sig * (1.0 + gf * (1.0 - sig))
            du = da0 * silu
            tl.store(dh_ptr + r64 * s_h + cols[None, :], dg.to(dh_ptr.dtype.element_ty), mask=omask)
            tl.store(dh_ptr + r64 * s_h + F + cols[None, :], du.to(dh_ptr.dtype.element_ty), mask=omask)
            tl.store(a_ptr + r64 * s_a + cols[None, :], (a0 * scale[:, None]).to(a_ptr.dtype.element_ty), mask=omask)

    @triton.jit
    def _wgrad_kernel(a_ptr, a_idx_ptr, b_ptr, b_idx_ptr, out_ptr, starts_ptr, ends_ptr,
                      I, J, s_a, s_b, s_oe, s_oi,
                      GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, ACCUMULATE: tl.constexpr,
                      BI: tl.constexpr, BJ: tl.constexpr, BK: tl.constexpr):
        """out[e] = A[rows of e]^T @ B[rows of e] ([I, J]) (+ out[e] when ACCUMULATE, summed in fp32 and rounded
        once), A's / B's rows read through a_idx / b_idx when GATHER_A / GATHER_B; experts without rows write zeros
        (or leave out as it was)."""
        pid, e = tl.program_id(0), tl.program_id(1)  # an expert's tiles together: its rows stay in L2
        n_j = tl.cdiv(J, BJ)
        ci = (pid // n_j) * BI + tl.arange(0, BI)
        cj = (pid % n_j) * BJ + tl.arange(0, BJ)
        imask, jmask = ci < I, cj < J
        start = tl.load(starts_ptr + e)
        end = tl.load(ends_ptr + e)
        o_ptrs = out_ptr + e.to(tl.int64) * s_oe + ci[:, None] * s_oi + cj[None, :]
        omask = imask[:, None] & jmask[None, :]
        acc = tl.zeros((BI, BJ), dtype=tl.float32)
        if ACCUMULATE:
            acc += tl.load(o_ptrs, mask=omask, other=0.0).to(tl.float32)
        for r0 in range(start, end, BK):
            rows = r0 + tl.arange(0, BK)
            rmask = rows < end
            ra = rows.to(tl.int64)
            if GATHER_A:
                ra = tl.load(a_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
            rb = rows.to(tl.int64)
            if GATHER_B:
                rb = tl.load(b_idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
            at = tl.load(a_ptr + ra[None, :] * s_a + ci[:, None], mask=imask[:, None] & rmask[None, :], other=0.0)
            bt = tl.load(b_ptr + rb[:, None] * s_b + cj[None, :], mask=rmask[:, None] & jmask[None, :], other=0.0)
            acc = tl.dot(at, bt, acc)
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


def _blocks(counts_E: torch.Tensor, n_rows: int, bm: int):
    """Each M block's expert (-1: idle) and first row, for a grid of cdiv(N, bm) + E blocks (a bound that needs
    no host sync); and the experts' row starts and ends (int32)."""
    E = counts_E.shape[0]
    ends_E = torch.cumsum(counts_E, 0).to(torch.int32)
    starts_E = ends_E - counts_E.to(torch.int32)
    nblk_E = (counts_E + bm - 1) // bm
    blk_ends_E = torch.cumsum(nblk_E, 0)
    pid = torch.arange(triton.cdiv(n_rows, bm) + E, device=counts_E.device)
    e = torch.searchsorted(blk_ends_E, pid, right=True)
    idle = e >= E
    e = e.clamp(max=E - 1)
    start = starts_E[e] + (pid - (blk_ends_E[e] - nblk_E[e])) * bm
    return torch.where(idle, -1, e).to(torch.int32), start.to(torch.int32), starts_E, ends_E


def _config(n_cols: int):
    """Block sizes: (BM, BN, BK, warps, stages, BN of the da kernel). Small under the interpreter (tests),
    Hopper-sized on a GPU, the da kernel's tiles at most 64 wide (its epilogue holds the accumulator, both halves
    of h and dSwiGLU's terms in fp32 at once, as the up kernel holds two accumulators);
    $MOELAB_FUSED_BLOCKS="BM,BN,BK,warps,stages[,BN_da]" overrides them (gallery/scripts/gpu_moe_layer.py's sweep)."""
    if interpreted():
        return 16, 16, 16, 1, 1, 16
    if os.environ.get("MOELAB_FUSED_BLOCKS"):
        v = tuple(int(x) for x in os.environ["MOELAB_FUSED_BLOCKS"].split(","))
        return v if len(v) == 6 else (*v, min(v[1], 64))
    bn = 128 if n_cols >= 128 else 64
    return 128, bn, 64, 8, 3, min(bn, 64)


@torch.library.custom_op("moelab::fused_experts_fwd", mutates_args=())
def _fwd(x_TD: torch.Tensor, scale_N: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, tok_N: torch.Tensor,
         order_N: torch.Tensor, counts_E: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    T, D = x_TD.shape
    N, F = tok_N.shape[0], w2.shape[1]
    BM, BN, BK, warps, stages, _ = _config(F)
    blk_e, blk_start, _, ends_E = _blocks(counts_E, N, BM)
    h_NF2 = torch.empty(N, 2 * F, dtype=x_TD.dtype, device=x_TD.device)
    a_NF = torch.empty(N, F, dtype=x_TD.dtype, device=x_TD.device)
    BNu = min(BN, 64) if not interpreted() else BN  # two accumulators: half the width each
    _up_kernel[(triton.cdiv(F, BNu), blk_e.shape[0])](
        x_TD, tok_N, w1, scale_N, h_NF2, a_NF, blk_e, blk_start, ends_E, D, F, x_TD.stride(0), w1.stride(0),
        w1.stride(1), w1.stride(2), h_NF2.stride(0), a_NF.stride(0), BM=BM, BN=BNu, BK=BK, num_warps=warps,
        num_stages=stages)
    y_ND = torch.empty(N, D, dtype=x_TD.dtype, device=x_TD.device)  # every row written (all assignments kept)
    _rows_kernel[(triton.cdiv(D, BN), blk_e.shape[0])](
        a_NF, tok_N, w2, y_ND, order_N, blk_e, blk_start, ends_E, F, D, a_NF.stride(0), w2.stride(0),
        w2.stride(1), w2.stride(2), y_ND.stride(0), GATHER=False, SCATTER=True, BM=BM, BN=BN, BK=BK,
        num_warps=warps, num_stages=stages)
    return y_ND.view(T, K, D).sum(1, dtype=torch.promote_types(x_TD.dtype, scale_N.dtype)), h_NF2


@_fwd.register_fake
def _(x_TD, scale_N, w1, w2, tok_N, order_N, counts_E, K):
    N, F = tok_N.shape[0], w2.shape[1]
    return (x_TD.new_empty(x_TD.shape, dtype=torch.promote_types(x_TD.dtype, scale_N.dtype)),
            x_TD.new_empty(N, 2 * F))


def _bwd_kernels(g_TD, x_TD, h_NF2, scale_N, w1, w2, tok_N, order_N, counts_E, K: int, dw1=None, dw2=None):
    """The backward's six kernels: (dx_TD, dscale_N, dw1, dw2). Given dw1 / dw2 (the weights' `.grad`), the
    weight gradients are added into them in place and returned as they are."""
    T, D = x_TD.shape
    N, F = tok_N.shape[0], w2.shape[1]
    E = w1.shape[0]
    BM, BN, BK, warps, stages, BNd = _config(F)
    blk_e, blk_start, starts_E, ends_E = _blocks(counts_E, N, BM)
    g_TD = g_TD.to(x_TD.dtype).contiguous()
    dh_NF2 = torch.empty_like(h_NF2)
    a_NF = torch.empty(N, F, dtype=x_TD.dtype, device=x_TD.device)
    dscale_N = torch.zeros(N, dtype=torch.float32, device=x_TD.device)
    _da_kernel[(triton.cdiv(F, BNd), blk_e.shape[0])](
        g_TD, tok_N, w2, h_NF2, scale_N, dh_NF2, a_NF, dscale_N, blk_e, blk_start, ends_E, D, F, g_TD.stride(0),
        w2.stride(0), w2.stride(1), w2.stride(2), h_NF2.stride(0), a_NF.stride(0), BM=BM, BN=BNd, BK=BK,
        num_warps=warps, num_stages=stages)
    dx_ND = torch.empty(N, D, dtype=x_TD.dtype, device=x_TD.device)
    _rows_kernel[(triton.cdiv(D, BN), blk_e.shape[0])](
        dh_NF2, tok_N, w1, dx_ND, order_N, blk_e, blk_start, ends_E, 2 * F, D, dh_NF2.stride(0), w1.stride(0),
        w1.stride(2), w1.stride(1), dx_ND.stride(0), GATHER=False, SCATTER=True, BM=BM, BN=BN, BK=BK,
        num_warps=warps, num_stages=stages)  # W1[e]^T: [2F, D]
    accumulate2, accumulate1 = dw2 is not None, dw1 is not None
    dw2 = dw2 if accumulate2 else torch.empty_like(w2)
    BI = BJ = min(BN, 128)
    _wgrad_kernel[(triton.cdiv(F, BI) * triton.cdiv(D, BJ), E)](
        a_NF, tok_N, g_TD, tok_N, dw2, starts_E, ends_E, F, D, a_NF.stride(0), g_TD.stride(0), dw2.stride(0),
        dw2.stride(1), GATHER_A=False, GATHER_B=True, ACCUMULATE=accumulate2, BI=BI, BJ=BJ, BK=BK,
        num_warps=warps, num_stages=stages)
    dw1 = dw1 if accumulate1 else torch.empty_like(w1)
    _wgrad_kernel[(triton.cdiv(D, BI) * triton.cdiv(2 * F, BJ), E)](
        x_TD, tok_N, dh_NF2, tok_N, dw1, starts_E, ends_E, D, 2 * F, x_TD.stride(0), dh_NF2.stride(0),
        dw1.stride(0), dw1.stride(1), GATHER_A=True, GATHER_B=False, ACCUMULATE=accumulate1, BI=BI, BJ=BJ, BK=BK,
        num_warps=warps, num_stages=stages)
    dx_TD = dx_ND.view(T, K, D).sum(1, dtype=x_TD.dtype)
    return dx_TD, dscale_N.to(scale_N.dtype), dw1, dw2


@torch.library.custom_op("moelab::fused_experts_bwd", mutates_args=())
def _bwd(g_TD: torch.Tensor, x_TD: torch.Tensor, h_NF2: torch.Tensor, scale_N: torch.Tensor, w1: torch.Tensor,
         w2: torch.Tensor, tok_N: torch.Tensor, order_N: torch.Tensor, counts_E: torch.Tensor,
         K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_kernels(g_TD, x_TD, h_NF2, scale_N, w1, w2, tok_N, order_N, counts_E, K)


@_bwd.register_fake
def _(g_TD, x_TD, h_NF2, scale_N, w1, w2, tok_N, order_N, counts_E, K):
    return torch.empty_like(x_TD), torch.empty_like(scale_N), torch.empty_like(w1), torch.empty_like(w2)


def _setup(ctx, inputs, output):
    x_TD, scale_N, w1, w2, tok_N, order_N, counts_E, K = inputs
    ctx.save_for_backward(x_TD, output[1], scale_N, w1, w2, tok_N, order_N, counts_E)
    ctx.K = K


def _backward(ctx, g_TD, g_h):
    x_TD, h_NF2, scale_N, w1, w2, tok_N, order_N, counts_E = ctx.saved_tensors
    if accumulates_into(w1) and accumulates_into(w2):  # a later micro batch: add into .grad in the kernels
        dx, dscale, _, _ = _bwd_kernels(g_TD, x_TD, h_NF2, scale_N, w1, w2, tok_N, order_N, counts_E, ctx.K,
                                        dw1=w1.grad, dw2=w2.grad)
        return dx, dscale, None, None, None, None, None, None
    dx, dscale, dw1, dw2 = _bwd(g_TD, x_TD, h_NF2, scale_N, w1, w2, tok_N, order_N, counts_E, ctx.K)
    return dx, dscale, dw1, dw2, None, None, None, None


torch.library.register_autograd("moelab::fused_experts_fwd", _backward, setup_context=_setup)


def fused_experts(x_TD: torch.Tensor, weights_TK: torch.Tensor, w_gate_up_EDF2: torch.Tensor, w_down_EFD: torch.Tensor,
                  order_N: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """y_TD = sum over k of weights_TK[t, k] * expert(x_TD[t]) for the expert of assignment (t, k), every
    assignment kept (no capacity drops); order_N sorts the T*K flat assignments by expert, counts_E counts them.
    In the dtype a weighted combine returns (moelab.model.moe.LocalDispatcher.combine): x's promoted with the
    weights'."""
    K = weights_TK.shape[1]
    tok_N = torch.div(order_N, K, rounding_mode="floor").to(torch.int32)
    scale_N = weights_TK.reshape(-1)[order_N]
    y_TD, _ = _fwd(x_TD.contiguous(), scale_N, w_gate_up_EDF2.contiguous(), w_down_EFD.contiguous(), tok_N,
                   order_N.to(torch.int32), counts_E, K)
    return y_TD


class _LeanGroupedExperts(torch.autograd.Function):
    """The same experts with torch._grouped_mm and torch ops (no Triton), keeping what the kernels keep (x_TD,
    h_NF2, the weights): the gathered rows and the activation are made again in backward instead of saved. A
    traceable Function: compiled, inductor fuses the gathers and SwiGLU's passes around the grouped GEMMs."""

    @staticmethod
    def forward(ctx, x_TD, scale_N, w1, w2, tok_N, order_N, inverse_N, offs_E, K: int, out_dtype: torch.dtype):
        T, D = x_TD.shape
        h_NF2 = torch._grouped_mm(x_TD[tok_N], w1, offs=offs_E)
        gate_NF, up_NF = h_NF2.chunk(2, dim=-1)
        a_NF = (torch.nn.functional.silu(gate_NF) * up_NF * scale_N[:, None]).to(x_TD.dtype)
        y_ND = torch._grouped_mm(a_NF, w2, offs=offs_E)
        ctx.save_for_backward(x_TD, h_NF2, scale_N, w1, w2, tok_N, order_N, inverse_N, offs_E)
        ctx.K = K
        return y_ND[inverse_N].view(T, K, D).sum(1, dtype=out_dtype)

    @staticmethod
    def backward(ctx, g_TD):
        x_TD, h_NF2, scale_N, w1, w2, tok_N, order_N, inverse_N, offs_E = ctx.saved_tensors
        T, D = x_TD.shape
        g_ND = g_TD.to(x_TD.dtype)[tok_N]  # the combine's gradient: every row its token's
        da_NF = torch._grouped_mm(g_ND, w2.transpose(-2, -1), offs=offs_E).float()
        gate_NF, up_NF = h_NF2.float().chunk(2, dim=-1)
        sig_NF = torch.sigmoid(gate_NF)
        silu_NF = gate_NF * sig_NF
        dscale_N = (da_NF * silu_NF * up_NF).sum(-1).to(scale_N.dtype)
        da_NF = da_NF * scale_N[:, None]
        dh_NF2 = torch.cat([da_NF * up_NF * sig_NF * (1 + gate_NF * (1 - sig_NF)), da_NF * silu_NF], -1)
        dh_NF2 = dh_NF2.to(x_TD.dtype)
        a_NF = (silu_NF * up_NF * scale_N[:, None]).to(x_TD.dtype)
        dw2 = torch._grouped_mm(a_NF.transpose(0, 1), g_ND, offs=offs_E)
        dw1 = torch._grouped_mm(x_TD[tok_N].transpose(0, 1), dh_NF2, offs=offs_E)
        dx_ND = torch._grouped_mm(dh_NF2, w1.transpose(-2, -1), offs=offs_E)
        dx_TD = dx_ND[inverse_N].view(T, ctx.K, D).sum(1, dtype=x_TD.dtype)
        return dx_TD, dscale_N, dw1, dw2, None, None, None, None, None, None


def lean_grouped_experts(x_TD: torch.Tensor, weights_TK: torch.Tensor, w_gate_up_EDF2: torch.Tensor,
                         w_down_EFD: torch.Tensor, order_N: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """fused_experts' result and saved tensors with torch._grouped_mm instead of the Triton kernels."""
    K = weights_TK.shape[1]
    tok_N = torch.div(order_N, K, rounding_mode="floor")
    positions = torch.arange(order_N.shape[0], device=order_N.device, dtype=order_N.dtype)
    inverse_N = torch.empty_like(order_N).scatter_(0, order_N, positions)
    scale_N = weights_TK.reshape(-1)[order_N]
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    return _LeanGroupedExperts.apply(x_TD, scale_N, w_gate_up_EDF2, w_down_EFD, tok_N, order_N, inverse_N, offs_E, K,
                                     torch.promote_types(x_TD.dtype, weights_TK.dtype))
