"""Issue 41: one MoE layer's experts, forward + backward, at the Qwen3-30B-A3B proxy's shapes, checked and timed:
moelab's compiled path as it is today (LocalDispatcher + torch._grouped_mm experts, compiled), moelab's fused
Triton path (backend.experts=triton_fused: moelab.model.fused_experts), eager and compiled, the same saved tensors
with torch._grouped_mm (fused_experts.lean_grouped_experts), and SonicMoE when it
imports (its `moe_general_routing_inputs` on the same routing; set SONIC_SITE to the folder its wheels were
unpacked into).

    python gallery/scripts/gpu_moe_layer.py --out DIR             # writes DIR/moe-layer.json
    python gallery/scripts/gpu_moe_layer.py --out DIR --small     # small shapes (CPU: the reference paths only)
    python gallery/scripts/gpu_moe_layer.py --out DIR --shape deepseek-v3-proxy --label moe-layer-fp8 \
        --variants moelab-grouped_mm-compiled,moelab-fp8-rowwise-compiled,moelab-fp8-rowwise-cached-compiled
    SONIC_SITE=DIR python gallery/scripts/gpu_moe_layer.py --out DIR --variants sonicmoe-default-config,sonicmoe-autotuned

SONIC_SITE: the folder gallery/scripts/sonic_site.sh's tarball unpacks to (SonicMoE, QuACK, the CuTe DSL and its
cu13 libraries, apache-tvm-ffi; cuda-bindings comes with the GPU image's torch).

Shapes (--shape): qwen3-moe-30b-a3b-proxy (default): T 8192 tokens, K 8 of E 128 experts, D 2048, F 768;
deepseek-v3-proxy (the preset's MoE layer at seq 4096, micro batch 1): T 4096, K 8 of E 64, D 7168, F 2048. SwiGLU,
bf16 weights and tokens, fp32 routing weights (as the router hands them under autocast). FP8 variants (train.fp8=
rowwise's experts, moelab.model.fp8): `-rowwise-` quantises both weights in every call (a step of one micro batch),
`-rowwise-cached-` reads the ExpertWeightCache refreshed once outside the timed region (the trainer refreshes it once
per optimizer step: many micro batches); the refresh's own time is in the record. `moelab-sonic-*`:
backend.experts=sonic as a run gets it (GroupedExperts(impl="sonic") built on the meta device,
moelab.backends.sonic.sonic_layout, materialised, LocalDispatcher.route -> on_tokens -> sonic_experts; moelab's
tiles, moelab.backends.sonic.TILES). SonicMoE variants: `-default-config`
runs QuACK's GEMMs with their default tile config (tuned=False), `-autotuned` lets QuACK autotune every GEMM on its
first call (each config a CuTe DSL compile, in QUACK_COMPILE_WORKERS subprocesses); every cute.compile is logged
with its time, and each SonicMoE variant's first step is bounded by SONIC_TIMEOUT_S. All moelab variants run at
both routings before any SonicMoE variant starts. Routing: "balanced" (every expert T*K/E rows) and "skewed" (expert popularity
drawn from Dirichlet(2), the notes' kernel-ceiling skew; each token draws its K experts without replacement).
The timed region is everything after the router: dispatch, experts, combine, and their backward with the
gradients of x, the routing weights and both expert weights (set to None before each step, as in a first micro
batch). TFLOP/s counts 18 N D F (the six GEMMs of 2 N D F each, the gate|up ones twice as wide). Saved bytes: the
tensors autograd keeps for backward (torch.autograd.graph.saved_tensors_hooks, each storage once), all of them and
without the layer's inputs and weights; and the allocator's growth over the forward minus the output.
Checks: forward and every gradient against an fp32 reference (the per-expert loop on fp32 copies), as the relative
L2 error; the fused path must stay within 2x the error of today's bf16 path (both round the same bf16 operands,
with fp32 accumulation: only the summation order and where SwiGLU rounds differ).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from moelab.model.experts import GroupedExperts, loop_swiglu, swiglu
from moelab.model.moe import LocalDispatcher
from moelab.model.rows import combine_rows, dispatch_rows, inverse_permutation
from moelab.train.bench import StepTimer, commit_id


SHAPES = {"qwen3-moe-30b-a3b-proxy": (8192, 8, 128, 2048, 768), "deepseek-v3-proxy": (4096, 8, 64, 7168, 2048)}
VARIANTS = {  # name: (implementation, compiled)
    "moelab-grouped_mm-eager": ("auto", False), "moelab-grouped_mm-compiled": ("auto", True),
    "moelab-triton_fused-eager": ("triton_fused", False), "moelab-triton_fused-compiled": ("triton_fused", True),
    "moelab-lean_grouped_mm-eager": ("lean", False), "moelab-lean_grouped_mm-compiled": ("lean", True),
    "moelab-fp8-rowwise-compiled": ("fp8", True), "moelab-fp8-rowwise-cached-compiled": ("fp8-cached", True),
    "sonicmoe-default-config": ("sonic", False), "sonicmoe-autotuned": ("sonic-tuned", False),
    "moelab-sonic-eager": ("moelab-sonic", False), "moelab-sonic-compiled": ("moelab-sonic", True),
    "moelab-sonic-copy-eager": ("moelab-sonic-copy", False)}
SONIC_IMPLS = ("sonic", "sonic-tuned", "moelab-sonic", "moelab-sonic-copy")  # first step compiles CuTe DSL kernels: bounded, run last
DEFAULT_VARIANTS = list(VARIANTS)[:6]


def stamp() -> str:
    return time.strftime("%H:%M:%S")


def routing(kind: str, T: int, K: int, E: int, gen: torch.Generator):
    if kind == "balanced":
        experts_TK = (torch.arange(T * K) % E).view(T, K)
    else:
        p_E = torch.distributions.Dirichlet(torch.full((E,), 2.0)).sample()
        experts_TK = torch.multinomial(p_E.expand(T, E), K, replacement=False, generator=gen)
    weights_TK = torch.softmax(torch.randn(T, K, generator=gen), -1)
    return weights_TK, experts_TK


def rel(a, b) -> float:
    """||a - b|| / ||b|| in float64, over chunks of 2^24 elements (a float64 copy of a DeepSeek-V3-sized expert
    weight gradient would be 15 GB)."""
    num = den = 0.0
    for a_c, b_c in zip(a.reshape(-1).split(1 << 24), b.reshape(-1).split(1 << 24)):
        b_c = b_c.double()
        num += float((a_c.double() - b_c).square().sum())
        den += float(b_c.square().sum())
    return (num / max(den, 1e-60)) ** 0.5


class Saved:
    """Bytes of the tensors autograd saves inside the context (each storage once)."""

    def __init__(self, exclude):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.seen, self.total, self.activations = set(), 0, 0

    def pack(self, t):
        s = t.untyped_storage()
        if s.data_ptr() not in self.seen and s.device.type != "meta":
            self.seen.add(s.data_ptr())
            self.total += s.nbytes()
            self.activations += 0 if s.data_ptr() in self.exclude else s.nbytes()
        return t


def moelab_route(experts):
    dispatcher = LocalDispatcher()

    def f(x_TD, weights_TK, experts_TK):
        return dispatcher.route(experts, x_TD, weights_TK, experts_TK, None, experts.num_experts)
    return f


def lean_route(w1, w2, E):
    """moelab.model.fused_experts.lean_grouped_experts: torch._grouped_mm, saving what the fused kernels save."""
    from moelab.model.fused_experts import lean_grouped_experts

    def f(x_TD, weights_TK, experts_TK):
        order_N = torch.argsort(experts_TK.reshape(-1), stable=True)
        counts_E = torch.bincount(experts_TK.reshape(-1), minlength=E)
        return lean_grouped_experts(x_TD, weights_TK, w1, w2, order_N, counts_E)
    return f


_SONIC_TUNED = [True]


def sonic_setup(site_dir: str) -> str:
    """Import SonicMoE from its unpacked wheels; QuACK's GEMMs called with tuned=_SONIC_TUNED[0]; every CuTe DSL
    compile printed with its time. Returns sonicmoe's version."""
    import functools
    import site

    site.addsitedir(site_dir)  # with its .pth files (nvidia_cutlass_dsl's python_packages)
    extra = [site_dir, os.path.join(site_dir, "nvidia_cutlass_dsl", "python_packages")]
    os.environ["PYTHONPATH"] = os.pathsep.join(extra + [os.environ.get("PYTHONPATH", "")])  # QuACK's workers
    import sonicmoe
    import sonicmoe.functional as sf
    import sonicmoe.functional.backward as sb
    import sonicmoe.functional.forward as sfw

    for mod in (sf, sb, sfw):
        for name in ("gemm", "gemm_gated", "gemm_dgated"):
            if hasattr(mod, name):
                def tuned_as_set(*a, _f=getattr(mod, name), **k):
                    k["tuned"] = _SONIC_TUNED[0]  # SonicMoE's own default is tuned=True
                    return _f(*a, **k)
                setattr(mod, name, functools.wraps(getattr(mod, name))(tuned_as_set))
    try:
        from cutlass.base_dsl.compiler import CompileCallable

        call = CompileCallable.__call__

        def timed(self, *a, **k):
            what = getattr(a[0], "__qualname__", type(a[0]).__name__) if a else "?"
            t0 = time.time()
            print(f"[{stamp()}] cute.compile {what}: start", flush=True)
            try:
                return call(self, *a, **k)
            finally:
                print(f"[{stamp()}] cute.compile {what}: {time.time() - t0:.1f} s", flush=True)
        CompileCallable.__call__ = timed
    except Exception as exc:  # logging only
        print(f"cute.compile not wrapped: {exc!r}")
    return sonicmoe.__version__


