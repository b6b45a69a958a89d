"""Issue 31's blockwise FP8 trial: DeepSeek-V3-style scales (1x128 for activations and gradients, 128x128 for expert
weights) against moelab's rowwise FP8 and bf16, at the Qwen3-30B-A3B proxy's expert GEMMs on one GPU.

    python gallery/scripts/gpu_fp8_blockwise.py --out DIR              # writes DIR/fp8-blockwise-trial.json
    TRITON_INTERPRET=1 python gallery/scripts/gpu_fp8_blockwise.py --out DIR --small   # CPU: checks the script

One MoE layer, one micro batch: 8192 tokens x top-8 = M 65536 routed rows sorted by expert, E 128, D 2048, F 768:
gate_up x [M, D] @ w [E, D, 2F], down h [M, F] @ w [E, F, D], each GEMM's forward, dgrad and wgrad; rows split
evenly and by a fixed-seed Zipf-like draw (both recorded). GEMM letters: a_MK @ b_KN, as in moelab.model.fp8.
Sections (the record, projection included, is rewritten after each: a timeout keeps what came before):
  grouped     per split: bf16 torch._grouped_mm; moelab's rowwise recipe (torch._scaled_grouped_mm fwd/dgrad, bf16
              wgrad); blockwise via F.scaled_grouped_mm / torch._scaled_grouped_mm (refusals recorded); the Triton
              blockwise grouped kernel below (fwd, dgrad; the fastest of a few configs per GEMM)
  dense       the GEMMs on the concatenated rows x one expert's weight, bf16 / rowwise / blockwise (cuBLAS): the
              rate a grouped blockwise kernel could reach at best
  quant       compiled passes: rowwise vs 1x128 of activations and gradients, 1x128 along the tokens (an FP8
              wgrad's operands), rowwise (both copies) vs 128x128 (+ transposed e4m3 copy) of the expert weights
  projection  per layer and micro batch (8 layers; weights quantised once per step of 8 micro batches): expert
              GEMMs + each recipe's quantisation passes, and whether blockwise pays at these shapes
Times: CUDA events, warm-up, median of REPS. Errors: relative Frobenius norm against fp32 GEMMs of the unquantised
operands on 3 experts (the Triton kernel's also against its dequantised operands).

What torch offers (read in torch's source; the pytorch/pytorch files at the stored commits named):
- torch/nn/functional.py (2.13 here; the record's torch_api shows the GPU's): scaled_mm / scaled_grouped_mm take
  ScalingType recipes (TensorWise, RowWise, BlockWise1x16, BlockWise1x32, BlockWise1x128, BlockWise128x128) and
  call torch._scaled_mm_v2 / torch._scaled_grouped_mm_v2.
- aten/src/ATen/native/cuda/GroupedBlas.cpp (@00d4eaf9): _scaled_grouped_mm_cuda_v2 takes four recipes only
  (scale_grouped_kernel_dispatch: rowwise_rowwise, mxfp8_mxfp8, mxfp4_mxfp4, nvfp4_nvfp4), else ValueError "No gemm
  implementation was found"; the legacy _scaled_grouped_mm_cuda reads fp32 scales as rowwise (1-D per row for a
  2-D operand) and e8m0 ones as MXFP8 (fbgemm_gpu's mx8mx8bf16_grouped_mm: USE_FBGEMM_GENAI, 1x32 e8m0 scales,
  block-scaled MMA of Blackwell). So torch has no 1x128 / 128x128 grouped GEMM on SM90.
- aten/src/ATen/native/cuda/ScaledBlas.cpp (@0174dfab): dense blockwise exists. The legacy _scaled_mm infers the
  recipe from the scale shapes (get_joint_scaling: (128x128, 1x128), (1x128, 128x128), (1x128, 1x128)), v2 takes
  it from scale_kernel_dispatch (block_1x128_128x128, ...); both reach at::cuda::blas::scaled_gemm (cuBLASLt);
  _check_deepseek_support: SM90 only, cublasLt >= 12.9; on SM90 row-major a x column-major b only. Layouts (meta
  of _scaled_mm_v2 in torch/_meta_registrations.py; sample_inputs_scaled_mm_v2 in
  torch/testing/_internal/common_methods_invocations.py): 1x128 scales of a [M, K/128], strides (1, M); 128x128
  scales of b [L4, N/128], strides (1, L4), L4 = K/128 rounded up to 4.
- torch/_inductor/kernel/mm.py has Triton templates for dense blockwise scaled_mm (main_loop_scaling_types);
  mm_grouped.py's scaled_grouped_mm template lowers the legacy aten._scaled_grouped_mm only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moelab.model import fp8
from moelab.train.bench import median_ms, commit_id

BLOCK, BF16, LAYERS, MICRO_BATCHES = 128, torch.bfloat16, 8, 8
GEMMS = ("gate_up.fwd", "gate_up.dgrad", "gate_up.wgrad", "down.fwd", "down.dgrad", "down.wgrad")


# ---------------------------------------------------------------- blockwise quantisation (power-of-two scales)
def _scale(amax: torch.Tensor) -> torch.Tensor:
    """moelab's rowwise rule per block: 2^floor(log2(448 / amax)) (dequantising is exact)."""
    return torch.exp2(torch.floor(torch.log2(fp8.E4M3_MAX / amax.float().clamp(min=fp8.EPS))))


