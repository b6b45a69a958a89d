"""Issue 41: TritonAdamW's kernel (moelab.train.adamw_triton) over the Qwen3-30B-A3B proxy's parameters (bf16
weights, gradients and moments, every parameter of at least MIN_NUMEL elements: 5.6 B), its block and warps swept,
the module's default marked: each setting's update of one expert weight bitwise equal to the default's (the update
is per element), and the whole update's median time over --reps CUDA-event calls, in TB/s of the bytes it moves
(p, g, m, v read; p, m, v written).

    python gallery/scripts/gpu_check_adamw.py --out DIR      # DIR/adamw-check.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from moelab.config import load_config
from moelab.model.assemble import assemble
from moelab.train import adamw_triton
from moelab.train.adamw_triton import adamw_update
from moelab.train.bench import commit_id, median_ms

CONFIGS = ((4096, 8), (512, 4), (1024, 2), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (8192, 16))
HYPER = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    model = assemble(load_config("qwen3-moe-30b-a3b-proxy"), "shapes")
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = []  # (p, g, m, v) of each parameter the kernel takes
    for p in model.parameters():
        if p.numel() < adamw_triton.TritonAdamW.MIN_NUMEL:
            continue
        p_, g = (torch.randn(p.shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        m = torch.randn(p.shape, generator=gen, device="cuda", dtype=torch.bfloat16) * 1e-3
        v = torch.rand(p.shape, generator=gen, device="cuda", dtype=torch.bfloat16) * 1e-6
        tensors.append((p_, g, m, v))
    step = torch.tensor(10.0, device="cuda")
    moved = sum(7 * t[0].numel() * t[0].element_size() for t in tensors)  # 4 reads + 3 writes

    def update_all():
        for p_, g, m, v in tensors:
            adamw_update(p_, g, m, v, step, **HYPER)

    big = max(tensors, key=lambda t: t[0].numel())
    start = [t.clone() for t in big]
    default = (adamw_triton.BLOCK, adamw_triton.WARPS)
    want = None
    results = {}
    for block, warps in (default,) + tuple(c for c in CONFIGS if c != default):
        adamw_triton.BLOCK, adamw_triton.WARPS = block, warps
        for t, s in zip(big, start):
            t.copy_(s)
        adamw_update(big[0], big[1], big[2], big[3], step, **HYPER)
        got = [t.clone() for t in (big[0], big[2], big[3])]
        want = want or got
        same = all(torch.equal(a, b) for a, b in zip(got, want))
        ms = median_ms(update_all, reps=args.reps, warmup=2)
        results[f"{block}x{warps}"] = {"ms": round(ms, 4), "tb_s": round(moved / ms / 1e9, 3), "bitwise_equal": same}
        print(f"adamw {block}x{warps}: {ms:.3f} ms, {moved / ms / 1e9:.2f} TB/s, bitwise equal {same}", flush=True)
    adamw_triton.BLOCK, adamw_triton.WARPS = default
    ok = all(r["bitwise_equal"] for r in results.values())
    rec = {"system": "moelab", "workload": "qwen3-moe-30b-a3b-proxy", "variant": "adamw-check",
           "gpu_name": torch.cuda.get_device_name(), "torch_version": torch.__version__, "commit": commit_id(),
           "command": " ".join(["python"] + sys.argv), "tensors": len(tensors),
           "elements": sum(t[0].numel() for t in tensors), "bytes_moved": moved,
           "default_block_and_warps": f"{default[0]}x{default[1]}", "by_block_and_warps": results, "ok": ok}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "adamw-check.json").write_text(json.dumps(rec, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