def sonic_route(w1_s, w2_s, E, tuned: bool):
    from sonicmoe import moe_general_routing_inputs
    from sonicmoe.enums import ActivationType

    def f(x_TD, weights_TK, experts_TK):
        _SONIC_TUNED[0] = tuned
        T, K = experts_TK.shape
        tok = torch.arange(T, device=x_TD.device, dtype=torch.int32).repeat_interleave(K)
        y, _ = moe_general_routing_inputs(x_TD, weights_TK.reshape(-1), tok, experts_TK.reshape(-1).int(),
                                          w1_s.permute(1, 2, 0), None, w2_s.permute(1, 2, 0), None, E,
                                          torch.cuda.current_stream().cuda_stream, ActivationType.SWIGLU,
                                          False, True)
        return y
    return f


def write(rec: dict, out: str, name: str = "moe-layer") -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"{name}.json").write_text(json.dumps(rec, indent=1) + "\n")


def _alarm(signum, frame):
    raise TimeoutError("SonicMoE's step did not finish within SONIC_TIMEOUT_S")


def kernel_profile(f, inputs, g_TD, steps: int = 3) -> dict:
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                f(*inputs).backward(g_TD)
            torch.cuda.synchronize()
        by = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                by[ev.name[:90]] = by.get(ev.name[:90], 0.0) + ev.device_time_total / 1e3 / steps
        top = dict(sorted(by.items(), key=lambda kv: -kv[1])[:14])
        top["(all kernels)"] = sum(by.values())
        return top
    except Exception as exc:
        return {"error": repr(exc)[:300]}


