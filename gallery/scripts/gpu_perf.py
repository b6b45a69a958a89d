"""moelab's side of the issue-17 GPU call (gallery/scripts/gpu_perf.sh): throughput records, a profile summary
and the FP8 loss-parity curves.

    python gallery/scripts/gpu_perf.py bench  --out DIR [--fp8 off,rowwise] [--gbs 2,16] [--profile] [--set k=v]
    python gallery/scripts/gpu_perf.py bench  --out DIR --losses chunked,full,liger,cce --mbs 2,4 --gbs 4,16
    python gallery/scripts/gpu_perf.py bench  --out DIR --set backend.experts=grouped_mm --tag bf16-grouped_mm \
        --loss-steps 3     # another experts backend; the first 3 steps' losses in each record (one seed)
    python gallery/scripts/gpu_perf.py parity --out DIR [--steps 300] [--fp8 off,rowwise] [--set k=v]
    python gallery/scripts/gpu_perf.py table  DIR          # the short table of every record under DIR
    python gallery/scripts/gpu_perf.py bench --dry-run ...  # the same code paths on CPU with the tiny preset

bench: the Qwen3-30B-A3B proxy (seq 4096, micro batch 2, learned router, bf16 parameters, train.compile=true),
built once, timed with moelab.train.bench.Bencher on the trainer's real step at each global batch, first in bf16
(--triton-adamw: again with moelab.train.adamw_triton's optimizer, then back to torch's), then converted in
place to each FP8 mode (compile caches reset, blocks recompiled); one JSON record per mode and
global batch (moelab.train.bench's fields plus fp8, compile, variant, router, loss, optimizer, experts: the
experts backend the run took, auto's choice resolved). --losses / --mbs: the bf16
step again with each LM-head loss (backend.loss, switched in place on the built model; liger / cce only where
their packages import) at each micro batch (the global batches of --gbs that it divides), each record with its
peak memory. --profile: one compiled step under
torch.profiler, kernels summed by category (matmul, attention, optimizer, elementwise, permute, comm, other).
parity: a smaller learnable workload (the proxy's structure at hidden 1024, 4 layers, 32 experts top 4, vocab
8192, the synthetic Markov data, seq 1024, global batch 8, eager, fp32 master weights + bf16 autocast) trained `--steps` steps from the same seed; the
loss curve is written to DIR/parity-<fp8>.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from moelab.backends import full_loss, loss_kernel, sonic, sonic_squares
from moelab.data import transfer
from moelab.train import adamw_triton
from moelab.train.bench import Bencher, bench_config, commit_id
from moelab.config import load_config
from moelab.planner.flops import FLOPS_CONVENTION

PRESET = "qwen3-moe-30b-a3b-proxy"
BENCH_SET = ["train.dtype=bfloat16", "train.param_dtype=bfloat16", "train.compile=true",
             "backend.fake_balanced_gate=false", "train.seq_len=4096", "train.micro_batch_size=2",
             "train.global_batch_size=2", "train.save_checkpoints=false"]
DRY_SET = ["train.compile=false", "train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=2",
           "train.save_checkpoints=false"]
PARITY_SET = ["model.hidden_size=1024", "model.num_layers=4", "model.num_heads=16", "model.num_kv_heads=4",
              "model.head_dim=64", "model.vocab_size=8192", "model.moe.num_experts=32", "model.moe.top_k=4",
              "model.moe.expert_ffn_size=512", "train.seq_len=1024", "train.micro_batch_size=8",
              "train.global_batch_size=8", "train.lr=0.001", "train.warmup_steps=20", "train.grad_clip=1.0",
              "train.dtype=bfloat16", "train.param_dtype=float32", "data.kind=synthetic", "train.seed=0",
              "train.save_checkpoints=false", "train.checkpoint_every=0", "parallel.ep=1"]

# Kernel-name patterns -> category, first match wins (CUDA kernel names as torch.profiler reports them).
CATEGORIES = [
    ("comm", r"nccl|all_?reduce|all_?gather|reduce_?scatter|alltoall|all_to_all"),
    ("attention", r"flash|fmha|attention|sdpa|cudnn.*mha|_efficient_attention"),
    ("optimizer", r"adam|fused_.*optim|multi_tensor_apply|foreach|_amp_foreach|lpnorm|clip"),
    ("matmul", r"gemm|aten::mm|addmm|bmm|sm90_xmma|cutlass|cublas|nvjet|matmul|_mm_|grouped_mm|scaled_mm|wgmma|sm80_xmma"),
    ("permute", r"index|gather|scatter|sort|radix|cumsum|searchsorted|histogram|bincount|embedding|take|put_"),
    ("elementwise", r"triton|elementwise|vectorized|reduce|copy|fill|cast|softmax|norm|silu|mul|add|where|cat"),
]


def categorize(name: str) -> str:
    low = name.lower()
    for cat, pat in CATEGORIES:
        if re.search(pat, low):
            return cat
    return "other"


def is_annotation(name: str) -> bool:
    """A user annotation's range on the GPU timeline (`Optimizer.step#AdamW.step`, `ProfilerStep#1`), not a
    kernel: it spans kernels already counted (the first call summed the optimizer twice, 29.9 + 29.3 ms)."""
    return "#" in name or name.startswith(("ProfilerStep", "Optimizer."))


def summarize_kernels(kernels: list[tuple[str, float]], step_ms: float, top: int = 40) -> dict:
    """kernels: (name, self device ms) for one step -> totals per category, the top kernels, idle time
    (annotations left out)."""
    kernels = [(n, ms) for n, ms in kernels if not is_annotation(n)]
    by_cat: dict[str, float] = {}
    for name, ms in kernels:
        by_cat[categorize(name)] = by_cat.get(categorize(name), 0.0) + ms
    busy = sum(by_cat.values())
    ranked = sorted(kernels, key=lambda k: -k[1])[:top]
    return {"step_ms": step_ms, "gpu_busy_ms": busy, "idle_ms": max(step_ms - busy, 0.0),
            "by_category_ms": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"name": n[:160], "ms": round(ms, 4), "category": categorize(n)} for n, ms in ranked]}


def profile_step(b: Bencher) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    b.tr.join_optimizer()  # train.optimizer_overlap: the step before ends outside the profile
    with profile(activities=acts) as prof:
        ms = b.run(1)[0]
        if getattr(b.tr, "overlap", None) is not None and torch.cuda.is_available():
            # the step's own optimizer ran beside the main stream after its last event: the step is timed to
            # the end of both (one step alone, no next forward to overlap with)
            end = torch.cuda.Event(enable_timing=True)
            b.tr.join_optimizer()
            end.record()
            end.synchronize()
            ms += b.timer.last_end.elapsed_time(end)
    kernels = []
    for e in prof.key_averages():
        if torch.cuda.is_available():
            if e.device_type.name != "CUDA":
                continue
            t = getattr(e, "self_device_time_total", None)
            t = getattr(e, "self_cuda_time_total", 0) if t is None else t
        else:  # --dry-run: CPU ops stand in for kernels
            t = e.self_cpu_time_total
        if t:
            kernels.append((e.key, t / 1e3))
    if os.environ.get("MOELAB_PROFILE_TRACE"):  # a folder: the step's whole timeline, for chrome://tracing
        trace = Path(os.environ["MOELAB_PROFILE_TRACE"])
        trace.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace / f"trace-gbs{b.tr.cfg.train.global_batch_size}.json"))
    events = prof.events()
    return {**summarize_kernels(kernels, ms), "idle_gaps": idle_gaps(events), "host_at_gaps": host_at_gaps(events)}


def idle_gaps(events, top: int = 12) -> dict:
    """Where the GPU waits within the profiled step: the gaps between consecutive kernels (annotations left out),
    counted by size, and the largest with the kernels on either side (names cut to 80 characters)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.device_type.name == "CUDA" and not is_annotation(e.name))
    gaps, end, prev = [], None, ""
    for start, stop, name in spans:
        if end is not None and start > end:
            gaps.append(((start - end) / 1e3, prev[:80], name[:80]))
        if end is None or stop >= end:
            end, prev = stop, name
    sizes = {"under_20us": (0, 0.02), "20us_to_100us": (0.02, 0.1), "100us_to_1ms": (0.1, 1.0),
             "over_1ms": (1.0, 1e9)}
    return {"total_ms": sum(g for g, _, _ in gaps),
            "by_size": {k: {"count": sum(lo <= g < hi for g, _, _ in gaps),
                            "ms": sum(g for g, _, _ in gaps if lo <= g < hi)} for k, (lo, hi) in sizes.items()},
            "largest": [{"ms": round(g, 4), "after": a, "before": b} for g, a, b in sorted(gaps, reverse=True)[:top]]}


