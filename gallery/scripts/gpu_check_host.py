"""Issue 41: does the host launch a micro batch's forward and backward faster than the GPU runs them? The proxy's
step as `gpu_perf.py bench` builds it (compiled, today's defaults) is warmed up; then, with a kernel keeping the GPU
busy for --sleep-ms, the host's milliseconds to queue one micro batch's forward, and (behind a second such kernel)
its backward, against the GPU's milliseconds to run them (CUDA events, the queue full, no host gap); the share of the
host's time inside SonicMoE's layer (its Python, metadata and GEMM launches), forward and backward. Last, the step
timed as the gallery times it (the update of the step before pending) and after a synchronisation (nothing pending:
the first forward waits on the host wherever the host is slower), each phase of it in the host's and the GPU's clock
(Markers); and the forward and backward queued under cProfile.

    python gallery/scripts/gpu_check_host.py --out DIR      # DIR/host-check.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_check_copy import sleep_cycles  # noqa: E402
from gpu_perf import BENCH_SET, PRESET  # noqa: E402

from moelab.backends import sonic  # noqa: E402
from moelab.backends.full_loss import loss_mask  # noqa: E402
from moelab.config import load_config  # noqa: E402
from moelab.data.batches import micro_batch  # noqa: E402
from moelab.data.transfer import to_device  # noqa: E402
from moelab.model.batch_context import BatchContext  # noqa: E402
from moelab.train.bench import Bencher, bench_config, commit_id  # noqa: E402


class HostClock:
    """Host seconds spent inside SonicMoE's layer, forward and backward (wrapped before the first compile, so every
    timed call goes through the wrappers)."""

    def __init__(self):
        self.fwd = self.bwd = 0.0
        self.calls = 0
        inner_fwd, inner_bwd = sonic.sonic_experts, sonic._SonicExperts.backward

        @torch.compiler.disable
        def timed_fwd(*args):
            t0 = time.perf_counter()
            try:
                return inner_fwd(*args)
            finally:
                self.fwd += time.perf_counter() - t0
                self.calls += 1

        def timed_bwd(ctx, *grads):
            t0 = time.perf_counter()
            try:
                return inner_bwd(ctx, *grads)
            finally:
                self.bwd += time.perf_counter() - t0
        sonic.sonic_experts, sonic._SonicExperts.backward = timed_fwd, staticmethod(timed_bwd)

    def reset(self) -> None:
        self.fwd = self.bwd = 0.0
        self.calls = 0


def forward(tr, step: int) -> torch.Tensor:
    """One micro batch's loss, as Trainer.micro_batches computes it (plain text data, one process)."""
    t = tr.cfg.train
    batch = to_device(micro_batch(tr.dataset, step, 0, t.micro_batch_size), tr.env.device)
    targets = batch[:, 1:]
    ctx = BatchContext(token_mask_BL=loss_mask(targets, tr.cfg.model.pad_token_id), loss_scale=1.0)
    with torch.autocast("cuda", dtype=tr.dtype, enabled=tr.dtype != torch.float32 and not tr.par.casts_params):
        return tr.model(batch[:, :-1], None, targets_BL=targets, ctx=ctx)


