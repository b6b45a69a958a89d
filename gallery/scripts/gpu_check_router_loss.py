"""Before anything is timed on the GPU: the router's bf16 tensor-core logits and the fused chunked loss against
their fp32 / full-logits references at the Qwen3 proxy's shapes (eager and compiled), each timed forward + backward.

    python gallery/scripts/gpu_check_router_loss.py --out DIR          # writes DIR/check-router-loss.json
    python gallery/scripts/gpu_check_router_loss.py --out DIR --small  # CPU: small shapes, checks the script

Router: x [8192, 2048] and w [128, 2048] in bf16 through moelab.model.router.router_logits against F.linear on
their fp32 copies (the path before); relative errors of the logits and of both gradients, and ms per call.
Loss: moelab.backends.loss.lm_loss chunked (the default chunk and 2048) against the compiled full loss, bf16 head
[151936, 2048], 8192 tokens: loss and gradients' relative errors, ms per forward + backward, peak memory added.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from moelab.backends.loss import lm_loss
from moelab.model.router import router_logits
from moelab.train.bench import commit_id


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def timed(fn, reps: int) -> float:
    """ms per call of fn() (after one warm-up call)."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / reps


def check_router(dev, T, D, E, reps) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(T, D, generator=g).to(dev, torch.bfloat16).requires_grad_()
    w = (0.02 * torch.randn(E, D, generator=g)).to(dev, torch.bfloat16).requires_grad_()
    g_TE = torch.randn(T, E, generator=g).to(dev)

    def ref():
        return F.linear(x.float(), w.float())

    out = {}
    for name, fn in (("eager", router_logits), ("compiled", torch.compile(router_logits, dynamic=False))):
        logits = fn(x, w)
        dx, dw = torch.autograd.grad(logits, (x, w), g_TE)
        r = ref()
        rdx, rdw = torch.autograd.grad(r, (x, w), g_TE)
        out[name] = {"logits_rel_err": rel(logits, r), "dx_rel_err": rel(dx, rdx), "dw_rel_err": rel(dw, rdw),
                     "ms_fwd_bwd": timed(lambda: torch.autograd.grad(fn(x, w), (x, w), g_TE), reps)}
    out["fp32_path_ms_fwd_bwd"] = timed(lambda: torch.autograd.grad(ref(), (x, w), g_TE), reps)
    return out


def check_loss(dev, T, D, V, reps, compiled) -> dict:
    g = torch.Generator(device="cpu").manual_seed(1)
    head = nn.Linear(D, V, bias=False).to(dev, torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(0.02 * torch.randn(V, D, generator=g))
    h = torch.randn(1, T, D, generator=g).to(dev, torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (1, T), generator=g).to(dev)

    def run(kind, chunk=0):
        h.grad = head.weight.grad = None
        loss = lm_loss(h, head, targets, kind, compiled=compiled, chunk=chunk)
        loss.backward()
        return loss.detach(), h.grad, head.weight.grad

    def fresh(kind, chunk=0):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        loss, dh, dw = run(kind, chunk)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if torch.cuda.is_available() else 0.0
        return loss, dh.clone(), dw.clone(), peak

    ref_loss, ref_dh, ref_dw, ref_peak = fresh("full")
    out = {"full": {"loss": ref_loss.item(), "peak_added_gib": ref_peak,
                    "ms_fwd_bwd": timed(lambda: run("full"), reps)}}
    for chunk in (0, 2048):
        loss, dh, dw, peak = fresh("chunked", chunk)
        out[f"chunked@{chunk or 'auto'}"] = {
            "loss_rel_err": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
            "dh_rel_err": rel(dh, ref_dh), "dw_rel_err": rel(dw, ref_dw), "peak_added_gib": peak,
            "ms_fwd_bwd": timed(lambda: run("chunked", chunk), reps)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true", help="CPU-sized shapes (checks the script)")
    args = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    T, D, E, V, reps = (256, 64, 8, 1000, 2) if args.small else (8192, 2048, 128, 151_936, 10)
    rec = {"system": "moelab", "workload": "qwen3-moe-30b-a3b-proxy", "variant": "check-router-loss", "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "torch_version": torch.__version__, "commit": commit_id(), "command": " ".join(["python"] + sys.argv),
           "shapes": {"tokens": T, "hidden": D, "experts": E, "vocab": V}}
    for name, fn in (("router", lambda: check_router(dev, T, D, E, reps)),
                     ("loss", lambda: check_loss(dev, T, D, V, reps, compiled=dev == "cuda"))):
        try:
            rec[name] = fn()
        except Exception as e:  # noqa: BLE001 (recorded; the other check still runs)
            import traceback

            traceback.print_exc()
            rec[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        print(name, json.dumps(rec[name], indent=1), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "check-router-loss.json").write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