def host_at_gaps(events, min_ms: float = 0.02, top: int = 12) -> dict:
    """What the host was doing while the GPU waited: for each gap of at least min_ms between kernels, the CPU
    ops running at its midpoint on each thread (outermost and innermost; "between ops" where a thread that ran
    ops in the step ran none then: Python of its own). Summed over the step's gaps by innermost op and by
    outermost > innermost chain, the largest first. A gap while the host waits on the GPU
    (cudaStreamSynchronize, a blocking copy) is a synchronisation; one inside launches and Python is the host
    falling behind."""
    cuda = sorted((e.time_range.start, e.time_range.end) for e in events
                  if e.device_type.name == "CUDA" and not is_annotation(e.name))
    gaps, end = [], None
    for start, stop in cuda:
        if end is not None and (start - end) / 1e3 >= min_ms:
            gaps.append((end, start))
        end = stop if end is None else max(end, stop)
    by_thread: dict[int, list] = {}
    for e in events:
        if e.device_type.name == "CPU" and e.time_range.end > e.time_range.start:
            by_thread.setdefault(e.thread, []).append((e.time_range.start, e.time_range.end, e.name))
    mids = sorted(((a + b) / 2, (b - a) / 1e3) for a, b in gaps)
    inner: dict[str, float] = {}
    chain: dict[str, float] = {}
    at: dict[float, list] = {mid: [] for mid, _ in mids}  # each gap: the host, thread by thread
    for thread, spans in by_thread.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        first, last, label = spans[0][0], max(s[1] for s in spans), f"thread {thread % 10000}"
        stack, i = [], 0
        for mid, ms in mids:  # one sweep: the spans open at each gap's midpoint
            while i < len(spans) and spans[i][0] <= mid:
                stack.append(spans[i])
                i += 1
            stack = [s for s in stack if s[1] >= mid]
            if not first <= mid <= last:
                continue  # the thread ran none of the step's ops around then
            name = stack[-1][2][:80] if stack else "between ops"
            key = f"{stack[0][2][:60]} > {stack[-1][2][:60]}" if stack else "between ops"
            inner[f"{label}: {name}"] = inner.get(f"{label}: {name}", 0.0) + ms
            chain[f"{label}: {key}"] = chain.get(f"{label}: {key}", 0.0) + ms
            at[mid].append(f"{label}: {key}")
    rank = lambda d: [{"ms": round(v, 3), "host": k} for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]
    return {"gaps": len(gaps), "gap_ms": round(sum((b - a) / 1e3 for a, b in gaps), 3),
            "by_innermost": rank(inner), "by_chain": rank(chain),
            "largest": [{"ms": round(ms, 3), "host": at[mid]} for mid, ms in sorted(mids, key=lambda m: -m[1])[:top]]}


