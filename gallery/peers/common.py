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

from moelab.bench import commit_id
from moelab.config import load_config
from moelab.planner.flops import FLOPS_CONVENTION, flops_per_token, peak_tflops


def parser(desc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=desc)
    ap.add_argument("--preset", default="qwen3-moe-30b-a3b-proxy", help="the moelab preset whose shapes to build")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", help="write the result record here")
    return ap


def model_config(args):
    return load_config(args.preset, [f"train.seq_len={args.seq}"]).model


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


def result(system: str, variant: str, args, times_ms: list[float], extra: dict | None = None) -> dict:
    m = model_config(args)
    step_ms = statistics.median(times_ms)
    tps = args.global_batch * args.seq / (step_ms / 1e3)
    fpt = flops_per_token(m, args.seq)
    name = torch.cuda.get_device_name()
    peak = peak_tflops(name, "bfloat16")
    r = {"system": system, "variant": variant, "workload": args.preset, "gpus": 1, "gpu_name": name,
         "tokens_per_s_per_gpu": tps, "tflops_per_gpu": fpt * tps / 1e12, "mfu": fpt * tps / 1e12 / peak,
         "peak_tflops": peak, "step_time_ms": step_ms, "step_times_ms": [round(t, 3) for t in times_ms],
         "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30, "flops_per_token": fpt,
         "flops_convention": FLOPS_CONVENTION, "global_batch_size": args.global_batch,
         "micro_batch_size": args.micro_batch, "seq_len": args.seq, "steps": args.steps, "warmup": args.warmup,
         "dtype": "bfloat16", "param_dtype": "bfloat16", "router": "learned",
         "command": " ".join(["python"] + sys.argv), "commit": commit_id(), "torch_version": torch.__version__,
         "python": platform.python_version(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    r.update(extra or {})
    print(f"{system} [{variant}]: {tps:,.0f} tokens/s, {r['tflops_per_gpu']:.1f} TFLOPs, step {step_ms:.1f} ms, "
          f"peak {r['peak_memory_gb']:.1f} GiB", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(r, indent=1) + "\n")
    return r


def random_batches(args, vocab: int):
    """A fixed pool of uniform random token batches (generated on the GPU once, outside the timed region)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randint(vocab, (args.micro_batch, args.seq + 1), device="cuda", generator=g) for _ in range(4)]
