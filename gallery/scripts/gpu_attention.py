"""Issue 41: the attention kernel of the Qwen3 proxy's step, forward + backward, kernel against kernel.

At the proxy's shape (batch 2, 4,096 tokens, 32 query heads over 4 kv heads, head dim 128, causal, bf16) this times
the attention as moelab calls it (torch's SDPA with enable_gqa: cuDNN's kernels on Hopper), SDPA held to its flash
backend, FlashAttention-4 (flash_attn.cute, the CuTe-DSL kernels, wheel flash-attn-4==4.0.0b10 carried in .whl:
the last release on QuACK 0.3 / CUTLASS DSL 4.4.2, SonicMoE's pins) called directly, and FA4 through SDPA (torch's
flash-attention registry) where this torch has it, and moelab's own path to FA4 (moelab.backends.fa4's custom ops,
backend.attention=fa4 and auto's choice), eager and compiled whole (fullgraph: no graph break). Every variant's output
and gradients are checked against an fp32 reference on the first batch row; `ok`: moelab's FA4 variants ran and
each error is within twice SDPA's plus 1e-3. The times are medians of CUDA-event timed iterations.

    python gallery/scripts/gpu_attention.py --out DIR      # DIR/attention.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from moelab.train.bench import StepTimer, commit_id

B, L, H, G, DH = 2, 4096, 32, 4, 128


def flops(b: int) -> float:
    """Causal attention, forward + backward: 3.5 x the forward's 2 GEMMs of 2 L^2 Dh per head, halved (causal)."""
    fwd = 2 * 2 * b * H * L * L * DH / 2
    return fwd * 3.5


def sdpa(q_BHLD, k_BGLD, v_BGLD):
    return F.scaled_dot_product_attention(q_BHLD, k_BGLD, v_BGLD, is_causal=True, enable_gqa=True)


def sdpa_flash(q_BHLD, k_BGLD, v_BGLD):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q_BHLD, k_BGLD, v_BGLD, is_causal=True, enable_gqa=True)


def fa4_direct(q_BHLD, k_BGLD, v_BGLD):
    """FA4 on (B, L, heads, Dh) views of the same tensors (no copies: the kernel takes strided inputs)."""
    from flash_attn.cute.interface import flash_attn_func

    out = flash_attn_func(q_BHLD.transpose(1, 2), k_BGLD.transpose(1, 2), v_BGLD.transpose(1, 2), causal=True)
    out = out[0] if isinstance(out, tuple) else out
    return out.transpose(1, 2)


def fa4_contiguous(q_BHLD, k_BGLD, v_BGLD):
    """FA4 on contiguous (B, L, heads, Dh) copies (what a model producing that layout would pass)."""
    from flash_attn.cute.interface import flash_attn_func

    out = flash_attn_func(q_BHLD.transpose(1, 2).contiguous(), k_BGLD.transpose(1, 2).contiguous(),
                          v_BGLD.transpose(1, 2).contiguous(), causal=True)
    out = out[0] if isinstance(out, tuple) else out
    return out.transpose(1, 2)


def moelab_fa4(q_BHLD, k_BGLD, v_BGLD):
    """moelab's attention with backend.attention=fa4 (moelab.backends.fa4: FA4 as torch.library custom ops)."""
    from moelab.backends.fa4 import fa4_causal_attention

    return fa4_causal_attention(q_BHLD, k_BGLD, v_BGLD)


def _moelab_fa4_compiled_fn():
    return torch.compile(moelab_fa4, fullgraph=True)


def activate_sdpa_fa4() -> str:
    from torch.nn import attention

    if not hasattr(attention, "activate_flash_attention_impl"):
        raise RuntimeError("this torch has no flash-attention registry (activate_flash_attention_impl)")
    attention.activate_flash_attention_impl("FA4")
    return str(attention.current_flash_attention_impl())


