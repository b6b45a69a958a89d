"""The routed experts' grouped GEMMs at the reference table's shapes, bf16 and moelab's rowwise FP8, against the
Qwen3 proxy's (where moelab.planner.rates took its grouped rates from a profile): how the rate moves with the
GEMM's shape (issue 39: re-derive the FP8 term at large GEMM shapes from measurements).

    python gallery/scripts/gpu_gemm_shapes.py --out /tmp/gemm.json          # on a GPU (sm90 for FP8)
    python gallery/scripts/gpu_gemm_shapes.py --out /tmp/gemm.json --small  # CPU dry run at tiny shapes

Each shape: one EP rank's routed rows of one micro batch (tokens x top_k, balanced over its local experts),
hidden D, expert width F; the forward GEMMs gate|up [rows, D] x [E, D, 2F] and down [rows, F] x [E, F, D], timed
by moelab.train.bench.StepTimer (median of 20 after 5 warm-up calls); FP8: moelab.model.fp8's rowwise e4m3
(activation quantised per row in the timed call, weights pre-quantised as the weight cache holds them).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moelab.model import fp8  # noqa: E402

# name: (rows per EP rank = tokens per micro batch x top_k, local experts, hidden D, expert width F)
SHAPES = {
    "qwen3-moe-30b-a3b-proxy": (8192 * 8, 128, 2048, 768),
    "qwen3-moe-30b-a3b-8gpu": (16384 * 8, 16, 2048, 768),
    "deepseek-v3": (4096 * 8, 4, 7168, 2048),
    "kimi-k2": (4096 * 8, 12, 7168, 2048),
    "gpt-oss-120b-64gpu": (8192 * 4, 2, 2880, 2880),
    "gpt-oss-20b-8gpu": (8192 * 4, 4, 2880, 2880),
}


def median_ms(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            import time
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def one_shape(rows: int, E: int, D: int, F: int, reps: int, with_fp8: bool) -> dict:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    bf = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * (rows // E)
    out = {"rows": rows, "experts": E, "hidden": D, "expert_ffn": F}
    for name, K, N in (("gate_up", D, 2 * F), ("down", F, D)):
        x = torch.randn(rows, K, device=dev, dtype=bf, generator=g)
        w = torch.randn(E, K, N, device=dev, dtype=bf, generator=g) * 0.02
        flop = 2 * rows * K * N
        ms = median_ms(lambda: torch._grouped_mm(x, w, offs=offs), reps)
        out[f"{name}_bf16_ms"], out[f"{name}_bf16_tflops"] = ms, flop / ms / 1e9
        if with_fp8:
            wq, ws = fp8.forward_operand(w)

            def run():
                q, s = fp8.quantize_rowwise(x)
                return fp8.scaled_grouped_mm(q, s.squeeze(-1), wq, ws, offs, bf)
            ms = median_ms(run, reps)
            out[f"{name}_fp8_ms"], out[f"{name}_fp8_tflops"] = ms, flop / ms / 1e9
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU dry run)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    with_fp8 = cuda and torch.cuda.get_device_capability() >= (9, 0)
    res = {"system": "moelab", "workload": "grouped-gemm-shapes", "torch_version": torch.__version__,
           "device": torch.cuda.get_device_name() if cuda else "cpu", "command": " ".join(sys.argv), "shapes": {}}
    for name, (rows, E, D, F) in SHAPES.items():
        if args.small:
            rows, E, D, F = 64, min(E, 4), 32, 16
        res["shapes"][name] = one_shape(rows, E, D, F, 3 if args.small else 20, with_fp8)
        print(name, json.dumps(res["shapes"][name]), flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