def base_record(tr, b, args, fp8: str) -> dict:
    t, backend = tr.cfg.train, tr.cfg.backend
    return {"system": "moelab", "workload": tr.cfg.name, "gpus": 1, "gpu_name": tr.gpu_name,
            "flops_per_token": tr.flops_per_token, "flops_convention": FLOPS_CONVENTION, "peak_tflops": b.peak,
            "seq_len": t.seq_len, "micro_batch_size": t.micro_batch_size, "dtype": "bfloat16",
            "param_dtype": t.param_dtype, "compile": t.compile, "fp8": fp8, "router": backend.router_kind,
            "fake_balanced_gate": backend.fake_balanced_gate, "fake_gate_noise": backend.fake_gate_noise,
            "loss": getattr(tr.model, "loss_kind", backend.loss), "loss_chunk_tokens": backend.loss_chunk_tokens,
            "experts": getattr(tr.model, "backends", {}).get("experts", backend.experts),
            "attention": getattr(tr.model, "backends", {}).get("attention", backend.attention),
            "optimizer": type(tr.optimizer).__name__, "optimizer_overlap": getattr(tr, "overlap", None) is not None,
            "norm_in_gemms": sonic_squares.ENABLED,  # the experts' gradient squares summed by their GEMMs
            "sonic_add": sonic.add_via(),  # how SonicMoE's weight-gradient GEMMs add into .grad
            "loss_in_place": full_loss.IN_PLACE,  # backend.loss=full's in-place kernel (moelab.backends.loss_kernel)
            "loss_kernel": loss_kernel.config_name(),  # its block, warps, programs per SM and L2 hints
            "adamw_kernel": f"{adamw_triton.BLOCK}x{adamw_triton.WARPS}",  # TritonAdamW's block and warps
            "batch_copy": "pinned" if transfer.PINNED else "pageable",  # moelab.data.transfer.to_device
            "grad_clip": t.grad_clip,  # and whether clipping's multiply ran in TritonAdamW's update (clip_in_step)
            "clip_in_update": t.grad_clip > 0 and getattr(tr.optimizer, "clip_in_step", None) is not None,
            "commit": commit_id(), "torch_version": torch.__version__,
            "command": " ".join(["python"] + sys.argv),
            **({"sonic_tiles": json.loads(Path(os.environ["MOELAB_SONIC_TILES"]).read_text())}  # a measured choice
               if os.environ.get("MOELAB_SONIC_TILES") else {})}