def moelab_sonic(w1, w2, E, D, F, rec, layout: bool = True):
    """backend.experts=sonic's path: the experts built on meta, laid out by sonic_layout, materialised (strides kept,
    checked), given w1 / w2's values; routed by LocalDispatcher (on_tokens -> moelab.backends.sonic). layout=False
    (moelab-sonic-copy): weights left in moelab's order, as FSDP2's gathered ones are: copied each call."""
    from moelab.backends.sonic import sonic_layout

    with torch.device("meta"):
        experts = GroupedExperts(E, D, F, impl="sonic")
    if layout:
        sonic_layout(experts)
    experts = experts.to_empty(device=w1.device).to(w1.dtype)
    with torch.no_grad():
        experts.w_gate_up_EDF2.copy_(w1)
        experts.w_down_EFD.copy_(w2)
    rec["moelab_sonic_weights_in_sonic_order" + ("" if layout else "_copy")] = (
        experts.w_gate_up_EDF2.transpose(1, 2).is_contiguous() and experts.w_down_EFD.transpose(1, 2).is_contiguous())
    route = moelab_route(experts)

    return route, [experts.w_gate_up_EDF2, experts.w_down_EFD]


def build(variants, w1, w2, E, D, F, sonic, rec, own):
    """Each variant's function (x_TD, weights_TK, experts_TK) -> y_TD, compiled once (the shapes do not change
    between routings). own: variant -> its own weight parameters (moelab-sonic's, in SonicMoE's memory order)."""
    fns = {}
    for name in variants:
        impl, compiled = VARIANTS[name]
        if impl in ("sonic", "sonic-tuned"):
            fns[name] = sonic_route(*sonic, E, tuned=impl == "sonic-tuned")
            continue
        if impl in ("moelab-sonic", "moelab-sonic-copy"):
            fn, own[name] = moelab_sonic(w1, w2, E, D, F, rec, layout=impl == "moelab-sonic")
            fns[name] = torch.compile(fn) if compiled else fn
            continue
        if impl == "lean":
            fn = lean_route(w1, w2, E)
        else:
            by_impl = GroupedExperts(E, D, F, impl="auto" if impl.startswith("fp8") else impl)
            by_impl.w_gate_up_EDF2, by_impl.w_down_EFD = w1, w2  # sharing the weights
            if impl.startswith("fp8"):
                by_impl.fp8 = True
            if impl == "fp8-cached":
                from moelab.model.fp8_cache import ExpertWeightCache

                by_impl.fp8_cache = ExpertWeightCache(by_impl)
                timer = StepTimer("cuda")
                by_impl.fp8_cache.refresh(torch.bfloat16)
                ms = statistics.median(timer.time(lambda _: by_impl.fp8_cache.refresh(torch.bfloat16), 10))
                rec["fp8_cache_refresh_ms"] = ms
                rec["fp8_cache_error"] = by_impl.fp8_cache.error
                print(f"moe-layer fp8 weight cache refresh (both weights): {ms:.3f} ms", flush=True)
            fn = moelab_route(by_impl)
        fns[name] = torch.compile(fn) if compiled else fn
    return fns


