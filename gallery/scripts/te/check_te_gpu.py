"""Transformer Engine on one GPU: correctness of moelab's TE backends against the torch path, kernel times, and
the model-level variants (eager / compiled, TE FP8 recipes), one JSON result file per variant.

    python gallery/scripts/te/check_te_gpu.py --out DIR [--parts attention,experts,model] [--layers 2]

attention: TEAttentionCore (GQA; a sliding window with GPT-OSS sinks; MLA's 192/128 head dims) against moelab's
    eager attention on the same bf16 inputs upcast to fp32: output and every input gradient (sinks included) as
    ||out - ref|| / ||ref|| (bf16: expect 1e-3..1e-2), with the torch bf16 path's own error beside it.
experts: TEGroupedExperts (TE's grouped-tensor path where it runs, else its per-expert path) against an fp32
    per-expert loop, then forward + backward time at the Qwen3-30B-A3B proxy's expert shapes against
    torch._grouped_mm (moelab's default).
model: the Qwen3-30B-A3B proxy (learned router, seq 4096, micro batch 2, global batch 2, bf16 parameters) with
    `--layers` layers, through moelab.train.bench: SDPA vs TE attention, eager and compiled, and TE's FP8 recipes.
"""
from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch

from moelab.train.bench import bench, commit_id, median_ms
from moelab.config import load_config
from moelab.model.attention import causal_attention
from moelab.model.experts import grouped_mm_swiglu, loop_swiglu


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def check_attention() -> list[dict]:
    from moelab.backends.te import TEAttentionCore

    cases = [dict(name="gqa", H=32, G=4, dk=128, dv=128, window=0, sinks=False, scale=None),
             dict(name="window+sinks", H=16, G=4, dk=64, dv=64, window=128, sinks=True, scale=None),
             dict(name="mla", H=16, G=16, dk=192, dv=128, window=0, sinks=False, scale=192 ** -0.5 * 1.3)]
    out = []
    for c in cases:
        rec = {"case": c["name"]}
        try:
            B, L = 2, 1024
            g = torch.Generator(device="cuda").manual_seed(len(out))
            q = torch.randn(B, c["H"], L, c["dk"], device="cuda", generator=g).bfloat16()
            k = torch.randn(B, c["G"], L, c["dk"], device="cuda", generator=g).bfloat16()
            v = torch.randn(B, c["G"], L, c["dv"], device="cuda", generator=g).bfloat16()
            sinks = torch.randn(c["H"], device="cuda", generator=g) if c["sinks"] else None
            dy = torch.randn(B, c["H"], L, c["dv"], device="cuda", generator=g).bfloat16()

            def run(fn, dtype):
                ins = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
                s = sinks.detach().clone().requires_grad_() if sinks is not None else None
                o = fn(*ins, s)
                o.backward(dy.to(o.dtype))
                return [o] + [t.grad for t in ins] + ([s.grad] if s is not None else [])

            torch_fn = lambda q_, k_, v_, s_: causal_attention(q_, k_, v_, "eager", c["window"], s_, c["scale"])
            ref = run(torch_fn, torch.float32)
            bf16 = run(torch_fn, torch.bfloat16)
            core = TEAttentionCore(c["H"], c["G"], c["dk"], c["dv"], c["window"], c["scale"], c["sinks"]).cuda()
            te_out = run(lambda q_, k_, v_, s_: core(q_, k_, v_, s_), torch.bfloat16)
            names = ["out", "dq", "dk", "dv"] + (["dsinks"] if c["sinks"] else [])
            rec["te_rel_err"] = {n: rel(a, r) for n, a, r in zip(names, te_out, ref)}
            rec["torch_bf16_rel_err"] = {n: rel(a, r) for n, a, r in zip(names, bf16, ref)}
            rec["ok"] = all(e < 2e-2 for e in rec["te_rel_err"].values())
        except Exception as e:  # recorded, not fatal: the other cases still run
            rec.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-2000:])
        print("attention", json.dumps(rec)[:400], flush=True)
        out.append(rec)
    return out


