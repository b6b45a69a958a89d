"""GPU checks of the experts backends against the torch reference, and their kernel times (one GPU).

    python gallery/scripts/check_backends_gpu.py --json OUT.json

For each available experts kernel (torch._grouped_mm, grouped_gemm's gmm): forward output and gradients of x,
w_gate_up and w_down on fresh random inputs (skewed counts, an empty expert, rows dropped past the counts)
against an fp32 per-expert loop, as ||out - ref|| / ||ref|| (bf16 operands: expect 1e-3..1e-2; NaN fails).
Then forward + backward time at the Qwen3-30B-A3B proxy's expert shapes (8,192 tokens x top-8 = 65,536 rows,
128 experts, hidden 2048, width 768), median of CUDA-event timings after warm-up."""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from moelab.train.bench import commit_id
from moelab.backends import detected
from moelab.model.experts import grouped_mm_swiglu, loop_swiglu


def kernels():
    out = {"grouped_mm": grouped_mm_swiglu}
    if detected()["grouped_gemm"]:
        from moelab.backends import experts_kernel

        out["grouped_gemm"] = experts_kernel("grouped_gemm")
    return out


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def check(fn, E=16, D=256, F=128, N=4096, dropped=300, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, D, device="cuda", generator=g)
    w1 = torch.randn(E, D, 2 * F, device="cuda", generator=g) / D**0.5
    w2 = torch.randn(E, F, D, device="cuda", generator=g) / F**0.5
    share = torch.distributions.Dirichlet(torch.full((E,), 0.7)).sample().cuda()
    counts = torch.floor(share * (N - dropped)).long()
    counts[3] = 0  # an expert with no rows
    dy = torch.randn(N, D, device="cuda", generator=g)
    total = int(counts.sum())
    # reference: fp32 loop; rows past the counts contribute nothing
    xr, w1r, w2r = (t.clone().requires_grad_() for t in (x, w1, w2))
    yr = loop_swiglu(xr, w1r, w2r, counts)
    (yr[:total] * dy[:total]).sum().backward()
    xb, w1b, w2b = (t.bfloat16().requires_grad_() for t in (x, w1, w2))
    y = fn(xb, w1b, w2b, counts)
    y_valid = y[:total]
    (y_valid.float() * dy[:total]).sum().backward()
    errs = {"out": rel(y_valid, yr[:total]), "grad_x": rel(xb.grad[:total], xr.grad[:total]),
            "grad_w_gate_up": rel(w1b.grad, w1r.grad), "grad_w_down": rel(w2b.grad, w2r.grad)}
    ok = all(e == e and e < 2e-2 for e in errs.values())
    return {"ok": ok, **errs}


def time_fwd_bwd(fn, E=128, D=2048, F=768, N=65536, reps=20, skew=False):
    torch.manual_seed(0)
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(E, D, 2 * F, device="cuda") * 0.02).bfloat16().requires_grad_()
    w2 = (torch.randn(E, F, D, device="cuda") * 0.02).bfloat16().requires_grad_()
    if skew:
        share = torch.distributions.Dirichlet(torch.full((E,), 2.0)).sample()
        counts = torch.floor(share * N).long()
        counts[0] += N - int(counts.sum())
    else:
        counts = torch.full((E,), N // E, dtype=torch.long)
    counts = counts.cuda()
    dy = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)

    def once():
        y = fn(x, w1, w2, counts)
        y.backward(dy)
        x.grad = w1.grad = w2.grad = None

    for _ in range(3):
        once()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        once()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ms = statistics.median(ts)
    flops = 3 * 2 * N * D * 3 * F  # three GEMMs (gate_up counts 2F), forward + 2x backward
    return {"ms": ms, "tflops": flops / ms / 1e9}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    res = {"kind": "experts-backends", "gpu_name": torch.cuda.get_device_name(), "torch_version": torch.__version__,
           "commit": commit_id(), "command": " ".join(["python"] + sys.argv), "detected": detected(),
           "shape": "65536 rows x 2048 -> 128 experts x 768 (SwiGLU), forward + backward", "kernels": {}}
    for name, fn in kernels().items():
        r = {"check": [check(fn, seed=s) for s in range(3)]}
        r["correct"] = all(c["ok"] for c in r["check"])
        r["balanced"] = time_fwd_bwd(fn)
        r["skewed_dirichlet2"] = time_fwd_bwd(fn, skew=True)
        res["kernels"][name] = r
        print(f"{name:13s} correct={r['correct']} max rel err "
              f"{max(max(v for k, v in c.items() if k != 'ok') for c in r['check']):.2e}  "
              f"balanced {r['balanced']['ms']:.2f} ms ({r['balanced']['tflops']:.0f} TFLOP/s)  "
              f"skewed {r['skewed_dirichlet2']['ms']:.2f} ms ({r['skewed_dirichlet2']['tflops']:.0f} TFLOP/s)",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