def case(kind, T, K, E, D, dev, dt, gen, w1, w2):
    """One routing's inputs and the fp32 reference (the per-expert loop on fp32 copies)."""
    weights_TK, experts_TK = routing(kind, T, K, E, gen)
    weights_TK, experts_TK = weights_TK.to(dev), experts_TK.to(dev)
    x_TD = (torch.randn(T, D, generator=gen)).to(dev, dt).requires_grad_()
    wts = weights_TK.clone().requires_grad_()
    g_TD = torch.randn(T, D, generator=gen).to(dev)
    counts = torch.bincount(experts_TK.reshape(-1), minlength=E)
    loads = {"max_rows_per_expert": int(counts.max()), "min_rows_per_expert": int(counts.min())}
    xr, wr = x_TD.detach().float().requires_grad_(), weights_TK.clone().requires_grad_()
    w1r, w2r = w1.detach().float().requires_grad_(), w2.detach().float().requires_grad_()
    order = torch.argsort(experts_TK.reshape(-1), stable=True)
    inv = inverse_permutation(order)
    y_ref = combine_rows(loop_swiglu(dispatch_rows(xr, order, inv, K), w1r, w2r, counts, act=swiglu,
                                     scale_N=wr.reshape(-1)[order]), order, inv, K)
    y_ref.backward(g_TD)
    ref = {"y": y_ref.detach(), "dx": xr.grad, "dweights": wr.grad, "dw_gate_up": w1r.grad, "dw_down": w2r.grad}
    del xr, wr, w1r, w2r, y_ref
    return {"x_TD": x_TD, "wts": wts, "experts_TK": experts_TK, "g_TD": g_TD, "ref": ref, "loads": loads}


