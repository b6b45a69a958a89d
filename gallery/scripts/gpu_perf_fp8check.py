"""FP8 kernels against their emulation, on the GPU, at the Qwen3-30B-A3B proxy's shapes (first part of
gallery/scripts/gpu_perf.sh): moelab.model.fp8's dense and grouped FP8 GEMMs (forward and both gradients) on
torch._scaled_mm / torch._scaled_grouped_mm, against the same quantised operands dequantised and multiplied in
fp32 (moelab.model.fp8.EMULATE), and against the bf16 GEMM; the same compiled; then forward+backward times of
FP8 and bf16 (CUDA events, median of 10 after warm-up); the expert weight cache's tiled kernel (both operands) against
inductor's passes (bytes and ms); the Triton AdamW against torch's.

    python gallery/scripts/gpu_perf_fp8check.py --out DIR [--small]   # --small: CPU-sized shapes (dry run)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch

from moelab.train.bench import StepTimer, commit_id
from moelab.model import fp8
from moelab.model.experts import grouped_mm_swiglu, loop_swiglu, swiglu


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def with_grads(fn, *inputs):
    """fn(*inputs) and the gradients of <out, g> for a fixed random g (fresh leaf copies of the inputs)."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    g = torch.randn(out.shape, generator=torch.Generator(out.device).manual_seed(1), device=out.device,
                    dtype=out.dtype)
    out.backward(g)
    return [out.detach()] + [t.grad for t in leaves if t.requires_grad]


def emulated(fn, *inputs):
    fp8.EMULATE = True
    try:
        return with_grads(fn, *inputs)
    finally:
        fp8.EMULATE = False


def time_ms(fn, *inputs, reps: int = 10) -> float:
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    for _ in range(3):
        fn(*leaves).sum().backward()
    if not leaves[0].is_cuda:
        return float("nan")
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    torch.cuda.synchronize()
    ev[0].record()
    for i in range(reps):
        fn(*leaves).sum().backward()
        ev[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(reps))


