"""Issue 41: one MoE layer's experts, forward + backward, at the Qwen3-30B-A3B proxy's shapes, checked and timed:
moelab's compiled path as it is today (LocalDispatcher + torch._grouped_mm experts, compiled), moelab's fused
Triton path (backend.experts=triton_fused: moelab.model.fused_experts), eager and compiled, the same saved tensors
with torch._grouped_mm (fused_experts.lean_grouped_experts), and SonicMoE when it
imports (its `moe_general_routing_inputs` on the same routing; set SONIC_SITE to the folder its wheels were
unpacked into).

    python gallery/scripts/gpu_moe_layer.py --out DIR             # writes DIR/moe-layer.json
    python gallery/scripts/gpu_moe_layer.py --out DIR --small     # small shapes (CPU: the reference paths only)

T 8192 tokens, K 8 of E 128 experts, D 2048, F 768, SwiGLU, bf16 weights and tokens, fp32 routing weights (as the
router hands them under autocast). Routing: "balanced" (every expert T*K/E rows) and "skewed" (expert popularity
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
import traceback
from pathlib import Path

import torch

from moelab.model.experts import GroupedExperts, loop_swiglu, swiglu
from moelab.model.moe import LocalDispatcher
from moelab.model.rows import combine_rows, dispatch_rows, inverse_permutation
from moelab.train.bench import StepTimer, commit_id


def routing(kind: str, T: int, K: int, E: int, gen: torch.Generator):
    if kind == "balanced":
        experts_TK = (torch.arange(T * K) % E).view(T, K)
    else:
        p_E = torch.distributions.Dirichlet(torch.full((E,), 2.0)).sample()
        experts_TK = torch.multinomial(p_E.expand(T, E), K, replacement=False, generator=gen)
    weights_TK = torch.softmax(torch.randn(T, K, generator=gen), -1)
    return weights_TK, experts_TK


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


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


def sonic_route(w1_s, w2_s, E):
    from sonicmoe import moe_general_routing_inputs
    from sonicmoe.enums import ActivationType

    def f(x_TD, weights_TK, experts_TK):
        T, K = experts_TK.shape
        tok = torch.arange(T, device=x_TD.device, dtype=torch.int32).repeat_interleave(K)
        y, _ = moe_general_routing_inputs(x_TD, weights_TK.reshape(-1), tok, experts_TK.reshape(-1).int(),
                                          w1_s.permute(1, 2, 0), None, w2_s.permute(1, 2, 0), None, E,
                                          torch.cuda.current_stream().cuda_stream, ActivationType.SWIGLU,
                                          False, True)
        return y
    return f


def write(rec: dict, out: str) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "moe-layer.json").write_text(json.dumps(rec, indent=1) + "\n")


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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    T, K, E, D, F = (8192, 8, 128, 2048, 768) if not args.small else (64, 2, 8, 64, 32)
    reps = args.reps if dev == "cuda" else 2
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    N = T * K
    flop = 18 * N * D * F
    rec = {"system": "moelab", "workload": "qwen3-moe-30b-a3b-proxy", "variant": "moe-layer",
           "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch_version": torch.__version__,
           "commit": commit_id(), "command": " ".join(["python"] + sys.argv),
           "shapes": {"tokens": T, "top_k": K, "experts": E, "hidden": D, "expert_ffn": F, "dtype": str(dt)},
           "flop_fwd_bwd": flop, "results": {}, "errors": {}}
    try:
        import triton
        rec["triton_version"] = triton.__version__
    except ImportError:
        pass
    gen = torch.Generator().manual_seed(0)
    experts = GroupedExperts(E, D, F).to(dev)
    with torch.no_grad():
        experts.w_gate_up_EDF2.copy_(torch.randn(E, D, 2 * F, generator=gen) / D ** 0.5)
        experts.w_down_EFD.copy_(torch.randn(E, F, D, generator=gen) / F ** 0.5)
    experts = experts.to(dt)
    w1, w2 = experts.w_gate_up_EDF2, experts.w_down_EFD
    params = [w1, w2]
    variants = {"moelab-grouped_mm-eager": ("auto", False), "moelab-grouped_mm-compiled": ("auto", True)}
    if dev == "cuda":
        variants.update({"moelab-triton_fused-eager": ("triton_fused", False),
                         "moelab-triton_fused-compiled": ("triton_fused", True),
                         "moelab-lean_grouped_mm-eager": ("lean", False),
                         "moelab-lean_grouped_mm-compiled": ("lean", True)})
    sonic = None
    if dev == "cuda" and os.environ.get("SONIC_SITE"):
        import site
        site.addsitedir(os.environ["SONIC_SITE"])  # with its .pth files (nvidia_cutlass_dsl's python_packages)
        try:
            import sonicmoe
            rec["sonicmoe_version"] = sonicmoe.__version__
            w1_s = torch.nn.Parameter(w1.detach().transpose(1, 2).contiguous())  # [E, 2F, D]: its [out, in]
            w2_s = torch.nn.Parameter(w2.detach().transpose(1, 2).contiguous())  # [E, D, F]
            sonic = (w1_s, w2_s)
            variants["sonicmoe"] = ("sonic", False)
        except Exception as exc:  # recorded, not fatal
            rec["errors"]["sonicmoe import"] = "".join(traceback.format_exception_only(exc)).strip()
    fns = {}  # each compiled once (the shapes do not change between routings)
    for name, (impl, compiled) in variants.items():
        if impl == "sonic":
            fns[name] = sonic_route(*sonic, E)
            continue
        if impl == "lean":
            fn = lean_route(w1, w2, E)
        else:
            by_impl = GroupedExperts(E, D, F, impl=impl)  # sharing the weights
            by_impl.w_gate_up_EDF2, by_impl.w_down_EFD = w1, w2
            fn = moelab_route(by_impl)
        fns[name] = torch.compile(fn) if compiled else fn
    timer = StepTimer(dev)
    signal.signal(signal.SIGALRM, _alarm)
    for kind in ("skewed", "balanced"):
        weights_TK, experts_TK = routing(kind, T, K, E, gen)
        weights_TK, experts_TK = weights_TK.to(dev), experts_TK.to(dev)
        x_TD = (torch.randn(T, D, generator=gen)).to(dev, dt).requires_grad_()
        wts = weights_TK.clone().requires_grad_()
        g_TD = torch.randn(T, D, generator=gen).to(dev)
        counts = torch.bincount(experts_TK.reshape(-1), minlength=E)
        loads = {"max_rows_per_expert": int(counts.max()), "min_rows_per_expert": int(counts.min())}
        # fp32 reference: the per-expert loop on fp32 copies
        xr, wr = x_TD.detach().float().requires_grad_(), weights_TK.clone().requires_grad_()
        w1r, w2r = w1.detach().float().requires_grad_(), w2.detach().float().requires_grad_()
        order = torch.argsort(experts_TK.reshape(-1), stable=True)
        inv = inverse_permutation(order)
        y_ref = combine_rows(loop_swiglu(dispatch_rows(xr, order, inv, K), w1r, w2r, counts, act=swiglu,
                                         scale_N=wr.reshape(-1)[order]), order, inv, K)
        y_ref.backward(g_TD)
        ref = {"y": y_ref.detach(), "dx": xr.grad, "dweights": wr.grad, "dw_gate_up": w1r.grad, "dw_down": w2r.grad}
        res = rec["results"][kind] = {"routing": loads}
        for name, (impl, compiled) in list(variants.items()):
            if impl == "sonic":  # its first call JIT-compiles CuTe DSL kernels: bounded (call 2 hung > 300 s here)
                signal.alarm(int(os.environ.get("SONIC_TIMEOUT_S", "120")))
            try:
                f = fns[name]
                leaves = [x_TD, wts, *(sonic if impl == "sonic" else params)]

                def step(_=0):
                    for t in leaves:
                        t.grad = None
                    y = f(x_TD, wts, experts_TK)
                    y.backward(g_TD.to(y.dtype))
                    return y
                y = step()
                grads = [t.grad for t in leaves]
                if impl == "sonic":  # its weights are [out, in]
                    grads[2], grads[3] = grads[2].transpose(1, 2), grads[3].transpose(1, 2)
                errs = {k: rel(v, ref[k]) for k, v in zip(ref, [y.detach()] + grads)}
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
                r = {"fwd_bwd_ms": ms, "tflops": flop / (ms * 1e-3) / 1e12, "rel_err_vs_fp32": errs,
                     "saved_bytes_hooks_total": saved.total, "saved_bytes_hooks_activations": saved.activations,
                     "saved_bytes_allocator": grown}
                res[name] = r
                print(f"moe-layer {kind} {name}: {json.dumps(r)}", flush=True)
                write(rec, args.out)  # a timeout keeps what came before
            except Exception as exc:
                rec["errors"][f"{kind} {name}"] = "".join(traceback.format_exception(exc))[-3000:]
                print(f"moe-layer {kind} {name}: ERROR {exc!r}", flush=True)
                if isinstance(exc, TimeoutError):
                    variants.pop(name)
            finally:
                signal.alarm(0)
        if dev == "cuda" and kind == "skewed":  # where the time goes: CUDA kernel time per kernel name, one step
            res["profile: kernel ms per step (top 14)"] = {name: kernel_profile(fns[name], (x_TD, wts, experts_TK),
                                                                                 g_TD) for name in fns
                                                         if name != "sonicmoe"}
        if dev == "cuda" and kind == "skewed" and "moelab-triton_fused-eager" in fns:  # block sizes, eager
            sweep = res["fused_block_sweep (BM,BN,BK,warps,stages): fwd_bwd_ms"] = {}
            for blocks in ("128,128,64,8,3", "128,128,64,8,4", "128,128,32,8,4", "64,128,64,4,3"):
                os.environ["MOELAB_FUSED_BLOCKS"] = blocks

                def fused_step(_=0, f=fns["moelab-triton_fused-eager"]):
                    for t in (x_TD, wts, *params):
                        t.grad = None
                    f(x_TD, wts, experts_TK).backward(g_TD)
                try:
                    fused_step()
                    sweep[blocks] = statistics.median(timer.time(fused_step, reps))
                except Exception as exc:
                    sweep[blocks] = f"{type(exc).__name__}: {str(exc)[:200]}"
                print(f"moe-layer sweep {blocks}: {sweep[blocks]}", flush=True)
            del os.environ["MOELAB_FUSED_BLOCKS"]
        base = res.get("moelab-grouped_mm-eager", {}).get("rel_err_vs_fp32")
        for name, r in res.items():
            if name.startswith("moelab-triton_fused") and base:
                r["within_2x_bf16_path_error"] = all(r["rel_err_vs_fp32"][k] <= 2 * base[k] + 1e-6 for k in base)
        today = res.get("moelab-grouped_mm-compiled")
        if today:
            for name, r in res.items():
                if isinstance(r, dict) and "fwd_bwd_ms" in r:
                    r["speedup_vs_today"] = today["fwd_bwd_ms"] / r["fwd_bwd_ms"]
                    r["saved_activations_vs_today"] = (r["saved_bytes_hooks_activations"]
                                                       / max(today["saved_bytes_hooks_activations"], 1))
    write(rec, args.out)
    for kind, res in rec["results"].items():
        for name, r in res.items():
            if isinstance(r, dict) and "fwd_bwd_ms" in r:
                print(f"moe-layer {kind:8s} {name:30s} {r['fwd_bwd_ms']:7.3f} ms {r['tflops']:6.1f} TFLOP/s saved "
                      f"{r['saved_bytes_hooks_activations'] / 2**20:7.1f} MiB x{r.get('speedup_vs_today', 0):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
