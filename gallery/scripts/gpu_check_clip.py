"""Issue 41: gradient clipping's multiply in TritonAdamW's update (TritonAdamW.clip_in_step) against the multiply
pass and then step() (torch.nn.utils.clip_grads_with_norm_, as moelab.parallel.place clipped before), on the GPU
where Triton rounds to nearest as torch does: weights and moments bitwise equal after three clipped steps, bf16 and
fp32, one tensor the kernel takes (an expert weight of the Qwen3-30B-A3B proxy, in SonicMoE's transposed layout) and
one torch's step takes; moelab.backends.grad_norm.scale_grads (clipping's multiply wherever the optimizer does not
take the factor: torch's AdamW) bitwise against clip_grads_with_norm_ over bf16, fp16 and fp32 gradients; then the
time of torch's pass, of scale_grads and of the update with and without the factor, per step of one expert weight
(CUDA events, median of --reps).

    python gallery/scripts/gpu_check_clip.py --out DIR      # DIR/clip-check.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from moelab.backends.grad_norm import scale_grads
from moelab.train.adamw_triton import TritonAdamW
from moelab.train.bench import commit_id, median_ms


def check(dtype: torch.dtype) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = ((128, 1536, 2048), (2048,))  # one block's gate|up weights ([E, 2F, D] seen transposed), a norm's
    weights = [torch.randn(s, generator=gen, device="cuda").to(dtype) for s in shapes]
    weights[0] = weights[0].transpose(1, 2)
    ref = [w.clone().requires_grad_() for w in weights]
    new = [w.clone().requires_grad_() for w in weights]
    o_ref, o_new = (TritonAdamW(ps, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True) for ps in (ref, new))
    for _ in range(3):
        grads = [torch.empty_like(w).normal_(generator=gen) for w in weights]
        total = torch.stack([g.float().norm() for g in grads]).norm()
        for a, b, g in zip(ref, new, grads):
            a.grad, b.grad = g.clone(), g.clone()
        torch.nn.utils.clip_grads_with_norm_(ref, 1.0, total, foreach=True)
        o_ref.step()
        o_new.clip_in_step(torch.clamp(1.0 / (total + 1e-6), max=1.0))
        o_new.step()
    kernel = [id(p) for p in o_new._kernel_params(o_new.param_groups[0])]
    return {"taken_by_kernel": [id(p) in kernel for p in new],
            "weights_equal": [torch.equal(a, b) for a, b in zip(ref, new)],
            "moments_equal": [torch.equal(o_ref.state[a][k], o_new.state[b][k]) for a, b in zip(ref, new)
                              for k in ("exp_avg", "exp_avg_sq")],
            "clip_factor": float(torch.clamp(1.0 / (total + 1e-6), max=1.0))}


def scale_check(dtype: torch.dtype) -> bool:
    """scale_grads' gradients equal clip_grads_with_norm_'s, bitwise (a large and a small gradient, one transposed)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    grads = [torch.randn(s, generator=gen, device="cuda").to(dtype) for s in ((64, 1536, 2048), (2048,), (7, 333))]
    grads[0] = grads[0].transpose(1, 2)
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    total = torch.stack([g.float().norm() for g in grads]).norm()
    torch.nn.utils.clip_grads_with_norm_(params, 1.0, total, foreach=True)
    scale_grads(grads, torch.clamp(1.0 / (total + 1e-6), max=1.0))
    return all(torch.equal(p.grad, g) for p, g in zip(params, grads))


def timing(reps: int) -> dict:
    w = torch.randn(128, 2048, 1536, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w.grad = torch.randn_like(w)
    opt = TritonAdamW([w], lr=3e-4, fused=True)
    coef = torch.tensor(0.5, device="cuda")
    pass_ms = median_ms(lambda: torch._foreach_mul_([w.grad], coef), reps)
    scale_ms = median_ms(lambda: scale_grads([w.grad], coef), reps)
    opt.clip_in_step(None)
    plain = median_ms(opt.step, reps)
    opt.clip_in_step(coef)
    folded = median_ms(opt.step, reps)
    gb = w.numel() * 2 / 1e9
    return {"elements": w.numel(), "multiply_pass_ms": pass_ms, "scale_grads_ms": scale_ms, "update_ms": plain,
            "update_with_factor_ms": folded, "multiply_pass_tb_s": 2 * gb / pass_ms,
            "scale_grads_tb_s": 2 * gb / scale_ms, "update_tb_s": 7 * gb / plain}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    checks = {str(d).replace("torch.", ""): check(d) for d in (torch.bfloat16, torch.float32)}
    scaled = {str(d).replace("torch.", ""): scale_check(d) for d in (torch.bfloat16, torch.float16, torch.float32)}
    ok = all(all(c["weights_equal"]) and all(c["moments_equal"]) and c["taken_by_kernel"] == [True, False]
             and c["clip_factor"] < 1 for c in checks.values()) and all(scaled.values())
    rec = {"system": "moelab", "variant": "clip-check", "workload": "qwen3-moe-30b-a3b-proxy",
           "gpu_name": torch.cuda.get_device_name(), "torch_version": torch.__version__, "commit": commit_id(),
           "command": " ".join(["python"] + sys.argv), "ok": ok, "checks": checks, "scale_grads_equal": scaled,
           "timing": timing(args.reps)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "clip-check.json").write_text(json.dumps(rec, indent=1) + "\n")
    print(f"clip check ok={ok} {json.dumps(rec['timing'])}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