def measure(name, f, c, params, sonic, timer, reps, dev, flop, later: bool = False, own=None) -> dict:
    """Check against the reference, time (median of reps after 2 warm-up steps), count the saved bytes. `later`:
    time a later micro batch of a step (the weights' gradients kept between steps, so each step adds into them),
    and check that a second step on the same inputs doubles the weights' gradients."""
    impl = VARIANTS[name][0]
    x_TD, wts, experts_TK, g_TD, ref = c["x_TD"], c["wts"], c["experts_TK"], c["g_TD"], c["ref"]
    leaves = [x_TD, wts, *((own or {}).get(name) or (sonic if impl.startswith("sonic") else params))]

    def step(_=0):
        for t in (leaves[:2] if later else leaves):
            t.grad = None
        y = f(x_TD, wts, experts_TK)
        y.backward(g_TD.to(y.dtype))
        return y
    for t in leaves:  # the variants share the weights: no gradient of another variant's steps
        t.grad = None
    t0 = time.time()
    y = step()
    if dev == "cuda":
        torch.cuda.synchronize()
    first_s = time.time() - t0
    grads = [t.grad for t in leaves]
    if impl.startswith("sonic"):  # its weights are [out, in]
        grads[2], grads[3] = grads[2].transpose(1, 2), grads[3].transpose(1, 2)
    errs = {k: rel(v, ref[k]) for k, v in zip(ref, [y.detach()] + grads)}
    doubled = None
    if later:  # the first step's weight gradients, then a second step adds the same again
        first = [t.grad.clone() for t in leaves[2:]]
        step()
        doubled = {n: rel(t.grad, 2 * g) for n, t, g in zip(("dw_gate_up", "dw_down"), leaves[2:], first)}
    for _ in range(2):
        step()
    ms = statistics.median(timer.time(step, reps))
    saved = Saved([x_TD, wts, experts_TK, *leaves[2:]])
    for t in leaves:
        t.grad = None
    if dev == "cuda":
        torch.cuda.synchronize()
        m0 = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        y = f(x_TD, wts, experts_TK)
    grown = torch.cuda.memory_allocated() - m0 - y.numel() * y.element_size() if dev == "cuda" else None
    y.backward(g_TD.to(y.dtype))
    del y
    return {"fwd_bwd_ms": ms, "tflops": flop / (ms * 1e-3) / 1e12, "rel_err_vs_fp32": errs,
            "first_step_s": first_s, "later_micro_batch": later, "second_step_vs_twice_the_first": doubled,
            "saved_bytes_hooks_total": saved.total,
            "saved_bytes_hooks_activations": saved.activations, "saved_bytes_allocator": grown}