@contextlib.contextmanager
def kernel_trial(loss: str | None, adamw: str | None):
    """The in-place loss kernel at `loss` (moelab.backends.loss_kernel.config_name's form) and TritonAdamW's
    kernel at `adamw` ("BLOCKxWARPS") inside the block; today's settings after it."""
    before = loss_kernel.config_name(), (adamw_triton.BLOCK, adamw_triton.WARPS)
    try:
        if loss:
            loss_kernel.set_config(loss)
        if adamw:
            adamw_triton.BLOCK, adamw_triton.WARPS = (int(x) for x in adamw.split("x"))
        yield
    finally:
        loss_kernel.set_config(before[0])
        adamw_triton.BLOCK, adamw_triton.WARPS = before[1]


def switch_to_fp8(tr, mode: str, dry_run: bool) -> None:
    """Convert the built (and compiled) model to train.fp8=mode in place: torch's compile caches are dropped
    first, so every block is recompiled with the FP8 modules (no stale bf16 graph can run)."""
    from moelab.model.fp8_convert import check_fp8, enable_fp8

    cfg = tr.cfg.replace(**{"train.fp8": mode}) if not dry_run else tr.cfg
    if not dry_run:  # CPU (dry run): the config refuses FP8; convert anyway to run the emulation
        check_fp8(cfg, tr.env.device)
    torch._dynamo.reset()
    enable_fp8(tr.model, lm_head=mode == "rowwise_lm_head")
    if mode == "rowwise_lm_head":  # the FP8 head is the GEMM of the full-logits loss (config rule of train.fp8)
        tr.model.loss_kind = "full"
    tr.cfg.train.fp8 = mode  # the trainer's step now runs as train.fp8=mode (expert weights cached per step)