def check_experts() -> dict:
    from moelab.backends.te import TEGroupedExperts

    rec = {}

    def te_experts(E, D, F, w1, w2, native):
        m = TEGroupedExperts(E, D, F, device="cuda").to(torch.bfloat16)  # TE's params are fp32 by default
        if not native:
            m.native = False
        with torch.no_grad():
            for e in range(E):
                getattr(m.gate_up_proj, f"weight{e}").copy_(w1[e].T)
                getattr(m.down_proj, f"weight{e}").copy_(w2[e].T)
        return m

    # correctness: skewed counts, an empty expert, rows dropped past the counts (zero rows, as dispatched)
    E, D, F, N, dropped = 16, 256, 128, 4096, 300
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, D, device="cuda", generator=g)
    w1 = torch.randn(E, D, 2 * F, device="cuda", generator=g) / D ** 0.5
    w2 = torch.randn(E, F, D, device="cuda", generator=g) / F ** 0.5
    counts = torch.floor(torch.distributions.Dirichlet(torch.full((E,), 0.7)).sample().cuda() * (N - dropped)).long()
    counts[3] = 0
    x[int(counts.sum()):] = 0
    ref = loop_swiglu(x, w1, w2, counts)
    for native in (True, False):
        key = "grouped_tensor" if native else "per_expert"
        try:
            m = te_experts(E, D, F, w1.bfloat16(), w2.bfloat16(), native)
            if native and not m.native:
                rec[key] = {"available": False}
                continue
            y = m(x.bfloat16(), counts)
            total = int(counts.sum())
            rec[key] = {"available": True, "rel_err": rel(y[:total].float(), ref[:total])}
        except Exception as e:
            rec[key] = {"available": False, "error": f"{type(e).__name__}: {e}"}
    rec["grouped_mm_rel_err"] = rel(grouped_mm_swiglu(x.bfloat16(), w1.bfloat16(), w2.bfloat16(), counts)
                                    [:int(counts.sum())].float(), ref[:int(counts.sum())])
    # time at the proxy's shapes: 8,192 tokens x top-8 = 65,536 rows, 128 experts, hidden 2048, width 768
    E, D, F, N = 128, 2048, 768, 65536
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(E, D, 2 * F, device="cuda") / D ** 0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(E, F, D, device="cuda") / F ** 0.5).bfloat16().requires_grad_()
    counts = torch.full((E,), N // E, device="cuda", dtype=torch.int64)
    dy = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    flops = 3 * 2 * N * D * 3 * F  # forward + backward (2x), gate_up and down
    rec["timing"] = {"rows": N, "experts": E, "hidden": D, "width": F, "balanced": True}

    def fb(fn):
        return lambda: fn().backward(dy)

    ms = median_ms(fb(lambda: grouped_mm_swiglu(x, w1, w2, counts)), reps=20, warmup=3)
    rec["timing"]["grouped_mm"] = {"ms": ms, "tflops": flops / ms / 1e9}
    for native in (True, False):
        key = "grouped_tensor" if native else "per_expert"
        if not rec.get(key, {}).get("available"):
            continue
        m = te_experts(E, D, F, w1.detach(), w2.detach(), native)
        ms = median_ms(fb(lambda: m(x, counts)), reps=20, warmup=3)
        rec["timing"][f"te_{key}"] = {"ms": ms, "tflops": flops / ms / 1e9}
    print("experts", json.dumps(rec), flush=True)
    return rec


MODEL_VARIANTS = [  # name, overrides (on top of the proxy with --layers layers)
    ("sdpa-eager", {}),
    ("te-eager", {"backend.attention": "te"}),
    ("sdpa-compile", {"train.compile": True}),
    ("te-compile", {"backend.attention": "te", "train.compile": True}),
    ("te-compile-fp8-current", {"backend.attention": "te", "train.compile": True, "backend.te_fp8": "current"}),
    ("te-compile-fp8-block", {"backend.attention": "te", "train.compile": True, "backend.te_fp8": "block"}),
    ("te-experts-eager", {"backend.experts": "te"}),
]


def model_variants(out: Path, layers: int, skip: set, deadline: float, steps: int, warmup: int) -> list[dict]:
    rows = []
    for name, over in MODEL_VARIANTS:
        if name in skip or time.time() > deadline:
            continue
        over = {"model.num_layers": layers, "train.param_dtype": "bfloat16", "train.global_batch_size": 2,
                "train.micro_batch_size": 2, "backend.fake_balanced_gate": False, **over}
        cmd = (f"python gallery/scripts/te/check_te_gpu.py --parts model --layers {layers} (variant {name}: "
               + " ".join(f"--set {k}={v}" for k, v in over.items()) + ")")
        try:
            cfg = load_config("qwen3-moe-30b-a3b-proxy", over)
            r = bench(cfg, steps=steps, warmup=warmup, real_router=False, metrics_overhead=False, command=cmd)
            r.update(variant=name, te_fp8=cfg.backend.te_fp8, layers=layers)
            (out / f"qwen3-moe-30b-a3b-proxy-{layers}l--moelab--te-{name}.json").write_text(json.dumps(r, indent=1))
            rows.append(r)
            print(f"model {name}: {r['tokens_per_s_per_gpu']:,.0f} tokens/s, {r['tflops_per_gpu']:.0f} TFLOPs, "
                  f"{r['peak_memory_gb']:.1f} GiB", flush=True)
        except Exception as e:
            rows.append({"variant": name, "error": f"{type(e).__name__}: {e}"})
            print(f"model {name}: FAILED {type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}", flush=True)
        torch.cuda.empty_cache()
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--parts", default="attention,experts,model")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--skip", default="")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--deadline-s", type=float, default=1e9)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    import transformer_engine

    meta = {"gpu": torch.cuda.get_device_name(), "torch_version": torch.__version__, "commit": commit_id(),
            "te_version": getattr(transformer_engine, "__version__", "?"),
            "command": "python gallery/scripts/te/check_te_gpu.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items()),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    parts = a.parts.split(",")
    rec = dict(meta)
    if "attention" in parts:
        rec["attention"] = check_attention()
    if "experts" in parts:
        try:
            rec["experts"] = check_experts()
        except Exception as e:
            rec["experts"] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
            print("experts FAILED", rec["experts"], flush=True)
    (out / "te-checks.json").write_text(json.dumps(rec, indent=1))
    if "model" in parts:
        rows = model_variants(out, a.layers, set(a.skip.split(",")), t0 + a.deadline_s, a.steps, a.warmup)
        print("\n| variant | tokens/s | TFLOPs | peak GiB |\n|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['variant']} | " + (f"{r['tokens_per_s_per_gpu']:,.0f} | {r['tflops_per_gpu']:.0f} | "
                                             f"{r['peak_memory_gb']:.1f} |" if "error" not in r else
                                             f"failed: {r['error'][:80]} | | |"))


if __name__ == "__main__":
    main()