def quantize_1x128(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q [M, K] row-major e4m3, s [M, K/128] fp32 with strides (1, M)): x ~= x_q * s per 1x128 block; any
    layout of x (x.t() quantises along the other dim: an FP8 wgrad's operands)."""
    M, K = x_MK.shape
    xb = x_MK.float().reshape(M, K // BLOCK, BLOCK)
    scale = _scale(xb.abs().amax(-1))
    x_q = (xb * scale[..., None]).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(fp8.E4M3).view(M, K)
    # row-major whatever x's layout (elementwise results keep a transposed input's strides)
    return x_q.contiguous(), scale.reciprocal().t().contiguous().t()


def quantize_128x128(w_EKN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_ENK: [E, N, K] (K contiguous: the forward's operand), q_EKN: [E, K, N] (the dgrad's), s [E, K/128, N/128]):
    the dgrad's copy is the forward's e4m3 bytes transposed, no second quantisation."""
    E, K, N = w_EKN.shape
    wb = w_EKN.float().reshape(E, K // BLOCK, BLOCK, N // BLOCK, BLOCK)
    scale = _scale(wb.abs().amax(dim=(2, 4)))
    q = (wb * scale[:, :, None, :, None]).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(fp8.E4M3).view(E, K, N).contiguous()
    return q.transpose(1, 2).contiguous(), q, scale.reciprocal()


def dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """q [R, C] times its block scales s [R/r, C/c] broadcast over the r x c blocks."""
    return q.float() * s.repeat_interleave(q.shape[0] // s.shape[0], 0).repeat_interleave(q.shape[1] // s.shape[1], 1)


# ---------------------------------------------------------------- Triton blockwise grouped GEMM
@triton.jit(do_not_specialize=["s_sam", "s_sak", "s_sbe", "s_sbn", "s_sbk"])  # one compile per config
def _grouped_fp8_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, tile_e_ptr, tile_row_ptr, offs_ptr, N, K,
                        s_am, s_sam, s_sak, s_be, s_bn, s_bk, s_sbe, s_sbn, s_sbk, s_cm,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    e = tl.load(tile_e_ptr + tl.program_id(0))
    if e >= 0:
        rows = tl.load(tile_row_ptr + tl.program_id(0)) + tl.arange(0, BM)
        mask_m = rows < tl.load(offs_ptr + e)  # the expert's rows end there (its tiles are padded by masking)
        rows = rows.to(tl.int64)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        mask_n = cols < N
        ks = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BK)):
            k = kb * BK + ks
            a = tl.load(a_ptr + rows[:, None] * s_am + k[None, :], mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptr + e * s_be + cols[None, :] * s_bn + k[:, None] * s_bk, mask=mask_n[None, :], other=0.0)
            sa = tl.load(sa_ptr + rows * s_sam + kb * s_sak, mask=mask_m, other=0.0)
            sb = tl.load(sb_ptr + e * s_sbe + (cols // 128) * s_sbn + kb * s_sbk, mask=mask_n, other=0.0)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]  # each 128-K block promoted to fp32 with its scales
        tl.store(c_ptr + rows[:, None] * s_cm + cols[None, :], acc.to(tl.bfloat16),
                 mask=mask_m[:, None] & mask_n[None, :])


def tile_table(counts_E: torch.Tensor, rows: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM-like contiguous grouped layout: per M tile, (its expert, its first row), -1 past the last tile;
    on the device, no host sync (the grid is the bound rows/bm + E)."""
    tiles_E = (counts_E + bm - 1) // bm
    tile_end = torch.cumsum(tiles_E, 0)
    t = torch.arange(-(-rows // bm) + counts_E.numel(), device=counts_E.device)
    e = torch.searchsorted(tile_end, t, right=True)
    ec = e.clamp(max=counts_E.numel() - 1)
    first = (torch.cumsum(counts_E, 0) - counts_E)[ec] + (t - (tile_end - tiles_E)[ec]) * bm
    return torch.where(e < counts_E.numel(), e, -1).int(), first.int()


def grouped_fp8_triton(a_q, sa, b_q, sb, offs, tiles, cfg) -> torch.Tensor:
    """out[rows of e] = sum over 128-K blocks of (a_q @ b_q[e]^T) * sa * sb: a_q [M, K] e4m3 row-major, sa [M, K/128],
    b_q [E, N, K] (K contiguous), sb [E, N/128, K/128] (any strides), offs_E the experts' cumulative row counts."""
    bm, bn, warps, stages = cfg
    out = torch.empty(a_q.shape[0], b_q.shape[1], device=a_q.device, dtype=BF16)
    tile_e, tile_row = tiles[bm]
    _grouped_fp8_kernel[(tile_e.numel(), triton.cdiv(b_q.shape[1], bn))](
        a_q, sa, b_q, sb, out, tile_e, tile_row, offs, b_q.shape[1], a_q.shape[1], a_q.stride(0), *sa.stride(),
        *b_q.stride(), *sb.stride(), out.stride(0), BM=bm, BN=bn, BK=BLOCK, num_warps=warps, num_stages=stages)
    return out


# ---------------------------------------------------------------- cuBLAS blockwise (dense)
def blockwise_mm(a_q, sa, b_q, sb, b_blocks: str, fast: bool):
    """(fn, path) of cuBLASLt's blockwise GEMM: a_q [M, K] row-major with 1x128 scales sa [M, K/128] (strides
    (1, M)); b_q [K, N] column-major with 128x128 scales sb [K/128, N/128], or (b_blocks '1x128') scales along K
    sb [N, K/128] (strides (1, N)). F.scaled_mm first (128x128 scales padded to L4 rows; then without fast
    accumulation), else the legacy torch._scaled_mm with the layouts it infers the recipe from; every refusal is
    kept in `path`."""
    S, v2_b, legacy_b = F.ScalingType, sb, sb.t()
    if b_blocks == "128x128":
        v2_b = sb.new_zeros(sb.shape[1], -(-sb.shape[0] // 4) * 4)
        v2_b[:, :sb.shape[0]] = sb.t()
        v2_b, legacy_b = v2_b.t(), sb.t().contiguous().t()
    recipe_b = S.BlockWise128x128 if b_blocks == "128x128" else S.BlockWise1x128
    v2 = lambda acc: lambda: F.scaled_mm(a_q, b_q, sa, S.BlockWise1x128, v2_b, recipe_b, output_dtype=BF16,
                                         use_fast_accum=acc)
    calls = {"F.scaled_mm": v2(fast), "F.scaled_mm, use_fast_accum=False": v2(False),
             "torch._scaled_mm": lambda: torch._scaled_mm(a_q, b_q, sa, legacy_b, out_dtype=BF16)}
    errors = []
    for path, fn in calls.items():
        try:
            fn()
            return fn, " after ".join([path] + errors)
        except Exception as e:  # noqa: BLE001 (the next path; all refusals raised together)
            errors.append(f"{path}: {type(e).__name__}: {str(e)[:300]}")
    raise RuntimeError(" | ".join(errors))


# ---------------------------------------------------------------- measuring
def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def measure(res: dict, key: str, fn, reps: int, check=lambda out: {}) -> None:
    """res[key] = {"ms": fn's time, **check(fn())}, or the error (printed and recorded; the rest goes on)."""
    try:
        res[key] = {"ms": median_ms(fn, reps, warmup=3 if reps >= 5 else 1), **check(fn())}
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        res[key] = {"error": f"{type(e).__name__}: {str(e)[:600]}"}


def splits(rows: int, experts: int, dev) -> dict:
    """even: rows/E each; zipf: a multinomial draw (seed 0) with p_e ~ 1/(e+20), experts shuffled (at the proxy's
    shapes the largest expert gets about 3x the mean, the smallest about 0.4x)."""
    g = torch.Generator().manual_seed(0)
    p = 1.0 / (torch.arange(experts, dtype=torch.float64) + 20)
    zipf = torch.bincount(torch.multinomial(p[torch.randperm(experts, generator=g)], rows, True, generator=g),
                          minlength=experts)
    return {"zipf": zipf.to(dev), "even": torch.full((experts,), rows // experts, device=dev)}


# ---------------------------------------------------------------- the sections
def grouped_section(ops, counts, w_q, reps, configs, interp) -> dict:
    """Every grouped variant of the six GEMMs at one split (operands quantised beforehand: not timed here)."""
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    starts = [0] + offs.tolist()
    nz = [e for e in range(len(counts)) if counts[e] > 0]
    check = sorted({nz[0], int(counts.argmax()), nz[-1]})
    tiles = {c[0]: tile_table(counts, starts[-1], c[0]) for c in configs}
    res = {"counts": {"max": int(counts.max()), "min": int(counts.min()), "mean": float(counts.float().mean())},
           "checked_experts": check}
    measure(res, "tile_table", lambda: tile_table(counts, starts[-1], configs[0][0]), reps)
    rows = lambda t, e: t[starts[e]:starts[e + 1]]
    picked = lambda out: torch.cat([rows(out, e) for e in check]).float()
    S = F.ScalingType
    for name in GEMMS:
        layer, kind = name.split(".")
        w, (wr, q_ENK, q_EKN, sw) = ops["w_" + layer], w_q[layer]
        r = res[name] = {}
        if kind == "wgrad":  # bf16 in every recipe here (moelab's rowwise recipe too)
            a, g = (ops["x"], ops["g_gu"]) if layer == "gate_up" else (ops["h"], ops["g_down"])
            ref = torch.stack([rows(a, e).float().t() @ rows(g, e).float() for e in check])
            measure(r, "bf16", lambda: torch._grouped_mm(a.t(), g, offs=offs), reps,
                    lambda out: {"rel_err_vs_fp32": rel(out[check], ref)})
            continue
        a_name = {"gate_up.fwd": "x", "gate_up.dgrad": "g_gu", "down.fwd": "h", "down.dgrad": "g_down"}[name]
        a_in, b_EKN = ops[a_name], w if kind == "fwd" else w.transpose(1, 2)
        ref = torch.cat([rows(a_in, e).float() @ b_EKN[e].float() for e in check])
        vs_fp32 = lambda out: {"rel_err_vs_fp32": rel(picked(out), ref)}
        measure(r, "bf16", lambda: torch._grouped_mm(a_in, b_EKN, offs=offs), reps, vs_fp32)
        (q_row, s_row), (q_blk, s_blk) = ops["row " + a_name], ops["1x128 " + a_name]
        wq, ws = wr[:2] if kind == "fwd" else wr[2:]
        measure(r, "rowwise", lambda: fp8.scaled_grouped_mm(q_row, s_row.squeeze(-1), wq, ws, offs, BF16), reps,
                vs_fp32)
        # the kernel's b [E, N, K] (K contiguous), scales [E, N/128, K/128]: the dgrad reads the transposed copy
        b_q, s_b = (q_ENK, sw.transpose(1, 2)) if kind == "fwd" else (q_EKN, sw)
        measure(r, "F.scaled_grouped_mm blockwise", lambda: F.scaled_grouped_mm(
            q_blk, b_q.transpose(1, 2), s_blk, S.BlockWise1x128, s_b.transpose(1, 2).contiguous(),
            S.BlockWise128x128, offs=offs, output_dtype=BF16), reps, vs_fp32)
        measure(r, "torch._scaled_grouped_mm blockwise", lambda: torch._scaled_grouped_mm(
            q_blk, b_q.transpose(1, 2), s_blk, s_b.transpose(1, 2).contiguous(), offs=offs, out_dtype=BF16), reps,
            vs_fp32)
        if not (a_in.is_cuda or interp):
            r["triton blockwise"] = {"error": "skipped: CPU without TRITON_INTERPRET=1"}
            continue
        times = {}
        for c in configs:
            measure(times, str(c), lambda: grouped_fp8_triton(q_blk, s_blk, b_q, s_b, offs, tiles, c), reps)
        best = min(configs, key=lambda c: times[str(c)].get("ms", float("inf")))
        deq = torch.cat([dequant(rows(q_blk, e), rows(s_blk, e)) @ dequant(b_q[e], s_b[e]).t() for e in check])
        measure(r, "triton blockwise", lambda: grouped_fp8_triton(q_blk, s_blk, b_q, s_b, offs, tiles, best), reps,
                lambda out: {**vs_fp32(out), "rel_err_vs_dequantised": rel(picked(out), deq),
                             "config (BM, BN, warps, stages)": list(best), "configs": times})
    return res


def dense_section(ops, reps) -> dict:
    """The six GEMMs as dense [M, K] x [K, N] (expert 0's weight): bf16, rowwise, cuBLAS blockwise."""
    res = {}
    for name in GEMMS:
        layer, kind = name.split(".")
        w0 = ops["w_" + layer][0]
        a, g = (ops["x"], ops["g_gu"]) if layer == "gate_up" else (ops["h"], ops["g_down"])
        a_MK, b_KN = {"fwd": (a, w0), "dgrad": (g, w0.t()), "wgrad": (a.t(), g)}[kind]
        fast, r = kind != "wgrad", {}  # moelab's accumulation: fast in fwd and dgrad, exact in the wgrad
        ref = a_MK[:1024].float() @ b_KN.float()
        vs_fp32 = lambda out: {"rel_err_vs_fp32": rel(out[:1024], ref)}
        res[name] = r
        measure(r, "bf16", lambda: a_MK @ b_KN, reps, vs_fp32)
        (aq, sa), (bq, sb) = fp8.quantize_rowwise(a_MK, -1), fp8.quantize_colmajor(b_KN, 0)
        measure(r, "rowwise", lambda: fp8.scaled_mm(aq, sa, bq, sb, BF16, fast), reps, vs_fp32)
        aq, sa = quantize_1x128(a_MK)
        if kind == "wgrad":  # both operands 1x128 along the tokens (DeepSeek-V3's wgrad)
            bq, sb = quantize_1x128(b_KN.t())
            b_args = (bq.t(), sb, "1x128")
        else:
            bq, _, sb = quantize_128x128(b_KN[None])
            b_args = (bq[0].t(), sb[0], "128x128")
        probe = {}

        def blockwise():
            if not probe:
                probe["fn"], probe["path"] = blockwise_mm(aq, sa, *b_args, fast)
            return probe["fn"]()
        measure(r, "blockwise", blockwise, reps, lambda out: {**vs_fp32(out), "path": probe["path"]})
        for v in ("rowwise", "blockwise"):
            if "ms" in r[v] and "ms" in r["bf16"]:
                r[v]["speedup_vs_bf16"] = r["bf16"]["ms"] / r[v]["ms"]
    return res


def quant_section(res: dict, ops, reps, compiled: bool, save) -> None:
    """Each quantisation pass alone (compiled on CUDA) into res, at the widths the recipes quantise; the passes
    an FP8 wgrad would add (1x128 along the tokens) last."""
    wrap = (lambda f: torch.compile(f, dynamic=False)) if compiled else (lambda f: f)
    row, blk = wrap(lambda t: fp8.quantize_rowwise(t, -1)), wrap(quantize_1x128)
    blk_tok = wrap(lambda t: quantize_1x128(t.t()))
    w_row, w_blk = wrap(fp8.quantize_expert_weight), wrap(quantize_128x128)
    w_t = wrap(lambda q: q.transpose(1, 2).contiguous())
    acts = (("x [M,D]", ops["x"]), ("g_gate_up [M,2F]", ops["g_gu"]), ("h [M,F]", ops["h"]))
    for key, t in acts:
        measure(res, f"rowwise {key}", lambda: row(t), reps)
        measure(res, f"1x128 {key}", lambda: blk(t), reps)
    save()
    for layer in ("gate_up", "down"):
        w = ops["w_" + layer]
        key, q = f"[{', '.join(map(str, w.shape))}]", quantize_128x128(w)[1]
        measure(res, f"rowwise weight {key} (both copies)", lambda: w_row(w), reps)
        measure(res, f"128x128 weight {key} (+ transposed e4m3 copy)", lambda: w_blk(w), reps)
        measure(res, f"transposed e4m3 copy alone {key}", lambda: w_t(q), reps)
    save()
    for key, t in acts:
        measure(res, f"1x128 along tokens {key}", lambda: blk_tok(t), reps)


def _ms(section: dict, *keys: str) -> float:
    r = section
    for k in keys:
        r = r.get(k, {})
    if "ms" not in r:
        raise KeyError(f"{' '.join(keys)}: {' '.join(str(r.get('error', 'not measured')).split())[:120]}")
    return r["ms"]


def projection(rec: dict) -> dict:
    """Per layer and micro batch, from this record's times: the expert GEMMs (fwd + dgrad + wgrad of both weights)
    plus the quantisation passes each recipe needs (activations every micro batch, weights once per step)."""
    q = rec.get("quant", {})
    acts = ["x [M,D]", "h [M,F]", "g_gate_up [M,2F]", "x [M,D]"]  # the 4th: g_down [M,D], timed as x (same shape)
    fp8_fwd_dgrad = lambda v: {g: "bf16" if "wgrad" in g else v for g in GEMMS}
    recipes = {  # name: (GEMM section, variant per GEMM, activation passes, weight passes' prefix)
        "bf16": ("grouped", fp8_fwd_dgrad("bf16"), [], None),
        "rowwise (moelab: fp8 fwd+dgrad, bf16 wgrad)": (
            "grouped", fp8_fwd_dgrad("rowwise"), ["rowwise " + a for a in acts], "rowwise weight"),
        "blockwise triton grouped (fp8 fwd+dgrad, bf16 wgrad)": (
            "grouped", fp8_fwd_dgrad("triton blockwise"), ["1x128 " + a for a in acts], "128x128 weight"),
        "blockwise ceiling (cuBLAS dense rates, fp8 wgrad too)": (
            "dense", {g: "blockwise" for g in GEMMS}, [p + a for p in ("1x128 ", "1x128 along tokens ") for a in acts],
            "128x128 weight")}
    out = {"layers": LAYERS, "micro_batches_per_step": MICRO_BATCHES,
           "note": "ms per layer and micro batch (x layers: per micro batch); weight passes / micro batches per step"}
    for split, grouped in rec.get("grouped", {}).items():
        o = out[split] = {}
        for name, (section, variants, act_keys, w_prefix) in recipes.items():
            src = grouped if section == "grouped" else rec.get("dense", {})
            w_keys = [k for k in q if w_prefix and k.startswith(w_prefix)]
            try:
                if w_prefix and len(w_keys) != 2:
                    raise KeyError(f"{w_prefix}: not measured for both weights")
                gemm = sum(_ms(src, g, variants[g]) for g in GEMMS)
                qa, qw = sum(_ms(q, k) for k in act_keys), sum(_ms(q, k) for k in w_keys) / MICRO_BATCHES
            except KeyError as e:  # not measured, or measured as an error
                o[name] = {"missing": e.args[0]}
                continue
            o[name] = {"gemm_ms": gemm, "quant_activation_ms": qa, "quant_weight_ms_amortised": qw,
                       "total_ms": gemm + qa + qw, "per_micro_batch_ms": LAYERS * (gemm + qa + qw)}
        base = o["bf16"].get("total_ms")
        for v in o.values():
            if base and "total_ms" in v:
                v["saving_vs_bf16_per_micro_batch_ms"] = LAYERS * (base - v["total_ms"])
                v["pays"] = v["total_ms"] < base
                v["pays_if_activation_quant_fused_into_producers"] = (
                    v["gemm_ms"] + v["quant_weight_ms_amortised"] < base)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true", help="CPU-sized shapes (checks the script)")
    args = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    E, M, D, Fw, reps = (4, 256, 384, 128, 1) if args.small else (128, 65536, 2048, 768, 10)
    # the Triton kernel's (BM, BN, warps, stages): the fastest per GEMM is kept (BK is the scale block, 128)
    configs = [(64, 128, 4, 2)] if args.small else [(128, 128, 8, 3), (128, 256, 8, 3), (64, 128, 4, 4)]
    rec = {"system": "moelab", "workload": "qwen3-moe-30b-a3b-proxy", "variant": "fp8-blockwise-trial",
           "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch_version": torch.__version__,
           "commit": commit_id(), "command": " ".join(["python"] + sys.argv),
           "shapes": {"experts": E, "routed_rows": M, "hidden": D, "expert_ffn": Fw, "reps": reps},
           "torch_api": {"cuda": torch.version.cuda, "triton": triton.__version__,
                         "capability": list(torch.cuda.get_device_capability()) if dev == "cuda" else None,
                         "F.scaled_grouped_mm": hasattr(F, "scaled_grouped_mm"),
                         "ScalingType": list(F.ScalingType.__members__) if hasattr(F, "ScalingType") else None}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(section):  # the projection follows every section (a timeout keeps it, from what was measured)
        print(section, json.dumps(rec.get(section), indent=1), flush=True)
        rec["projection"] = projection(rec)
        (out / "fp8-blockwise-trial.json").write_text(json.dumps(rec, indent=1) + "\n")

    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=g, device=dev)).to(BF16)
    ops = {"x": mk(M, D), "h": mk(M, Fw), "g_gu": mk(M, 2 * Fw, scale=1e-3), "g_down": mk(M, D, scale=1e-3),
           "w_gate_up": mk(E, D, 2 * Fw, scale=0.02), "w_down": mk(E, Fw, D, scale=0.02)}
    for k in ("x", "h", "g_gu", "g_down"):  # the fwd / dgrad GEMMs' first operands, quantised once (not timed)
        ops["row " + k], ops["1x128 " + k] = fp8.quantize_rowwise(ops[k]), quantize_1x128(ops[k])
    w_q = {layer: (fp8.quantize_expert_weight(ops["w_" + layer]), *quantize_128x128(ops["w_" + layer]))
           for layer in ("gate_up", "down")}  # rowwise (4 operands), blockwise [E, N, K], [E, K, N], scales
    rec["grouped"] = {}
    for name, counts in splits(M, E, dev).items():
        rec["grouped"][name] = grouped_section(ops, counts, w_q, reps, configs, interp)
        save("grouped")
    rec["dense"] = dense_section(ops, reps)
    save("dense")
    rec["quant"] = {}
    quant_section(rec["quant"], ops, reps, compiled=dev == "cuda", save=lambda: save("quant"))
    save("projection")
    for split, o in ((k, v) for k, v in rec["projection"].items() if isinstance(v, dict)):
        for name, v in o.items():  # the lines gpu_perf.sh's part shows ("^fp8 ")
            print(f"fp8 blockwise {split:5s} {name}: " + (f"{v['per_micro_batch_ms']:.2f} ms per micro batch, "
                  f"saving vs bf16 {v.get('saving_vs_bf16_per_micro_batch_ms', 0):.2f} ms" if "total_ms" in v
                  else v["missing"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