def behind_a_kernel(cycles: int, fn) -> tuple[float, float, object]:
    """fn() queued while the GPU runs a `cycles` sleep: (host ms of the call, GPU ms of what it queued, its result)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    out = fn()
    host_ms = (time.perf_counter() - t0) * 1e3
    end.record()
    end.synchronize()
    return host_ms, start.elapsed_time(end), out


def host_profile(cycles: int, fn, top: int = 40) -> dict:
    """fn() queued behind a `cycles` sleep under cProfile: the host's functions by own time and by cumulative time
    (cProfile slows the host; the shares, not the milliseconds, are the figures)."""
    prof = cProfile.Profile()
    _, _, out = behind_a_kernel(cycles, lambda: (prof.enable(), fn(), prof.disable())[1])
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = [{"function": f"{path.split('site-packages/')[-1]}:{line}({name})", "calls": nc, "own_ms": tt * 1e3,
             "cumulative_ms": ct * 1e3} for (path, line, name), (_, nc, tt, ct, _) in stats.stats.items()]
    return {"result": out, "total_ms": sum(r["own_ms"] for r in rows),
            "by_own": sorted(rows, key=lambda r: -r["own_ms"])[:top],
            "by_cumulative": sorted(rows, key=lambda r: -r["cumulative_ms"])[:top]}


class Markers:
    """A host time and a CUDA event (the current stream) at each phase boundary of Trainer.train_step: the step,
    its forward and backward, the gradient norm, the statistics' pack, the update (its read of the pack between the
    pack and the update). Each interval between two markers in both clocks: where the host is slower than the GPU,
    the GPU's interval holds its wait."""

    PHASES = (("train_step", "step"), ("forward_backward", "forward_backward"), ("_pack_step", "pack"),
              ("apply_step", "update"))

    def __init__(self, tr):
        self.steps: list[list] = []
        for attr, label in self.PHASES:
            setattr(tr, attr, self._wrap(getattr(tr, attr), label))
        tr.par.clip_grad_norm = self._wrap(tr.par.clip_grad_norm, "grad_norm")

    def _mark(self, label: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.steps[-1].append((label, time.perf_counter(), event))

    def _wrap(self, fn, label: str):
        def wrapped(*args, **kwargs):
            if label == "step":
                self.steps.append([])
            self._mark(f"{label} start")
            out = fn(*args, **kwargs)
            self._mark(f"{label} end")
            return out
        return wrapped

    def intervals(self) -> dict:
        """{"a -> b": {"host_ms", "gpu_ms"}} medians over the steps marked since the last call (after a sync)."""
        torch.cuda.synchronize()
        table: dict[str, dict[str, list]] = {}
        for marks in self.steps:
            for (a, ta, ea), (b, tb, eb) in zip(marks, marks[1:]):
                row = table.setdefault(f"{a} -> {b}", {"host_ms": [], "gpu_ms": []})
                row["host_ms"].append((tb - ta) * 1e3)
                row["gpu_ms"].append(ea.elapsed_time(eb))
        self.steps = []
        return {k: {c: round(statistics.median(v), 3) for c, v in row.items()} for k, row in table.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sleep-ms", type=float, default=400.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    from moelab.train.trainer import Trainer

    clock = HostClock()
    cfg = bench_config(load_config(PRESET, BENCH_SET), 400, 0)
    tr = Trainer(cfg, tempfile.mkdtemp(prefix="moelab-host-"))
    tr.setup()
    b = Bencher(tr)
    b.run(4)  # warm-up (compiles): global batch 2, one micro batch
    cycles = sleep_cycles(args.sleep_ms)
    rows = []
    for r in range(args.reps):
        tr.join_optimizer()
        tr.optimizer.zero_grad(set_to_none=True)  # the first micro batch's backward: gradients written whole
        clock.reset()
        host_f, gpu_f, loss = behind_a_kernel(cycles, lambda: forward(tr, 1000 + r))
        sonic_f, calls = clock.fwd * 1e3, clock.calls
        host_b, gpu_b, _ = behind_a_kernel(cycles, loss.backward)
        rows.append({"host_fwd_ms": host_f, "gpu_fwd_ms": gpu_f, "host_bwd_ms": host_b, "gpu_bwd_ms": gpu_b,
                     "sonic_host_fwd_ms": sonic_f, "sonic_host_bwd_ms": clock.bwd * 1e3, "sonic_calls": calls})
        print("rep %d: forward host %.2f ms / GPU %.2f ms (SonicMoE's host %.2f ms in %d calls); backward host "
              "%.2f ms / GPU %.2f ms (SonicMoE's host %.2f ms)" % (r, host_f, gpu_f, sonic_f, calls, host_b, gpu_b,
                                                                 clock.bwd * 1e3), flush=True)
    tr.optimizer.zero_grad(set_to_none=True)
    fwd_profile = host_profile(cycles, lambda: forward(tr, 2000))
    bwd_profile = host_profile(cycles, fwd_profile.pop("result").backward)
    bwd_profile.pop("result")
    for name, p in (("forward", fwd_profile), ("backward", bwd_profile)):
        print(f"cProfile {name}: {p['total_ms']:.1f} ms of host time; by own time:", flush=True)
        for r in p["by_own"][:15]:
            print(f"  {r['own_ms']:8.2f} ms {r['calls']:6d} calls  {r['function']}", flush=True)
    for m in tr.par.moe_layers:
        m.router.pop_stats()
    tr.optimizer.zero_grad(set_to_none=True)
    med = {k: round(statistics.median(row[k] for row in rows), 3) for k in rows[0]}
    b.run(2)
    markers = Markers(tr)
    steady = b.run(args.steps)
    steady_phases = markers.intervals()
    fresh = []
    for _ in range(args.steps):  # nothing pending: the update of the step before has run
        tr.join_optimizer()
        torch.cuda.synchronize()
        fresh += b.run(1)
    fresh_phases = markers.intervals()
    for name, phases in (("update pending", steady_phases), ("after a synchronisation", fresh_phases)):
        print(f"phases, {name} (host ms / GPU ms):", flush=True)
        for k, v in phases.items():
            print(f"  {k:40s} {v['host_ms']:8.3f} {v['gpu_ms']:8.3f}", flush=True)
    blocked = max(row["host_fwd_ms"] for row in rows) > 0.9 * args.sleep_ms
    rec = {"system": "moelab", "workload": PRESET, "variant": "host-check", "gpu_name": torch.cuda.get_device_name(),
           "torch_version": torch.__version__, "commit": commit_id(), "command": " ".join(["python"] + sys.argv),
           "global_batch_size": 2, "sleep_ms": args.sleep_ms, "median": med, "reps": rows,
           "host_ahead_fwd_ms": round(med["gpu_fwd_ms"] - med["host_fwd_ms"], 3),
           "host_ahead_bwd_ms": round(med["gpu_bwd_ms"] - med["host_bwd_ms"], 3),
           "step_ms_update_pending": round(statistics.median(steady), 3), "step_times_ms_update_pending": steady,
           "step_ms_after_sync": round(statistics.median(fresh), 3), "step_times_ms_after_sync": fresh,
           "host_outran_sleep": blocked, "ok": not blocked,
           "phases_update_pending": steady_phases, "phases_after_sync": fresh_phases,
           "cprofile_forward": fwd_profile, "cprofile_backward": bwd_profile}
    print(f"median: {json.dumps(med)}; step {rec['step_ms_update_pending']} ms with the update pending, "
          f"{rec['step_ms_after_sync']} ms after a synchronisation", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "host-check.json").write_text(json.dumps(rec, indent=1) + "\n")
    return 0 if rec["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
