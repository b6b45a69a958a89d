"""Issue 41: the optimizer's update beside the forward's matmuls on a few SMs (moelab.train.overlap.SPLIT_SMS), piece
by piece, on one GPU (about 40 s):

1. TritonAdamW's kernel over one block's expert weights of the Qwen3-30B-A3B proxy (603 M bf16 elements) on the full
   grid against narrow launches of N programs (adamw_update's `programs`): ms, TB/s, values bitwise equal.
2. The LM head's GEMM (8,192 x 2,048 @ 2,048 x 151,936, bf16, cuBLAS) alone with torch's SM carveout off and N: does
   cuBLAS honour it (time about 132 / (132 - N) of the full GPU's)?
3. Side by side: R head GEMMs on the main stream, U updates on a side stream, both queued after one event; the span
   against each alone and against their sum: the narrow update with the carveout (what SPLIT_SMS does), the narrow
   update without it (the GEMMs' CTAs then wait for the update's SMs), the full-grid update (today's overlap).

    python gallery/scripts/gpu_check_split.py --out DIR      # DIR/split-check.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from moelab.train.adamw_triton import adamw_update
from moelab.train.bench import commit_id

HYPER = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
PROGRAMS = (8, 16, 24, 32, 48, 66)
SPLITS = (16, 24, 32)


def span_ms(main_work, side_work=None, reps: int = 5) -> float:
    """Median span over `reps` of main_work on the current stream and side_work on a side stream, both queued
    after one event, the end when both are done (CUDA events)."""
    side = torch.cuda.Stream()
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if side_work is not None:
            side.wait_event(start)
            with torch.cuda.stream(side):
                side_work()
        if main_work is not None:
            main_work()
        if side_work is not None:
            torch.cuda.current_stream().wait_stream(side)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def with_carveout(sms, work):
    def run():
        torch._C._set_sm_carveout_experimental(sms)
        try:
            work()
        finally:
            torch._C._set_sm_carveout_experimental(None)
    return run


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--gemms", type=int, default=4, help="head GEMMs on the main stream (R)")
    ap.add_argument("--updates", type=int, default=6, help="updates of the block's expert weights on the side (U)")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = []
    for shape in ((128, 2048, 1536), (128, 768, 2048)):  # one block's gate|up and down weights
        p, g = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        m = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) * 1e-3
        v = torch.rand(shape, generator=gen, device="cuda", dtype=torch.bfloat16) * 1e-6
        tensors.append((p, g, m, v))
    step = torch.tensor(10.0, device="cuda")
    moved = sum(7 * t[0].numel() * 2 for t in tensors)

    def update(programs=0):
        def run():
            for p, g, m, v in tensors:
                adamw_update(p, g, m, v, step, **HYPER, programs=programs)
        return run

    start = [[t.clone() for t in ts] for ts in tensors]

    def values_after(programs):
        for ts, ss in zip(tensors, start):
            for t, s in zip(ts, ss):
                t.copy_(s)
        update(programs)()
        return [t.clone() for ts in tensors for t in (ts[0], ts[2], ts[3])]

    want = values_after(0)
    kernel = {}
    for programs in (0,) + PROGRAMS:
        same = all(torch.equal(a, b) for a, b in zip(values_after(programs), want))
        ms = span_ms(update(programs))
        kernel[str(programs) if programs else "full"] = {"ms": round(ms, 4), "tb_s": round(moved / ms / 1e9, 3),
                                                          "bitwise_equal": same}
        print(f"update, programs {programs or 'full'}: {ms:.3f} ms, {moved / ms / 1e9:.2f} TB/s, bitwise {same}",
              flush=True)

    x = torch.randn(8192, 2048, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(151936, 2048, generator=gen, device="cuda", dtype=torch.bfloat16)

    def gemms():
        for _ in range(args.gemms):
            torch.mm(x, w.T)

    def updates(programs):
        def run():
            for _ in range(args.updates):
                update(programs)()
        return run

    base = torch.mm(x, w.T)
    gemm = {"off": round(span_ms(gemms) / args.gemms, 4)}
    close = {}
    for sms in SPLITS:
        gemm[str(sms)] = round(span_ms(with_carveout(sms, gemms)) / args.gemms, 4)
        torch._C._set_sm_carveout_experimental(sms)
        close[str(sms)] = float((torch.mm(x, w.T).float() - base.float()).abs().max())
        torch._C._set_sm_carveout_experimental(None)
    print(f"head GEMM ms by carveout: {gemm}; max difference to no carveout {close}", flush=True)

    side = {}
    g_alone = span_ms(gemms)
    u_full = span_ms(updates(0))
    side["full-grid update, no carveout (today's overlap)"] = {
        "span_ms": round(span_ms(gemms, updates(0)), 3), "gemms_alone_ms": round(g_alone, 3),
        "updates_alone_ms": round(u_full, 3)}
    for sms in SPLITS:
        g_carved = span_ms(with_carveout(sms, gemms))
        u_narrow = span_ms(updates(sms))
        side[f"narrow update on {sms}, carveout {sms}"] = {
            "span_ms": round(span_ms(with_carveout(sms, gemms), updates(sms)), 3),
            "gemms_alone_ms": round(g_carved, 3), "updates_alone_ms": round(u_narrow, 3)}
        side[f"narrow update on {sms}, no carveout"] = {"span_ms": round(span_ms(gemms, updates(sms)), 3)}
    serial = g_alone + u_full
    for k, r in side.items():
        r["against_one_after_the_other"] = round(r["span_ms"] / serial, 3)
        print(f"{k}: {r}", flush=True)
    ok = all(r["bitwise_equal"] for r in kernel.values())
    rec = {"system": "moelab", "workload": "qwen3-moe-30b-a3b-proxy", "variant": "split-check",
           "gpu_name": torch.cuda.get_device_name(), "torch_version": torch.__version__, "commit": commit_id(),
           "command": " ".join(["python"] + sys.argv), "elements": sum(t[0].numel() for t in tensors),
           "bytes_moved": moved, "sms": torch.cuda.get_device_properties(0).multi_processor_count,
           "update_by_programs": kernel, "head_gemm_ms_by_carveout": gemm,
           "head_gemm_max_abs_difference_by_carveout": close, "gemms": args.gemms, "updates": args.updates,
           "one_after_the_other_ms": round(serial, 3), "side_by_side": side, "ok": ok}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "split-check.json").write_text(json.dumps(rec, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