def cmd_bench(args) -> None:
    """One model, built once; each FP8 mode of --fp8 in turn (off first), each global batch of --gbs."""
    from moelab.train.trainer import Trainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = args.fp8.split(",")
    cfg = load_config("tiny" if args.dry_run else PRESET, (DRY_SET if args.dry_run else BENCH_SET) + args.overrides)
    cfg = bench_config(cfg, 400, 0)
    t0 = time.perf_counter()
    tr = Trainer(cfg, tempfile.mkdtemp(prefix="moelab-perf-"))
    tr.setup()
    print(f"setup {time.perf_counter() - t0:.1f} s", flush=True)
    b = Bencher(tr)
    if args.loss_steps:  # the first steps' losses (global batch 2, the warm-up): one seed, so processes compare
        b.set_global_batch(2 if not args.dry_run else tr.cfg.train.global_batch_size)
        t1 = time.perf_counter()
        args.first_losses = [tr.train_step(b.next_step + i)["loss"] for i in range(args.loss_steps)]
        b.next_step += args.loss_steps
        print(f"first losses {[round(x, 5) for x in args.first_losses]} ({time.perf_counter() - t1:.1f} s, "
              f"compiles included)", flush=True)
    for mode in modes:
        if mode == "off" and args.losses:  # the LM-head losses x micro batches (the optimizer: train.optimizer's)
            bench_losses(tr, b, args, out)
            continue
        if mode == "off" and args.overlap_off:  # the same model and step without train.optimizer_overlap
            bench_mode(tr, b, args, mode, out)
            if args.loss_kernel_trial or args.adamw_trial:  # the kernels' settings the checks found fastest
                with kernel_trial(args.loss_kernel_trial, args.adamw_trial):
                    bench_mode(tr, b, args, mode, out, tag="bf16-trial", profile=False)
            if args.pageable_trial:  # the micro batches copied from pageable memory (before to_device pinned them)
                transfer.PINNED = False
                bench_mode(tr, b, args, mode, out, tag="bf16-pageable", profile=False)
                transfer.PINNED = True
            if tr.overlap is not None:
                full_loss.IN_PLACE = False  # the compiled full loss (before the in-place kernel)
                bench_mode(tr, b, args, mode, out, tag="bf16-loss-compiled", profile=False)
                full_loss.IN_PLACE = True
                tr.overlap.remove()
                tr.overlap = None
                bench_mode(tr, b, args, mode, out, tag="bf16-no-overlap", profile=False)
            continue
        if mode == "off" and args.clip:  # the same model clipping at train.grad_clip=CLIP, the multiply in the
            bench_mode(tr, b, args, mode, out)  # update (today's) and as its own pass over the gradients
            before, tr.cfg.train.grad_clip = tr.cfg.train.grad_clip, float(args.clip)
            bench_mode(tr, b, args, mode, out, tag="bf16-clip", profile=False)
            tr.optimizer.clip_in_step = None  # the trainer's path for an optimizer without it: the multiply pass
            bench_mode(tr, b, args, mode, out, tag="bf16-clip-pass", profile=False)
            del tr.optimizer.clip_in_step
            tr.cfg.train.grad_clip = before  # the modes after it (--fp8 off,rowwise) at the preset's clipping
            continue
        if mode == "off" and args.triton_adamw:  # the same model and step with the other AdamW
            from moelab.train.adamw_triton import TritonAdamW, use_triton_adamw

            bench_mode(tr, b, args, mode, out)
            was_triton = isinstance(tr.optimizer, TritonAdamW)
            if was_triton:
                tr.optimizer.__class__ = torch.optim.AdamW
            else:
                use_triton_adamw(tr.optimizer)
            bench_mode(tr, b, args, mode, out, tag="bf16-torch-adamw" if was_triton else "bf16-triton-adamw",
                       profile=False, gbs_list=args.triton_gbs)
            if was_triton:
                use_triton_adamw(tr.optimizer)
            else:
                tr.optimizer.__class__ = torch.optim.AdamW
            continue
        if mode != "off":
            try:
                switch_to_fp8(tr, mode, args.dry_run)
            except Exception as e:  # noqa: BLE001 (recorded; the bf16 records stand)
                traceback.print_exc()
                (out / f"moelab-fp8-{mode}-error.json").write_text(json.dumps(
                    {**base_record(tr, b, args, mode), "variant": f"fp8-{mode}", "global_batch_size": 0,
                     "error": f"{type(e).__name__}: {str(e)[:500]}"}, indent=1) + "\n")
                continue
        bench_mode(tr, b, args, mode, out)


