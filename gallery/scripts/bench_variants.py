"""moelab's fast-path variants on ONE model (built once: initialising 5.6 B parameters takes about 45 s), each
timed with moelab.train.bench.Bencher on the trainer's real step; one JSON record per variant (gallery/perf-notes.md).

    python gallery/scripts/bench_variants.py --out DIR [--preset qwen3-moe-30b-a3b-proxy] [--set k=v ...]
        [--profile] [--skip NAME,...] [--deadline-s S]

Variants, in order (each changes the same model in place; bf16 parameters throughout): fake balanced gate and
learned router at global batch 2 (one micro batch of 2 x 4096, as the peers ran); the step without its metrics
synchronisation; global batch 16 (8 micro batches accumulated); the grouped_gemm experts backend (if installed);
the RowGather permutation and cuDNN-first attention (measured, not adopted); torch.compile per block, first with
the loss eager, then with the compiled loss, at global batch 2 and 16. --profile writes a torch.profiler table
of one eager and one compiled step.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from moelab.model.rows import dispatch_rows, inverse_permutation
from moelab.train.bench import Bencher, bench_config, commit_id
from moelab.config import load_config
from moelab.planner.flops import FLOPS_CONVENTION


def fast_dispatch(self, x_TD, experts_TK, keep_TK, num_experts):
    """LocalDispatcher.dispatch as the first session measured its 'fast-permute' variant: static-shape counts
    (scatter_add, no bincount) and the rows moved by gathers (then a script-only RowGather, now moelab.model.rows,
    which the dispatcher itself uses); keep_TK unsupported here."""
    assert keep_TK is None
    T, K = experts_TK.shape
    flat_N = experts_TK.reshape(-1)
    order_N = torch.argsort(flat_N, stable=True)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=flat_N.device).scatter_add_(
        0, flat_N, torch.ones_like(flat_N))
    inverse_N = inverse_permutation(order_N)
    return dispatch_rows(x_TD, order_N, inverse_N, K), counts_E, (order_N, inverse_N)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-moe-30b-a3b-proxy")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma-separated variant names to skip")
    ap.add_argument("--profile", action="store_true", help="profile one step uncompiled and one compiled")
    ap.add_argument("--deadline-s", type=float, default=400, help="skip remaining variants after this long")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    cfg = load_config(args.preset, ["train.dtype=bfloat16", "train.param_dtype=bfloat16",
                                    "backend.fake_balanced_gate=true", *args.overrides])
    cfg = bench_config(cfg, 200, 0)
    from moelab.train.trainer import Trainer

    tr = Trainer(cfg, tempfile.mkdtemp(prefix="moelab-variants-"))
    tr.setup()
    print(f"setup {time.perf_counter() - t_start:.1f} s", flush=True)
    b = Bencher(tr)
    skip = set(filter(None, args.skip.split(",")))
    base = {"system": "moelab", "workload": cfg.name, "gpus": 1, "gpu_name": tr.gpu_name,
            "flops_per_token": tr.flops_per_token, "flops_convention": FLOPS_CONVENTION, "peak_tflops": b.peak,
            "seq_len": cfg.train.seq_len, "micro_batch_size": cfg.train.micro_batch_size, "dtype": "bfloat16",
            "commit": commit_id(), "torch_version": torch.__version__,
            "command": " ".join(["python"] + sys.argv)}
    summary = []

    def record(name, desc, steps, warmup, metrics=True, gbs=2, **extra):
        if name in skip or time.perf_counter() - t_start > args.deadline_s:
            print(f"{name}: skipped", flush=True)
            return None
        try:
            t0 = time.perf_counter()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            r = b.measure(steps, warmup, metrics)
            router = cfg.replace(**{"backend.fake_balanced_gate": extra.get("fake_balanced_gate", False)}).backend
            r.update(base, variant=name, description=desc, global_batch_size=gbs, steps=steps, warmup=warmup,
                     peak_memory_gb=b.peak_memory_gb(), wall_s=time.perf_counter() - t0, router=router.router_kind,
                     loss=tr.model.loss_kind, optimizer=type(tr.optimizer).__name__, **extra)
        except Exception as e:  # one failing variant must not lose the others
            traceback.print_exc()
            r = {**base, "variant": name, "description": desc, "error": f"{type(e).__name__}: {e}"}
        (out / f"moelab-{name}.json").write_text(json.dumps(r, indent=1) + "\n")
        if "error" not in r:
            print(f"{name:28s} {r['tokens_per_s_per_gpu']:9,.0f} tok/s {r['tflops_per_gpu']:6.1f} TFLOP/s "
                  f"step {r['step_time_ms']:8.1f} ms  peak {r['peak_memory_gb']:5.1f} GiB", flush=True)
        summary.append(r)
        return r

    def profile(name):
        """One step under torch.profiler: the top kernels by GPU time, and GPU busy time against the step."""
        if name in skip or not args.profile or time.perf_counter() - t_start > args.deadline_s:
            return
        try:
            from torch.profiler import ProfilerActivity, profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                ms = b.run(1)[0]
            ka = prof.key_averages()
            key = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
            busy_ms = sum(getattr(e, key) for e in ka if e.device_type.name == "CUDA") / 1e3
            table = ka.table(sort_by=key, row_limit=40, max_name_column_width=70)
            text = f"profile {name}: step {ms:.1f} ms, GPU kernels {busy_ms:.1f} ms\n{table}"
            (out / f"profile-{name}.txt").write_text(text)
            print("\n".join(text.splitlines()[:28]), flush=True)
        except Exception:
            traceback.print_exc()

    record("fake-gate-gbs2", "bf16 params, fake balanced gate, global batch 2", args.steps, args.warmup,
           fake_balanced_gate=True)
    profile("eager")
    b.set_fake_gate(False)
    record("real-router-gbs2", "bf16 params, learned router, global batch 2", args.steps, 2,
           fake_balanced_gate=False)
    record("real-router-gbs2-no-metrics", "as real-router-gbs2 without the metrics synchronisation",
           args.steps, 1, metrics=False, fake_balanced_gate=False)
    # global batch 16: 8 micro batches of 2 accumulated, one optimizer step
    tr.micro_per_rank = 8  # the router losses' scale follows it (BatchContext.loss_scale)
    b.tokens_per_step = 16 * cfg.train.seq_len
    record("real-router-gbs16", "bf16 params, learned router, global batch 16 (8 micro batches)", 3, 1, gbs=16,
           fake_balanced_gate=False)
    b.set_fake_gate(True)
    record("fake-gate-gbs16", "bf16 params, fake balanced gate, global batch 16", 3, 1, gbs=16,
           fake_balanced_gate=True)
    tr.micro_per_rank = 1
    b.tokens_per_step = 2 * cfg.train.seq_len
    from moelab.backends import detected

    if detected()["grouped_gemm"]:
        for moe in tr.par.moe_layers:
            moe.experts.impl = "grouped_gemm"
        b.set_fake_gate(False)
        record("real-router-gbs2-grouped_gemm", "as real-router-gbs2 with backend.experts=grouped_gemm",
               args.steps, 2, fake_balanced_gate=False, backend_experts="grouped_gemm")
        b.set_fake_gate(True)
        record("fake-gate-gbs2-grouped_gemm", "as fake-gate-gbs2 with backend.experts=grouped_gemm",
               args.steps, 1, fake_balanced_gate=True, backend_experts="grouped_gemm")
        for moe in tr.par.moe_layers:
            moe.experts.impl = "auto"
    if "fast-permute" not in skip:
        from moelab.model.moe import LocalDispatcher

        LocalDispatcher.dispatch = fast_dispatch
        base["permute"] = "moelab.model.rows gathers + scatter_add counts (fast_dispatch)"
        b.set_fake_gate(True)
        record("fake-gate-gbs2-fast-permute", "as fake-gate-gbs2 with the RowGather permutation", args.steps, 2,
               fake_balanced_gate=True, permute="gathers (moelab.model.rows)")
    if "cudnn" not in skip:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        b.set_fake_gate(True)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                          SDPBackend.EFFICIENT_ATTENTION], set_priority=True):
            record("fake-gate-gbs2-cudnn-sdpa", "as fake-gate-gbs2 (+ fast permute) preferring cuDNN attention",
                   args.steps, 2, fake_balanced_gate=True, sdpa="cudnn first")
    if "compile" not in skip:
        from moelab.parallel.place import apply_compile

        apply_compile(tr.model, cfg.replace(**{"train.compile": True}))
        tr.model.loss_compiled = False  # the loss stays eager for the next record
        b.set_fake_gate(True)
        record("fake-gate-gbs2-compile-eager-loss", "as fake-gate-gbs2 with torch.compile per block, loss uncompiled",
               args.steps, 3, fake_balanced_gate=True, compile=True, compiled_loss=False)
        tr.cfg.train.compile = True
        tr.model.loss_compiled = True  # the model's loss compiles its work (moelab.backends.loss)
        base["compiled_loss"] = True
        b.set_fake_gate(False)
        record("real-router-gbs2-compile", "as real-router-gbs2 with torch.compile per block", args.steps, 3,
               fake_balanced_gate=False, compile=True)
        b.set_fake_gate(True)
        record("fake-gate-gbs2-compile", "as fake-gate-gbs2 with torch.compile per block", args.steps, 1,
               fake_balanced_gate=True, compile=True)
        profile("compiled")
        b.set_fake_gate(False)
        record("real-router-gbs2-compile-no-metrics", "as real-router-gbs2-compile without the metrics "
               "synchronisation", args.steps, 1, metrics=False, fake_balanced_gate=False, compile=True)
        tr.micro_per_rank = 8
        b.tokens_per_step = 16 * cfg.train.seq_len
        record("real-router-gbs16-compile", "learned router, global batch 16, torch.compile per block", 3, 1,
               gbs=16, fake_balanced_gate=False, compile=True)
        b.set_fake_gate(True)
        record("fake-gate-gbs16-compile", "fake balanced gate, global batch 16, torch.compile per block", 3, 1,
               gbs=16, fake_balanced_gate=True, compile=True)
    print(f"total {time.perf_counter() - t_start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