def fused_sweep(res, f, c, params, timer, reps):
    """triton_fused's block sizes, eager, on one routing."""
    sweep = res["fused_block_sweep (BM,BN,BK,warps,stages,BN_da): fwd_bwd_ms"] = {}
    for blocks in ("128,128,64,8,3,128", "128,128,64,8,3,64", "128,128,64,8,4,64", "64,128,64,4,3,64",
                   "128,128,64,8,3,32"):
        os.environ["MOELAB_FUSED_BLOCKS"] = blocks

        def fused_step(_=0):
            for t in (c["x_TD"], c["wts"], *params):
                t.grad = None
            f(c["x_TD"], c["wts"], c["experts_TK"]).backward(c["g_TD"])
        try:
            fused_step()
            sweep[blocks] = statistics.median(timer.time(fused_step, reps))
        except Exception as exc:
            sweep[blocks] = f"{type(exc).__name__}: {str(exc)[:200]}"
        print(f"moe-layer sweep {blocks}: {sweep[blocks]}", flush=True)
    del os.environ["MOELAB_FUSED_BLOCKS"]


def summarise(rec) -> None:
    """Each variant's error check against today's bf16 path and its ratios to today's compiled path."""
    for kind, res in rec["results"].items():
        base = res.get("moelab-grouped_mm-eager") or res.get("moelab-grouped_mm-compiled") or {}
        base = base.get("rel_err_vs_fp32")
        for name, r in res.items():
            fused = name.startswith(("moelab-triton_fused", "moelab-sonic"))
            if fused and base and isinstance(r, dict) and "rel_err_vs_fp32" in r:
                r["within_2x_bf16_path_error"] = all(r["rel_err_vs_fp32"][k] <= 2 * base[k] + 1e-6 for k in base)
        today = res.get("moelab-grouped_mm-compiled")
        if today:
            for name, r in res.items():
                if isinstance(r, dict) and "fwd_bwd_ms" in r:
                    r["speedup_vs_today"] = today["fwd_bwd_ms"] / r["fwd_bwd_ms"]
                    r["saved_activations_vs_today"] = (r["saved_bytes_hooks_activations"]
                                                       / max(today["saved_bytes_hooks_activations"], 1))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-moe-30b-a3b-proxy")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS + (["sonicmoe-default-config"]
                                                                   if os.environ.get("SONIC_SITE") else [])),
                    help=f"comma list of {list(VARIANTS)} (default: moelab's bf16 ones, and SonicMoE's default "
                         "config where SONIC_SITE is set)")
    ap.add_argument("--label", default="moe-layer", help="the record's variant and file name (LABEL.json)")
    ap.add_argument("--no-sweep", action="store_true", help="skip triton_fused's block-size sweep")
    ap.add_argument("--routings", default="skewed,balanced", help="comma list of skewed, balanced")
    ap.add_argument("--later-micro-batch", action="store_true",
                    help="time steps that add into the weights' existing gradients (a later micro batch of a step)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    T, K, E, D, F = SHAPES[args.shape] if not args.small else (64, 2, 8, 64, 32)
    reps = args.reps if dev == "cuda" else 2
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    N = T * K
    flop = 18 * N * D * F
    rec = {"system": "moelab", "workload": args.shape, "variant": args.label,
           "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch_version": torch.__version__,
           "commit": commit_id(), "command": " ".join(["python"] + sys.argv),
           "shapes": {"tokens": T, "top_k": K, "experts": E, "hidden": D, "expert_ffn": F, "dtype": str(dt)},
           "flop_fwd_bwd": flop, "results": {}, "errors": {}}
    out_name = args.label
    try:
        import triton
        rec["triton_version"] = triton.__version__
    except ImportError:
        pass
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    variants = [v for v in args.variants.split(",") if dev == "cuda" or VARIANTS[v][0] == "auto"]
    gen = torch.Generator().manual_seed(0)
    experts = GroupedExperts(E, D, F).to(dev)
    with torch.no_grad():
        experts.w_gate_up_EDF2.copy_(torch.randn(E, D, 2 * F, generator=gen) / D ** 0.5)
        experts.w_down_EFD.copy_(torch.randn(E, F, D, generator=gen) / F ** 0.5)
    experts = experts.to(dt)
    w1, w2 = experts.w_gate_up_EDF2, experts.w_down_EFD
    params = [w1, w2]
    sonic = None
    if any(VARIANTS[v][0] in SONIC_IMPLS for v in variants):
        try:
            if not os.environ.get("SONIC_SITE"):
                raise RuntimeError("SONIC_SITE (the folder SonicMoE's wheels were unpacked into) is not set")
            rec["sonicmoe_version"] = sonic_setup(os.environ["SONIC_SITE"])
            w1_s = torch.nn.Parameter(w1.detach().transpose(1, 2).contiguous())  # [E, 2F, D]: its [out, in]
            w2_s = torch.nn.Parameter(w2.detach().transpose(1, 2).contiguous())  # [E, D, F]
            sonic = (w1_s, w2_s)
        except Exception as exc:  # recorded, not fatal
            rec["errors"]["sonicmoe import"] = "".join(traceback.format_exception_only(exc)).strip()
            variants = [v for v in variants if VARIANTS[v][0] not in SONIC_IMPLS]
    own = {}
    fns = build(variants, w1, w2, E, D, F, sonic, rec, own)
    timer = StepTimer(dev)
    signal.signal(signal.SIGALRM, _alarm)
    cases = {kind: case(kind, T, K, E, D, dev, dt, gen, w1, w2) for kind in args.routings.split(",")}
    for kind in cases:
        rec["results"][kind] = {"routing": cases[kind]["loads"]}
    # moelab's variants at both routings first, then SonicMoE's (each may take the rest of the call to compile)
    phases = [[v for v in variants if VARIANTS[v][0] not in SONIC_IMPLS],
              [v for v in variants if VARIANTS[v][0] in SONIC_IMPLS]]
    for phase in phases:
        for kind, c in cases.items():
            res = rec["results"][kind]
            for name in phase:
                if name not in fns:
                    continue
                if VARIANTS[name][0] in SONIC_IMPLS:  # its first call JIT-compiles CuTe DSL kernels: bounded
                    signal.alarm(int(os.environ.get("SONIC_TIMEOUT_S", "120")))
                    print(f"[{stamp()}] moe-layer {kind} {name}: first step starts", flush=True)
                try:
                    res[name] = measure(name, fns[name], c, params, sonic, timer, reps, dev, flop,
                                        later=args.later_micro_batch, own=own)
                    print(f"[{stamp()}] moe-layer {kind} {name}: {json.dumps(res[name])}", flush=True)
                except Exception as exc:
                    rec["errors"][f"{kind} {name}"] = "".join(traceback.format_exception(exc))[-3000:]
                    print(f"[{stamp()}] moe-layer {kind} {name}: ERROR {exc!r}", flush=True)
                    if isinstance(exc, TimeoutError):
                        fns.pop(name)
                finally:
                    signal.alarm(0)
                summarise(rec)
                write(rec, args.out, out_name)  # a timeout keeps what came before
            if dev == "cuda" and kind == "skewed" and phase is phases[0]:
                res["profile: kernel ms per step (top 14)"] = {
                    name: kernel_profile(fns[name], (c["x_TD"], c["wts"], c["experts_TK"]), c["g_TD"])
                    for name in phase if name in fns}
                if "moelab-triton_fused-eager" in fns and not args.no_sweep:
                    fused_sweep(res, fns["moelab-triton_fused-eager"], c, params, timer, reps)
                write(rec, args.out, out_name)
    summarise(rec)
    write(rec, args.out, out_name)
    for kind, res in rec["results"].items():
        for name, r in res.items():
            if isinstance(r, dict) and "fwd_bwd_ms" in r:
                print(f"moe-layer {kind:8s} {name:36s} {r['fwd_bwd_ms']:7.3f} ms {r['tflops']:6.1f} TFLOP/s saved "
                      f"{r['saved_bytes_hooks_activations'] / 2**20:7.1f} MiB x{r.get('speedup_vs_today', 0):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