def set_micro_batch(tr, mbs: int) -> None:
    """Train the built model at another micro batch (the compiled blocks recompile for the new shape)."""
    tr.cfg.train.micro_batch_size = mbs
    if tr.env.is_cuda:
        torch.cuda.empty_cache()


def bench_losses(tr, b, args, out: Path) -> None:
    """bf16 records for each LM-head loss of --losses at each micro batch of --mbs and each global batch of --gbs
    it divides; a loss whose package is missing gets an error record saying so."""
    from moelab.backends import check_backends

    first_mbs, first_chunk = tr.cfg.train.micro_batch_size, tr.model.loss_chunk_tokens
    for spec in args.losses.split(","):
        loss, _, chunk = spec.partition("@")
        tr.model.loss_chunk_tokens = tr.cfg.backend.loss_chunk_tokens = int(chunk) if chunk else first_chunk
        set_micro_batch(tr, first_mbs)  # the config as built, for the switchboard's check
        try:
            kind = check_backends(tr.cfg.replace(**{"backend.loss": loss}), tr.env.device)["loss"]
        except Exception as e:  # noqa: BLE001 (liger / cce not installed here: recorded)
            (out / f"moelab-bf16-loss{loss}-error.json").write_text(json.dumps(
                {**base_record(tr, b, args, "off"), "loss": loss, "variant": f"bf16-loss{loss}",
                 "global_batch_size": 0, "error": f"{type(e).__name__}: {str(e)[:500]}"}, indent=1) + "\n")
            print(f"moelab loss {loss}: {e}", flush=True)
            continue
        tr.model.loss_kind = kind
        for mbs in [int(m) for m in (args.mbs or str(first_mbs)).split(",")]:
            set_micro_batch(tr, mbs)
            gbs_list = ",".join(g for g in args.gbs.split(",") if int(g) % mbs == 0)
            if gbs_list:
                bench_mode(tr, b, args, "off", out, tag=f"bf16-loss{loss}{chunk and '-chunk' + chunk}-mbs{mbs}",
                           profile=False, gbs_list=gbs_list)
    set_micro_batch(tr, first_mbs)
    tr.model.loss_chunk_tokens = tr.cfg.backend.loss_chunk_tokens = first_chunk
    tr.model.loss_kind = tr.cfg.backend.loss


