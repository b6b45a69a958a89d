"""Issue 41: a gallery entry's bench (its own config, e.g. deepseek-v3-proxy-1gpu at its preset's train.grad_clip
1.0) with gradient clipping's multiply in TritonAdamW's update (today's code), then as its own pass over the
gradients (the trainer's path for an optimizer without clip_in_step, as before fb2903b), in one process. The second
arm's allocator peak includes the first arm's model, still held: it is recorded as peak_memory_gb_with_first_arm,
and its peak_memory_gb left empty.

    python gallery/scripts/gpu_clip_entry.py --entry deepseek-v3-proxy-1gpu --out DIR   # <entry>--moelab--clip-*.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from moelab.gallery.entries import get_entry
from moelab.train import adamw_triton
from moelab.train.bench import bench


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--entry", default="deepseek-v3-proxy-1gpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--label", default="", help="appended to each record's variant, e.g. -h100-issue41-call42")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    entry = get_entry(args.entry)
    cfg = entry.config()
    print("grad_clip", cfg.train.grad_clip, "experts", cfg.backend.experts, flush=True)
    for tag in ("clip-update", "clip-pass"):
        if tag == "clip-pass":
            adamw_triton.TritonAdamW.clip_in_step = None  # the trainer then multiplies the gradients itself
        cmd = " ".join(["python"] + sys.argv) + f"  # the {tag} arm"
        try:
            r = dict(bench(cfg, steps=args.steps, warmup=args.warmup, command=cmd))
        except Exception as e:  # noqa: BLE001 (the other arm still runs)
            print(tag, "ERROR", type(e).__name__, str(e)[:400], flush=True)
            continue
        r.update(system="moelab", workload=entry.name, preset=entry.preset, variant=tag + args.label,
                 grad_clip=cfg.train.grad_clip, clip_in_update=tag == "clip-update",
                 commit=os.environ.get("MOELAB_COMMIT", r.get("commit")))
        if tag == "clip-pass":  # its allocator peak holds the first arm's model too: not this arm's own
            r.update(peak_memory_gb_with_first_arm=r.get("peak_memory_gb"), peak_memory_gb=None,
                     peak_memory_note="the second arm in one process: the allocator's peak held the first arm's "
                                      "model too, not this arm's alone")
        (out / f"{entry.name}--moelab--{tag}.json").write_text(json.dumps(r, indent=1) + "\n")
        print(tag, r.get("step_time_ms"), r.get("tokens_per_s_per_gpu"), r.get("peak_memory_gb"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
