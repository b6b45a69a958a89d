"""Where a multi-GPU step's time goes: one training step under torch.profiler on every rank (after warm-up), and
rank 0's kernels by GPU time, with the NCCL kernels' share and the GPU's idle time beside the step time.

    torchrun --standalone --nproc-per-node 2 gallery/scripts/profile_layout.py OUT.txt PRESET [--set KEY=VALUE ...]

On one stream, NCCL kernels run in line with compute, so their time (and the idle time waiting for the host or
the other rank) is what overlapping communication could hide.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from moelab.train.bench import Bencher, bench_config, commit_id
from moelab.config import load_config
from moelab.train.trainer import Trainer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("config")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    cfg = bench_config(load_config(args.config, args.overrides), steps=2, warmup=args.warmup)
    with tempfile.TemporaryDirectory(prefix="moelab-profile-") as run_dir:
        tr = Trainer(cfg, run_dir)
        tr.setup()
        b = Bencher(tr)
        step_ms = b.measure(1, args.warmup)["step_time_ms"]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ms = b.run(1)[0]
        tr.env.shutdown()
    if int(os.environ.get("RANK", "0")):
        return
    ka = prof.key_averages()
    key = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
    # GPU-side annotations (nccl:*, record_param_comms, Optimizer.step#..., Command Buffer Full) are CUDA events
    # too; counting them beside the kernels they enclose would count that time twice
    annotation = ("nccl:", "record_param_comms", "Optimizer.", "Command Buffer Full", "aten::", "ProfilerStep")
    kernels = [e for e in ka if e.device_type.name == "CUDA" and not e.key.startswith(annotation)]
    busy = sum(getattr(e, key) for e in kernels) / 1e3
    nccl = sum(getattr(e, key) for e in kernels if e.key.startswith("ncclDevKernel")) / 1e3
    head = (f"profile {args.config} {' '.join(args.overrides)}: step {step_ms:.1f} ms timed, {ms:.1f} ms under the "
            f"profiler; GPU kernels {busy:.1f} ms of which NCCL {nccl:.1f} ms; GPU idle {ms - busy:.1f} ms "
            f"(rank 0 of {tr.env.world_size}, {tr.gpu_name}, torch {torch.__version__}, commit {commit_id()})\n"
            f"command: torchrun --standalone --nproc-per-node {tr.env.world_size} gallery/scripts/profile_layout.py "
            f"OUT {args.config} " + " ".join(f"--set {o}" for o in args.overrides))
    table = ka.table(sort_by=key, row_limit=30, max_name_column_width=70)
    Path(args.out).write_text(head + "\n" + table)
    print(head)
    print("\n".join(table.splitlines()[:20]))


if __name__ == "__main__":
    main()