def bench_mode(tr, b, args, mode: str, out: Path, tag: str | None = None, profile: bool = True,
               gbs_list: str | None = None) -> None:
    tag = tag or ((args.tag or "bf16") if mode == "off" else f"fp8-{mode}")
    for gbs in [int(g) for g in (gbs_list or args.gbs).split(",")]:
        steps, warmup = (args.steps, args.warmup) if gbs <= 4 else (max(2, args.steps // 2), 1)
        name = f"{tag}-compile-gbs{gbs}" if tr.cfg.train.compile else f"{tag}-gbs{gbs}"
        rec = {**base_record(tr, b, args, mode), "variant": name, "global_batch_size": gbs,
               "steps": steps, "warmup": warmup, "first_losses_gbs2": getattr(args, "first_losses", None)}
        try:
            b.set_global_batch(gbs)
            if tr.env.is_cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t1 = time.perf_counter()
            rec.update(b.measure(steps, warmup), peak_memory_gb=b.peak_memory_gb(),
                       wall_s=time.perf_counter() - t1)
            if mode != "off":
                from moelab.model.fp8_cache import ExpertWeightCache

                rec["fp8_expert_weight_cache"] = {"refreshes_so_far": ExpertWeightCache.refreshes,
                                                  "error": ExpertWeightCache.error}
            print(f"moelab {name:24s} {rec['tokens_per_s_per_gpu']:9,.0f} tok/s {rec['tflops_per_gpu']:6.1f} "
                  f"TFLOP/s step {rec['step_time_ms']:8.1f} ms peak {rec['peak_memory_gb']:5.1f} GiB", flush=True)
        except Exception as e:  # noqa: BLE001 (one failing size must not lose the others)
            traceback.print_exc()
            rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        (out / f"moelab-{name}.json").write_text(json.dumps(rec, indent=1) + "\n")
        if args.profile and profile and str(gbs) in args.profile_gbs.split(",") and "error" not in rec:
            try:
                prof = {**base_record(tr, b, args, mode), "variant": f"profile-{name}",
                        "global_batch_size": gbs, **profile_step(b)}
                (out / f"profile-moelab-{name}.json").write_text(json.dumps(prof, indent=1) + "\n")
                print(format_profile(prof), flush=True)
            except Exception:  # noqa: BLE001
                traceback.print_exc()


def format_profile(p: dict) -> str:
    lines = [f"profile {p['variant']}: step {p['step_ms']:.1f} ms, kernels {p['gpu_busy_ms']:.1f} ms, "
             f"idle {p['idle_ms']:.1f} ms"]
    lines += [f"  {k:12s} {v:8.2f} ms" for k, v in p["by_category_ms"].items()]
    lines += [f"  {k['ms']:8.3f} ms  {k['category']:11s} {k['name'][:90]}" for k in p["top_kernels"][:15]]
    gaps = p.get("idle_gaps")
    if gaps:
        lines += [f"  gaps between kernels {gaps['total_ms']:.2f} ms: " + ", ".join(
            f"{k} {v['count']} ({v['ms']:.2f} ms)" for k, v in gaps["by_size"].items())]
        lines += [f"  gap {g['ms']:7.3f} ms after {g['after'][:50]} before {g['before'][:50]}"
                  for g in gaps["largest"][:6]]
    return "\n".join(lines)


def cmd_parity(args) -> None:
    """Each FP8 mode of --fp8 trains the same workload from the same seed in turn (one process)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for mode in args.fp8.split(","):
        parity_run(args, mode, out)


def parity_run(args, mode: str, out: Path) -> None:
    from moelab.train.trainer import Trainer

    over = PARITY_SET + [f"train.steps={args.steps}", f"train.fp8={mode}"] + args.overrides
    if args.dry_run:
        over = ["train.steps=%d" % args.steps, "train.save_checkpoints=false", "data.kind=synthetic"]
    cfg = load_config("tiny" if args.dry_run else PRESET, over)
    run_dir = tempfile.mkdtemp(prefix="moelab-parity-")
    t0 = time.perf_counter()
    rec = {"system": "moelab", "workload": f"{PRESET}-parity-small", "variant": f"parity-fp8-{mode}", "fp8": mode,
           "config": cfg.to_dict(), "commit": commit_id(), "torch_version": torch.__version__,
           "command": " ".join(["python"] + sys.argv)}
    try:
        summary = Trainer(cfg, run_dir).run()
        steps = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        steps = [s for s in steps if s.get("event") == "step"]
        rec.update(losses=[s["loss"] for s in steps], grad_norms=[s.get("grad_norm") for s in steps],
                   step_times_s=[s.get("step_time_s") for s in steps], status=summary.get("status"),
                   wall_s=time.perf_counter() - t0)
        last = rec["losses"][-20:]
        rec["final_loss_mean20"] = statistics.mean(last) if last else None
        print(f"parity fp8={mode}: {len(rec['losses'])} steps, first {rec['losses'][0]:.4f}, final (mean of "
              f"last 20) {rec['final_loss_mean20']:.4f}, {rec['wall_s']:.0f} s", flush=True)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
    (out / f"parity-{mode}.json").write_text(json.dumps(rec, indent=1) + "\n")


def table_rows(records: list[dict]) -> list[str]:
    rows = [f"{'system':16s} {'variant':58s} {'gbs':>4s} {'tok/s':>9s} {'TFLOPs':>7s} {'GiB':>6s}"]
    for r in records:
        if "parity" in str(r.get("variant", "")):
            if "losses" in r and r["losses"]:
                rows.append(f"{'parity':16s} {r['variant']:58s} {len(r['losses']):4d} steps, final "
                            f"{r['final_loss_mean20']:.4f}")
            else:
                rows.append(f"{'parity':16s} {r['variant']:58s} ERROR {r.get('error', '?')[:60]}")
            continue
        if "tokens_per_s_per_gpu" not in r and "error" not in r:
            continue
        v = str(r.get("variant", ""))[:58]
        head = f"{r.get('system', '?'):16s} {v:58s} {r.get('global_batch_size', 0):4d}"
        if "error" in r:
            rows.append(f"{head} ERROR {r['error'][:70]}")
        else:
            rows.append(f"{head} {r['tokens_per_s_per_gpu']:9,.0f} {r['tflops_per_gpu']:7.1f} "
                        f"{r.get('peak_memory_gb', 0):6.1f}")
    return rows


def cmd_table(args) -> None:
    records = []
    for p in sorted(Path(args.dir).glob("*.json")):
        try:
            records.append(json.loads(p.read_text()))
        except ValueError:
            pass
    print("\n".join(table_rows(records)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("bench", "parity"):
        p = sub.add_parser(name)
        p.add_argument("--out", required=True)
        p.add_argument("--fp8", default="off", help="off, rowwise, or several in turn: off,rowwise")
        p.add_argument("--set", dest="overrides", action="append", default=[])
        p.add_argument("--dry-run", action="store_true", help="tiny preset on CPU (checks the code paths)")
        if name == "bench":
            p.add_argument("--gbs", default="2,16")
            p.add_argument("--steps", type=int, default=6)
            p.add_argument("--warmup", type=int, default=3)
            p.add_argument("--profile", action="store_true")
            p.add_argument("--profile-gbs", default="2", help="the global batches --profile profiles, e.g. 2,16")
            p.add_argument("--triton-adamw", action="store_true",
                           help="also time the bf16 step with moelab.train.adamw_triton.TritonAdamW")
            p.add_argument("--overlap-off", action="store_true",
                           help="also time the step with the compiled full loss instead of its in-place kernel "
                                "(tag bf16-loss-compiled) and with train.optimizer_overlap=off (tag bf16-no-overlap)")
            p.add_argument("--loss-kernel-trial", default=None,
                           help="with --overlap-off: also time the step (tag bf16-trial) with the in-place loss "
                                "kernel at this config (moelab.backends.loss_kernel.config_name's form, e.g. "
                                "16384x32-rows1-evict)")
            p.add_argument("--clip", default=None,
                           help="also time the step clipping at train.grad_clip=CLIP: the multiply in TritonAdamW's "
                                "update (tag bf16-clip) and as its own pass (tag bf16-clip-pass)")
            p.add_argument("--pageable-trial", action="store_true",
                           help="with --overlap-off: the step once more with the micro batches copied from pageable "
                                "memory (tag bf16-pageable)")
            p.add_argument("--adamw-trial", default=None,
                           help="with --overlap-off: the bf16-trial step with TritonAdamW's kernel at BLOCKxWARPS")
            p.add_argument("--triton-gbs", default=None, help="the global batches of --triton-adamw (default --gbs)")
            p.add_argument("--losses", default=None,
                           help="LM-head losses to time in turn (backend.loss): e.g. chunked,full,liger,cce; "
                                "chunked@2048: the chunked loss at backend.loss_chunk_tokens=2048")
            p.add_argument("--mbs", default=None, help="micro batches of --losses, e.g. 2,4 (default the config's)")
            p.add_argument("--tag", default=None, help="the bf16 records' variant prefix (default bf16), e.g. "
                           "bf16-sonic with --set backend.experts=sonic")
            p.add_argument("--loss-steps", type=int, default=0,
                           help="first train this many steps at global batch 2 and record their losses in each "
                                "record (first_losses_gbs2: runs of one seed compare step by step)")
        else:
            p.add_argument("--steps", type=int, default=300)
    p = sub.add_parser("table")
    p.add_argument("dir")
    args = ap.parse_args(argv)
    {"bench": cmd_bench, "parity": cmd_parity, "table": cmd_table}[args.cmd](args)


if __name__ == "__main__":
    main()