def adamw_check(res: dict, save) -> None:
    """moelab.train.adamw_triton against torch's fused AdamW: 3 steps on 256 M bf16 parameters (random
    gradients), the largest difference in parameters, and the time of one step of each (3.6 GB moved)."""
    try:
        from moelab.train.adamw_triton import TritonAdamW

        g = torch.Generator(device="cuda").manual_seed(5)
        p0 = torch.randn(256 * 2**20, device="cuda", dtype=torch.bfloat16, generator=g)
        grads = [torch.randn(p0.shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
        out, times = {}, {}
        for name, cls in (("torch fused", torch.optim.AdamW), ("triton", TritonAdamW)):
            p = torch.nn.Parameter(p0.clone())
            opt = cls([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
            for gr in grads:
                p.grad = gr
                opt.step()
            out[name] = p.detach().float()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
            for _ in range(10):
                opt.step()
            ev[1].record()
            torch.cuda.synchronize()
            times[name] = ev[0].elapsed_time(ev[1]) / 10
        a, b = out["triton"], out["torch fused"]
        res["adamw"] = {"max_abs_diff": float((a - b).abs().max()), "rel_norm_diff": rel(a, b),
                        "step_ms": times, "bytes_per_step": 14 * p0.numel(),
                        "tb_per_s": {k: 14 * p0.numel() / (v / 1e3) / 1e12 for k, v in times.items()}}
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        res["adamw"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print(f"adamw check: {json.dumps(res['adamw'])}", flush=True)
    save()


def cuda_ms(fn, reps: int = 10) -> float:
    """Mean ms of fn() over reps calls (moelab.train.bench.StepTimer's CUDA events), after 3 warm-up calls."""
    for _ in range(3):
        fn()
    return statistics.fmean(StepTimer("cuda").time(lambda i: fn(), reps))


def _copy_operands(w, buffers):  # the weight cache's refresh before moelab.model.fp8_kernel (compiled below)
    for buf, t in zip(buffers, fp8.quantize_expert_weight(w)):
        buf.copy_(t)


def weight_cache_check(res: dict, save, weights: dict) -> None:
    """The expert weight cache's two operands by moelab.model.fp8_kernel's tiled kernel against inductor's
    passes (the cache's refresh before it, compiled) and CUDA's eager cast: differing bytes (with examples), ms
    each; and one ExpertWeightCache refresh of a layer's two weights, as the trainer runs it."""
    from moelab.model.fp8_cache import ExpertWeightCache
    from moelab.model.fp8_kernel import quantize_weight_kernel

    out = res["weight_cache"] = {}
    try:
        inductor = torch.compile(_copy_operands, dynamic=False)
        for name, w in weights.items():
            bufs = fp8.quantize_expert_weight(w)
            ref = [t.clone() for t in bufs]
            inductor(w, ref)
            eager = fp8.quantize_expert_weight(w)  # CUDA's eager cast (round to nearest even), no inductor
            got = (*quantize_weight_kernel(w, -2), *quantize_weight_kernel(w, -1))
            row = out[name] = {"elements": w.numel()}
            for i, operand in ((0, "forward"), (2, "dgrad")):
                differ = got[i].view(torch.uint8) != ref[i].view(torch.uint8)
                idx = differ.nonzero()[:4].unbind(-1)
                row[f"{operand} differing bytes (kernel vs inductor, kernel vs eager, inductor vs eager)"] = [
                    int(differ.sum()), int((got[i].view(torch.uint8) != eager[i].view(torch.uint8)).sum()),
                    int((ref[i].view(torch.uint8) != eager[i].view(torch.uint8)).sum())]
                row[f"{operand} differing scales"] = int((got[i + 1] != ref[i + 1]).sum())
                row[f"{operand} examples (kernel, inductor)"] = [
                    [float(a), float(b)] for a, b in zip(got[i][idx].float().tolist(), ref[i][idx].float().tolist())]
            row["both operands ms, inductor"] = cuda_ms(lambda: inductor(w, bufs))
            for dim, operand in ((-2, "forward"), (-1, "dgrad")):
                o = bufs[:2] if dim == -2 else bufs[2:]
                row[f"{operand} operand ms, tiled kernel"] = cuda_ms(lambda: quantize_weight_kernel(w, dim, out=o))
        holder = torch.nn.Module()
        holder.w_gate_up_EDF2, holder.w_down_EFD = (torch.nn.Parameter(w) for w in weights.values())
        cache = ExpertWeightCache(holder)
        cache.refresh(torch.bfloat16)
        out["ExpertWeightCache.refresh ms (one layer, both weights)"] = cuda_ms(lambda: cache.refresh(torch.bfloat16))
        out["cache error"] = ExpertWeightCache.error
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(f"weight cache check: {json.dumps(out)}", flush=True)
    save()


_COMPILED: dict = {}


def compiled(fn):
    """One torch.compile wrapper per function: the check and the timing share its graphs (compile time counts
    against the call)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn)
    return _COMPILED[fn]


def show(times: dict, key: str) -> None:
    v = times[key]
    print(f"fp8 time  {key}: {v if isinstance(v, str) else f'{v:.3f} ms'}", flush=True)


def counts_skewed(rows: int, experts: int, gen) -> torch.Tensor:
    """Dirichlet(2)-skewed rows per expert summing to `rows`, with two empty experts."""
    p = torch.distributions.Dirichlet(torch.full((experts,), 2.0)).sample()
    p[[3, 7]] = 0
    c = (p / p.sum() * rows).floor().long()
    c[0] += rows - int(c.sum())
    return c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    torch.manual_seed(0)
    M, D, Hq, E, F, topk = (8192, 2048, 4096, 128, 768, 8) if not args.small else (256, 64, 128, 8, 32, 2)
    res = {"system": "moelab", "workload": "qwen3-moe-30b-a3b-proxy", "variant": "fp8-kernel-check",
           "commit": commit_id(), "command": " ".join(["python"] + sys.argv), "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch_version": torch.__version__,
           "shapes": {"tokens": M, "hidden": D, "q_proj_out": Hq, "experts": E, "expert_ffn": F, "top_k": topk}}
    x = torch.randn(M, D, device=dev, dtype=dt)
    w = torch.randn(Hq, D, device=dev, dtype=dt) * 0.02
    N = M * topk
    xr = torch.randn(N, D, device=dev, dtype=dt)
    w1 = torch.randn(E, D, 2 * F, device=dev, dtype=dt) * 0.02
    w2 = torch.randn(E, F, D, device=dev, dtype=dt) * 0.02
    counts = counts_skewed(N, E, None).to(dev)
    dense = lambda a, b: fp8.fp8_linear(a, b)  # noqa: E731
    dense_bf16 = lambda a, b: a @ b.t()  # noqa: E731
    grouped = lambda a, b, c: fp8.fp8_grouped_swiglu(a, b, c, counts, swiglu)  # noqa: E731
    grouped_bf16 = lambda a, b, c: grouped_mm_swiglu(a, b, c, counts)  # noqa: E731
    grouped_ref = lambda a, b, c: loop_swiglu(a, b, c, counts)  # noqa: E731 (float inputs: the reference)
    Path(args.out).mkdir(parents=True, exist_ok=True)

    def save():  # after every item: a timeout must not lose what was measured
        (Path(args.out) / "fp8-check.json").write_text(json.dumps(res, indent=1) + "\n")

    checks = res["checks"] = {}
    times = res["fwd_bwd_ms"] = {}
    for name, fn, ref, inputs in (("dense q_proj", dense, dense_bf16, (x, w)),
                                  ("experts swiglu", grouped, grouped_ref, (xr, w1, w2))):
        try:
            got = with_grads(fn, *inputs)
            emu = emulated(fn, *inputs)
            hi = with_grads(lambda *t: ref(*[u.float() for u in t]), *inputs)
            checks[name] = {"vs_emulation": [rel(a, b) for a, b in zip(got, emu)],
                            "vs_float": [rel(a, b) for a, b in zip(got, hi)],
                            "finite": all(bool(torch.isfinite(t).all()) for t in got)}
            if dev == "cuda":
                comp = with_grads(compiled(fn), *inputs)
                checks[name]["compiled_vs_eager"] = [rel(a, b) for a, b in zip(comp, got)]
        except Exception as e:  # noqa: BLE001 (report and go on)
            traceback.print_exc()
            checks[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(f"fp8 check {name}: {json.dumps(checks[name])}", flush=True)
        save()
    if dev == "cuda":
        for name, fn, inputs in (("dense fp8", dense, (x, w)), ("dense bf16", dense_bf16, (x, w)),
                                 ("experts fp8", grouped, (xr, w1, w2)),
                                 ("experts bf16", grouped_bf16, (xr, w1, w2))):
            for mode in ("eager", "compiled"):
                try:
                    times[f"{name} {mode}"] = time_ms(fn if mode == "eager" else compiled(fn), *inputs)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    times[f"{name} {mode}"] = f"{type(e).__name__}: {str(e)[:200]}"
                show(times, f"{name} {mode}")
                save()
        # the LM head's shape (left bf16 by train.fp8: is FP8 worth it there?) and the weight quantisation alone
        wl = torch.randn(151936, D, device=dev, dtype=dt) * 0.02
        for name, fn in (("lm_head fp8", dense), ("lm_head bf16", dense_bf16)):
            try:
                times[f"{name} compiled"] = time_ms(compiled(fn), x, wl)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                times[f"{name} compiled"] = f"{type(e).__name__}: {str(e)[:200]}"
            show(times, f"{name} compiled")
            save()
        del wl
        try:
            q = torch.compile(lambda w: fp8.quantize_rowwise(w.transpose(-2, -1).contiguous(), -1))
            for _ in range(3):
                q(w1)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
            for _ in range(10):
                q(w1)
            ev[1].record()
            torch.cuda.synchronize()
            key = "quantise one gate_up weight [E, D, 2F] (compiled), forward only"
            times[key] = ev[0].elapsed_time(ev[1]) / 10
            show(times, key)
            save()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        weight_cache_check(res, save, {"w_gate_up [E, D, 2F]": w1, "w_down [E, F, D]": w2})
        adamw_check(res, save)
    save()
    bad = [k for k, v in checks.items() if "error" in v or not v["finite"] or max(v["vs_emulation"]) > 2e-2]
    if bad:
        print(f"fp8 check FAILED: {bad}")
        sys.exit(1)


if __name__ == "__main__":
    main()
