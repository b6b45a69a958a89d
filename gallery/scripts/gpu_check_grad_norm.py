"""Issue 41: the step's gradient norm at the Qwen3-30B-A3B proxy's gradients (bf16, every parameter's shape, the
experts' in SonicMoE's memory order as backend.experts=sonic holds them), checked and timed: torch's foreach norm
(torch.nn.utils.get_total_norm, the code before) against moelab.backends.grad_norm (one Triton pass per large
gradient), both against an fp64 sum; median of --reps CUDA-event calls.

    python gallery/scripts/gpu_check_grad_norm.py --out DIR      # DIR/grad-norm.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from moelab.backends.grad_norm import on_kernel, squared_norms
from moelab.config import load_config
from moelab.model.assemble import assemble
from moelab.train.bench import StepTimer, commit_id


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    model = assemble(load_config("qwen3-moe-30b-a3b-proxy"), "shapes")
    gen = torch.Generator(device="cuda").manual_seed(0)
    grads = []
    for name, p in model.named_parameters():
        shape = p.shape if not name.endswith(("w_gate_up_EDF2", "w_down_EFD")) else (p.shape[0], p.shape[2], p.shape[1])
        g = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
        grads.append(g if len(shape) != 3 or shape == p.shape else g.transpose(1, 2))
    exact = sum(float(g.double().square().sum()) for g in grads) ** 0.5
    timer = StepTimer("cuda")
    variants = {"torch foreach (get_total_norm)": lambda _: torch.nn.utils.get_total_norm(grads, foreach=True),
                "moelab.backends.grad_norm": lambda _: squared_norms(grads).sum().sqrt()}
    rec = {"system": "moelab", "workload": "qwen3-moe-30b-a3b-proxy", "variant": "grad-norm-check",
           "device": torch.cuda.get_device_name(), "torch_version": torch.__version__, "commit": commit_id(),
           "command": " ".join(["python"] + sys.argv), "gradients": len(grads),
           "bytes": sum(g.numel() * g.element_size() for g in grads),
           "on_kernel": sum(on_kernel(g) for g in grads), "fp64_norm": exact, "results": {}}
    for label, f in variants.items():
        value = float(f(0))
        ms = statistics.median(timer.time(f, args.reps))
        rec["results"][label] = {"ms": ms, "tb_s": rec["bytes"] / ms / 1e9, "norm": value,
                                 "rel_err_vs_fp64": abs(value - exact) / exact}
        print(f"grad-norm {label:32s} {ms:7.3f} ms {rec['results'][label]['tb_s']:5.2f} TB/s rel err "
              f"{rec['results'][label]['rel_err_vs_fp64']:.2e}", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "grad-norm.json").write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
