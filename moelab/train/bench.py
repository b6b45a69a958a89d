"""Throughput of the real training step: ``moelab bench CONFIG`` and ``bench(cfg, steps, warmup) -> dict``.

The trainer's own step (moelab.train.trainer.Trainer.train_step: forward, backward, clipping, the one host
synchronisation that reads the step's metrics, the optimizer) is timed with CUDA events after warm-up steps;
the median step time gives tokens/s per GPU, TFLOPs per GPU (moelab.flops convention, stated in the result) and
MFU against a given or datasheet peak. On several ranks (torchrun) the slowest rank's time counts.

The headline is the learned router. Every record states its router kind (`router`: learned, fake_balanced or
fake_noise=<x>, BackendConfig.router_kind). Beside the headline, on the same model:
    fake_router       with backend.fake_balanced_gate=true (as reference tables benchmark): the headline is timed
                      with the learned router and the config's fake gate beside it, labelled with its kind, so
                      the cost of real (imbalanced) routing is visible (real_router=False: the fake gate alone,
                      as the headline, and the record says so);
    metrics_overhead  the step without the metrics synchronisation (Trainer.train_step(metrics=False): the same
                      updates, no stats packing, no host read), to show what collecting metrics costs.

    from moelab.train.bench import bench
    r = bench(load_config("tiny"), steps=3, warmup=1)
    r["tokens_per_s_per_gpu"], r["tflops_per_gpu"], r["peak_memory_gb"]

Mock data: data.kind=synthetic is replaced by data.kind=random (uniform tokens, generated vectorised), as
throughput benchmarks do; a token file is kept.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from moelab.config import Config
from moelab.planner.flops import FLOPS_CONVENTION


def commit_id() -> str:
    """The code version a result belongs to: $MOELAB_COMMIT (set where there is no git checkout, e.g. on the GPU
    machine), else `git rev-parse HEAD` (+ '-dirty' with uncommitted changes), else 'unknown'."""
    if os.environ.get("MOELAB_COMMIT"):
        return os.environ["MOELAB_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


class StepTimer:
    """Times trainer steps: CUDA events on a GPU (no extra synchronisation inside the timed region), the host
    clock on CPU. `time(fn, n)` runs fn(i) n times and returns each call's milliseconds.

        ms = StepTimer("cuda").time(lambda i: trainer.train_step(i + 1), n=10)   # ten step times
    """

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.last_end = None  # CUDA: the event that ended the last timed step

    def time(self, fn, n: int) -> list[float]:
        if not self.cuda:
            out = []
            for i in range(n):
                t0 = time.perf_counter()
                fn(i)
                out.append((time.perf_counter() - t0) * 1e3)
            return out
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        events[0].record()
        for i in range(n):
            fn(i)
            events[i + 1].record()
        torch.cuda.synchronize()
        self.last_end = events[-1]  # the current stream's end of the last step
        return [events[i].elapsed_time(events[i + 1]) for i in range(n)]


def median_ms(fn, reps: int = 10, warmup: int = 2, device: str | None = None) -> float:
    """The median milliseconds of fn() over `reps` timed calls, after `warmup` calls not timed (StepTimer's clock:
    CUDA events on a GPU, the host's on CPU; `device` None: CUDA where there is one).

        ms = median_ms(lambda: layer(x).sum().backward(), reps=10, warmup=2)
    """
    for _ in range(warmup):
        fn()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return statistics.median(StepTimer(device).time(lambda i: fn(), reps))


def step_without_metrics(trainer, step: int) -> None:
    """The trainer's step minus its metrics (Trainer.train_step(metrics=False)): the same updates, no
    statistics packed, summed or read on the host."""
    trainer.train_step(step, metrics=False)


class Bencher:
    """A set-up Trainer plus the timing of its steps; variants (router, micro batches) change the same model.

        b = Bencher(Trainer(cfg, DistEnv(device="cuda")))
        step_ms = b.run(20)                       # twenty timed steps, metrics on
    """

    def __init__(self, trainer, peak: float | None = None):
        self.tr = trainer
        self.timer = StepTimer(trainer.env.device)
        self.next_step = 1
        t = trainer.cfg.train
        self.tokens_per_step = t.global_batch_size * t.seq_len
        self.peak = peak if peak is not None else trainer.peak

    def run(self, n: int, metrics: bool = True) -> list[float]:
        first = self.next_step
        self.next_step += n
        if metrics:
            return self.timer.time(lambda i: self.tr.train_step(first + i), n)
        return self.timer.time(lambda i: step_without_metrics(self.tr, first + i), n)

    def max_over_ranks(self, ms: float) -> float:
        if torch.distributed.is_initialized():
            t = torch.tensor([ms], device=self.tr.env.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            return float(t)
        return ms

    def figures(self, times_ms: list[float]) -> dict:
        step_ms = self.max_over_ranks(statistics.median(times_ms))
        world = self.tr.env.world_size
        tps_gpu = self.tokens_per_step / (step_ms / 1e3) / world
        tflops = self.tr.flops_per_token * tps_gpu / 1e12
        return {"step_time_ms": step_ms, "step_times_ms": [round(x, 3) for x in times_ms],
                "tokens_per_s_per_gpu": tps_gpu, "tflops_per_gpu": tflops,
                "mfu": tflops / self.peak if self.peak else None}

    def measure(self, steps: int, warmup: int, metrics: bool = True) -> dict:
        if warmup:
            self.run(warmup, metrics)
        return self.figures(self.run(steps, metrics))

    def set_global_batch(self, gbs: int) -> None:
        """Time a different global batch on the same model: more (or fewer) micro batches accumulated per step
        on this rank (the micro batch size and the data-parallel degree stay)."""
        t, tr = self.tr.cfg.train, self.tr
        per_rank = gbs // (t.micro_batch_size * tr.par.dp_size)
        if per_rank < 1 or per_rank * t.micro_batch_size * tr.par.dp_size != gbs:
            raise ValueError(f"global batch {gbs}: must be a multiple of micro batch {t.micro_batch_size} x "
                             f"data-parallel degree {tr.par.dp_size}")
        tr.micro_per_rank = per_rank  # the trainer's loss scale follows it (BatchContext.loss_scale)
        self.tokens_per_step = gbs * t.seq_len

    def set_fake_gate(self, on: bool, noise: float = 0.0) -> None:
        """Route with the fake balanced gate (shifted by `noise`, as backend.fake_gate_noise) or, off, the learned
        router, on the same model."""
        for moe in self.tr.par.moe_layers:
            moe.router.fake_balanced_gate, moe.router.fake_gate_noise = on, (noise if on else 0.0)

    def peak_memory_gb(self) -> float:
        """Peak allocated GiB, the maximum over ranks (0 on CPU, where the allocator keeps no peak)."""
        if not self.tr.env.is_cuda:
            return 0.0
        return self.max_over_ranks(torch.cuda.max_memory_allocated(self.tr.env.device) / 2**30)


def bench_config(cfg: Config, steps: int, warmup: int, extra_steps: int = 0) -> Config:
    """The config as benchmarked: enough training steps for warm-up, timing and the variants; mock data."""
    over = {"train.steps": warmup + steps + extra_steps + 2, "train.checkpoint_every": 0}
    if cfg.data.kind == "synthetic":
        over["data.kind"] = "random"
    return cfg.replace(**over)


def bench(cfg: Config, steps: int = 10, warmup: int = 3, peak_tflops: float | None = None,
          real_router: bool = True, metrics_overhead: bool = True, command: str | None = None) -> dict:
    """Time `steps` training steps after `warmup`; returns one result record (see the module docstring)."""
    from moelab.train.trainer import Trainer

    fake = cfg.backend.router_kind if real_router and cfg.backend.fake_balanced_gate else None  # timed beside
    variants = (fake is not None) + metrics_overhead
    cfg = bench_config(cfg, steps, warmup, extra_steps=variants * (steps + warmup))
    with tempfile.TemporaryDirectory(prefix="moelab-bench-") as run_dir:
        tr = Trainer(cfg, run_dir)
        t0 = time.perf_counter()
        tr.setup()
        setup_s = time.perf_counter() - t0
        b = Bencher(tr, peak_tflops)
        try:
            if fake:
                b.set_fake_gate(False)  # the headline: the learned router
            result = b.measure(steps, warmup)
            if metrics_overhead:
                off = b.measure(steps, max(1, warmup // 2), metrics=False)
                on_ms, off_ms = result["step_time_ms"], off["step_time_ms"]
                result["metrics_overhead"] = {"step_time_ms_on": on_ms, "step_time_ms_off": off_ms,
                                              "fraction": (on_ms - off_ms) / on_ms}
            if fake:
                b.set_fake_gate(True, cfg.backend.fake_gate_noise)
                fr = b.measure(steps, max(1, warmup // 2))
                result["fake_router"] = {"router": fake, **{k: fr[k] for k in (
                    "step_time_ms", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu")}}
            result["peak_memory_gb"] = b.peak_memory_gb()
        finally:
            tr.stop.restore()  # the signal handlers setup() installed: a later signal must not reach this bench
            tr.env.shutdown()
            if tr.writer:
                tr.writer.close()
    headline = cfg.replace(**{"backend.fake_balanced_gate": False, "backend.fake_gate_noise": 0.0}) if fake else cfg
    return {**describe(tr, b, headline), **result, "steps": steps, "warmup": warmup, "setup_s": setup_s,
            "command": command or " ".join(["moelab"] + sys.argv[1:])}


def describe(tr, b: Bencher, cfg: Config) -> dict:
    """What a record says besides its figures: the system and workload, the GPUs, the FLOPs convention, the
    batch, dtypes and router kind of `cfg` (the config as timed), the layout and the code version.

        record = {**describe(trainer, bencher, cfg), **bencher.measure(10, 3)}
    """
    t = cfg.train
    return {"system": "moelab", "workload": cfg.name, "gpus": tr.env.world_size, "gpu_name": tr.gpu_name,
            "flops_per_token": tr.flops_per_token, "flops_convention": FLOPS_CONVENTION,
            "peak_tflops": b.peak, "global_batch_size": t.global_batch_size, "micro_batch_size": t.micro_batch_size,
            "seq_len": t.seq_len, "dtype": t.dtype, "param_dtype": t.param_dtype, "compile": t.compile, "fp8": t.fp8,
            "activation_checkpointing": t.activation_checkpointing, "optimizer_state": t.optimizer_state,
            "router": cfg.backend.router_kind, "fake_balanced_gate": cfg.backend.fake_balanced_gate,
            "fake_gate_noise": cfg.backend.fake_gate_noise, "loss": getattr(tr.model, "loss_kind", cfg.backend.loss),
            "optimizer": type(tr.optimizer).__name__, "backends": getattr(tr.model, "backends", None),
            "layout": {k: getattr(tr.layout, k) for k in ("tp", "pp", "cp", "ep", "vp", "fsdp")},
            "commit": commit_id(), "torch_version": torch.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def format_result(r: dict) -> str:
    lines = [f"{r['workload']} on {r['gpus']} x {r['gpu_name']}: {r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
             f"{r['tflops_per_gpu']:.1f} TFLOPs/GPU" + (f", MFU {100 * r['mfu']:.1f}%" if r.get("mfu") else "")
             + f", step {r['step_time_ms']:.1f} ms, peak memory {r['peak_memory_gb']:.1f} GiB, "
             f"router: {r.get('router', '?')}"]
    if "fake_router" in r:
        fr = r["fake_router"]
        lines.append(f"  {fr['router']} (fake gate: round-robin routing, a benchmark convention, not training): "
                     f"{fr['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, {fr['tflops_per_gpu']:.1f} TFLOPs/GPU, "
                     f"step {fr['step_time_ms']:.1f} ms")
    if "metrics_overhead" in r:
        m = r["metrics_overhead"]
        lines.append(f"  metrics: step {m['step_time_ms_on']:.2f} ms with, {m['step_time_ms_off']:.2f} ms without "
                     f"({100 * m['fraction']:+.2f}%)")
    lines.append(f"  FLOPs convention: {r['flops_convention']}")
    return "\n".join(lines)


def write_result(r: dict, path: "str | Path") -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r, indent=1) + "\n")
