"""What every peer benchmark shares with moelab's: the workload's shapes, the FLOPs convention, step timing and
the result record. Peers train bf16 parameters with fused AdamW in a plain loop (micro batches accumulated, one
optimizer step per global batch), uniform random tokens, the learned router; timing = median of CUDA-event step
times after warm-up; FLOPs by moelab.planner.flops (the same convention as moelab's own results)."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from moelab.train.bench import commit_id
from moelab.config import load_config
from moelab.planner.flops import FLOPS_CONVENTION, flops_per_token, peak_tflops


def parser(desc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=desc)
    ap.add_argument("--preset", default="qwen3-moe-30b-a3b-proxy", help="the moelab preset whose shapes to build")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--global-batch", default="2",
                    help="global batch size, or several comma-separated (one model, one record each: 2,16)")
    ap.add_argument("--compile", action="store_true", help="torch.compile as the system's own trainer does")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", help="write the result record here ({gbs} is replaced by the global batch)")
    return ap


def model_config(args):
    return load_config(args.preset, [f"train.seq_len={args.seq}"]).model


def global_batches(args) -> list[int]:
    return [int(g) for g in str(args.global_batch).split(",")]


def run_batches(args, make_step, record) -> None:
    """For each global batch size: time make_step(micro_per_step) and write its record via record(gbs, times).
    A failing size (out of memory) is recorded as an error and the next size still runs."""
    for gbs in global_batches(args):
        reset_peak()
        try:
            times = time_training(make_step(gbs // args.micro_batch), args.steps, args.warmup)
        except Exception as e:  # noqa: BLE001 (the next size still runs, the error is recorded)
            import traceback

            traceback.print_exc()
            record(gbs, None, error=f"{type(e).__name__}: {str(e)[:500]}")
            torch.cuda.empty_cache()
            continue
        record(gbs, times)


def time_training(step_fn, steps: int, warmup: int) -> list[float]:
    """step_fn(i) runs one optimizer step; returns per-step milliseconds (CUDA events) of the timed steps."""
    for i in range(warmup):
        step_fn(i)
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    ev[0].record()
    for i in range(steps):
        step_fn(warmup + i)
        ev[i + 1].record()
    torch.cuda.synchronize()
    return [ev[i].elapsed_time(ev[i + 1]) for i in range(steps)]


def reset_peak() -> None:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()


def result(system: str, variant: str, args, times_ms: "list[float] | None", extra: dict | None = None,
           gbs: int | None = None, error: str | None = None) -> dict:
    """One result record (tokens/s, TFLOPs by moelab.planner.flops, peak memory, provenance); times_ms None = error."""
    m = model_config(args)
    gbs = gbs if gbs is not None else global_batches(args)[0]
    step_ms = statistics.median(times_ms) if times_ms else float("nan")
    tps = gbs * args.seq / (step_ms / 1e3)
    fpt = flops_per_token(m, args.seq)
    name = torch.cuda.get_device_name()
    peak = peak_tflops(name, "bfloat16")
    r = {"system": system, "variant": variant, "workload": args.preset, "gpus": 1, "gpu_name": name,
         "tokens_per_s_per_gpu": tps, "tflops_per_gpu": fpt * tps / 1e12, "mfu": fpt * tps / 1e12 / peak,
         "peak_tflops": peak, "step_time_ms": step_ms, "step_times_ms": [round(t, 3) for t in times_ms or []],
         "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30, "flops_per_token": fpt,
         "flops_convention": FLOPS_CONVENTION, "global_batch_size": gbs,
         "micro_batch_size": args.micro_batch, "seq_len": args.seq, "steps": args.steps, "warmup": args.warmup,
         "dtype": "bfloat16", "param_dtype": "bfloat16", "router": "learned", "compile": args.compile,
         "fp8": "off",
         "command": " ".join(["python"] + sys.argv), "commit": commit_id(), "torch_version": torch.__version__,
         "python": platform.python_version(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    r.update(extra or {})
    if error:
        r["error"] = error
        print(f"{system} [{variant}] global batch {gbs}: ERROR {error}", flush=True)
    else:
        print(f"{system} [{variant}] global batch {gbs}: {tps:,.0f} tokens/s, {r['tflops_per_gpu']:.1f} TFLOPs, "
              f"step {step_ms:.1f} ms, peak {r['peak_memory_gb']:.1f} GiB", flush=True)
    if args.json:
        path = Path(args.json.replace("{gbs}", str(gbs)))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r, indent=1) + "\n")
    return r


def random_batches(args, vocab: int):
    """A fixed pool of uniform random token batches (generated on the GPU once, outside the timed region)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randint(vocab, (args.micro_batch, args.seq + 1), device="cuda", generator=g) for _ in range(4)]