def inputs(seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, H, L, DH, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, G, L, DH, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, G, L, DH, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(B, H, L, DH, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, do


def run_once(fn, q, k, v, do):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def reference(q, k, v, do):
    """fp32 math on the first batch row."""
    q, k, v = (t[:1].detach().float().requires_grad_() for t in (q, k, v))
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(do[:1].float())
    return out.detach(), q.grad, k.grad, v.grad


def rel_err(a, ref) -> float:
    return float((a[:1].float() - ref).abs().max() / ref.abs().max())


def time_fn(fn, q, k, v, do, iters: int) -> list[float]:
    """ms of each of `iters` forward + backward calls (moelab.train.bench.StepTimer's CUDA events)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))

    def once(_):
        fn(q, k, v).backward(do)
        q.grad = k.grad = v.grad = None

    return StepTimer("cuda").time(once, iters)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    q, k, v, do = inputs()
    ref = reference(q, k, v, do)
    rec = {"system": "moelab", "workload": "qwen3-moe-30b-a3b-proxy", "variant": "attention-kernels",
           "gpu_name": torch.cuda.get_device_name(), "torch_version": torch.__version__, "commit": commit_id(),
           "command": " ".join(["python"] + sys.argv), "shape": {"batch": B, "seq": L, "heads": H, "kv_heads": G,
                                                                  "head_dim": DH, "causal": True, "dtype": "bf16"},
           "flops_fwd_bwd": flops(B), "variants": {}}
    try:
        import flash_attn.cute as fa4

        rec["fa4_version"] = getattr(fa4, "__version__", "unknown")
    except Exception as e:  # noqa: BLE001 - reported, the other variants still run
        rec["fa4_version"] = f"not importable: {type(e).__name__}: {e}"
    variants = [("sdpa (moelab before fa4)", sdpa), ("sdpa flash backend", sdpa_flash), ("fa4 direct", fa4_direct),
                ("moelab fa4 (custom ops)", moelab_fa4), ("moelab fa4 compiled", _moelab_fa4_compiled_fn()),
                ("fa4 contiguous", fa4_contiguous), ("sdpa with fa4 registered", sdpa_flash)]
    for name, fn in variants:
        entry = rec["variants"][name] = {}
        try:
            if name == "sdpa with fa4 registered":
                entry["impl"] = activate_sdpa_fa4()
            t0 = time.perf_counter()
            got = run_once(fn, q, k, v, do)
            torch.cuda.synchronize()
            entry["first_call_s"] = round(time.perf_counter() - t0, 2)
            entry["rel_err"] = {n: round(rel_err(a, r), 6) for n, a, r in zip(("out", "dq", "dk", "dv"), got, ref)}
            times = time_fn(fn, q, k, v, do, args.iters)
            ms = statistics.median(times[2:])
            entry.update({"ms_fwd_bwd": round(ms, 4), "tflops": round(flops(B) / ms / 1e9, 1),
                          "ms_all": [round(t, 4) for t in times]})
            print(f"attention {name:26s} {ms:8.3f} ms fwd+bwd {flops(B) / ms / 1e9:6.1f} TFLOP/s "
                  f"rel err {entry['rel_err']} first call {entry['first_call_s']} s", flush=True)
        except Exception as e:  # noqa: BLE001 - one variant's failure is its result
            entry["error"] = f"{type(e).__name__}: {e}"
            print(f"attention {name:26s} ERROR {entry['error']}", flush=True)
            traceback.print_exc()
    v = rec["variants"]
    base = v["sdpa (moelab before fa4)"].get("rel_err")
    mine = [v[n] for n in ("moelab fa4 (custom ops)", "moelab fa4 compiled")]
    rec["ok"] = bool(base) and all("rel_err" in m and all(m["rel_err"][t] <= 2 * base[t] + 1e-3 for t in base)
                                   for m in mine)
    print(f"attention check ok={rec['ok']}", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "attention.json").write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
