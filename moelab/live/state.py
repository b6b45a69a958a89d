"""Dashboard state: the metrics stream of one run folded into plain Python (no widgets, no threads).

Every view (widget, text, static plots) reads a `DashState`; only `apply()` knows the event schema
(moelab/train/metrics.py), so a view never parses events itself.

    state = DashState()
    for event in JsonlTail("runs/tiny/metrics.jsonl").poll():
        state.apply(event)
    print(state.status_line())

Shape legend: L = MoE layers, E = experts per layer, R = ranks.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from moelab.train.metrics import JsonlTail
from moelab.train.summary import balance

# Run statuses after which nothing more will be written (SLURM's names, submitit's, the trainer's).
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "CANCELED", "TIMEOUT", "PREEMPTED", "STOPPED",
                      "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE", "ERROR", "INTERRUPTED"})
ROUTING_WINDOW = 20  # steps summed by the live routing heatmap and histogram


def is_terminal(status: "str | None") -> bool:
    return bool(status) and str(status).upper() in TERMINAL


@dataclass
class DashState:
    """What a dashboard shows about one run. `version` increases whenever something visible changed, so views
    redraw only when needed. Histories are per step event; memory keeps the per-rank peak and the min/max over
    ranks per step (bounded by steps, not steps x ranks)."""

    name: str = ""
    total_steps: int = 0
    step: int = 0
    event_status: str = ""  # from the stream: RUNNING after `start`, the `end` status, FAILED after `error`
    run_status: str = ""  # from the Run object (PENDING, RUNNING, COMPLETED, ...), when there is one
    run_error: str = ""
    steps: list = field(default_factory=list)
    loss: list = field(default_factory=list)
    eval_steps: list = field(default_factory=list)  # `eval` events: held-out loss beside the training loss
    eval_loss: list = field(default_factory=list)
    tokens_per_s_per_gpu: list = field(default_factory=list)
    tflops_per_gpu: list = field(default_factory=list)
    last: dict = field(default_factory=dict)  # the latest step event
    memory_key: str = ""  # "peak_allocated_gb" on GPUs, "rss_gb" where the allocator reports nothing
    memory_peak_R: list = field(default_factory=list)  # running peak per rank
    memory_max: list = field(default_factory=list)  # per step: the max over ranks
    memory_min: list = field(default_factory=list)  # per step: the min over ranks
    routing_window: deque = field(default_factory=lambda: deque(maxlen=ROUTING_WINDOW))  # of [L][E]
    routing_total_LE: list = field(default_factory=list)  # whole run
    dropped_pct: "float | None" = None  # share of the last step's routed assignments dropped by capacity
    warnings: list = field(default_factory=list)  # warning events
    errors: list = field(default_factory=list)  # error events
    corrupt: list = field(default_factory=list)  # messages about lines that did not parse
    summary: dict = field(default_factory=dict)  # from the `end` event
    first_time: float = 0.0
    last_time: float = 0.0
    _rate: deque = field(default_factory=lambda: deque(maxlen=20))  # (time, step) of recent step events
    version: int = 0

    # ------------------------------------------------------------------ folding
    def apply(self, event: dict) -> None:
        """Fold one event of the stream (schema in moelab/train/metrics.py) into the state."""
        kind = event.get("event")
        t = event.get("time") or 0.0
        self.first_time = self.first_time or t
        self.last_time = max(self.last_time, t)
        if kind == "start":
            cfg = event.get("config") or {}
            self.name = self.name or cfg.get("name", "")
            self.total_steps = event.get("total_steps") or self.total_steps
            self.step = max(self.step, event.get("start_step") or 0)
            self.event_status = "RUNNING"
        elif kind == "step":
            self._apply_step(event, t)
        elif kind == "eval":
            self._apply_eval(event)
        elif kind == "warning":
            self.warnings.append(event)
        elif kind == "error":
            self.errors.append(event)
            self.event_status = "FAILED"
        elif kind == "end":
            self.event_status = event.get("status") or "COMPLETED"
            self.summary = event.get("summary") or {}
        self.version += 1

    def _apply_step(self, ev: dict, t: float) -> None:
        step = ev["step"]
        if self.steps and step <= self.steps[-1]:  # a requeued run repeats steps from its last checkpoint
            cut = next(i for i, s in enumerate(self.steps) if s >= step)
            for hist in (self.steps, self.loss, self.tokens_per_s_per_gpu, self.tflops_per_gpu,
                         self.memory_max, self.memory_min):
                del hist[cut:]
            self._rate.clear()
            keep = sum(1 for s in self.eval_steps if s < step)
            del self.eval_steps[keep:], self.eval_loss[keep:]
        self.step, self.last = step, ev
        self.steps.append(step)
        self.loss.append(ev.get("loss"))
        self.tokens_per_s_per_gpu.append(ev.get("tokens_per_s_per_gpu"))
        self.tflops_per_gpu.append(ev.get("tflops_per_gpu"))
        self._rate.append((t, step))
        per_rank = (ev.get("memory") or {}).get("per_rank") or []
        if per_rank:
            if not self.memory_key:
                gpu = any((r.get("peak_allocated_gb") or 0) > 0 for r in per_rank)
                self.memory_key = "peak_allocated_gb" if gpu else "rss_gb"
            vals_R = [r.get(self.memory_key) or 0.0 for r in per_rank]
            if len(self.memory_peak_R) != len(vals_R):
                self.memory_peak_R = [0.0] * len(vals_R)
            self.memory_peak_R = [max(a, b) for a, b in zip(self.memory_peak_R, vals_R)]
            self.memory_max.append(max(vals_R))
            self.memory_min.append(min(vals_R))
        routing = ev.get("routing") or {}
        # the router's demand (before capacity drops: a capacity factor must not hide an imbalance); streams
        # written before routed_per_expert existed only have what the experts computed
        counts_LE = routing.get("routed_per_expert") or routing.get("tokens_per_expert")
        dropped = routing.get("dropped_tokens")
        if counts_LE and dropped is not None:
            demand = sum(sum(c) for c in counts_LE)
            self.dropped_pct = 100.0 * sum(dropped) / demand if demand else 0.0
        if counts_LE:
            self.routing_window.append(counts_LE)
            if [len(c) for c in self.routing_total_LE] != [len(c) for c in counts_LE]:
                self.routing_total_LE = [[0.0] * len(c) for c in counts_LE]
            self.routing_total_LE = [[a + b for a, b in zip(tot, c)]
                                     for tot, c in zip(self.routing_total_LE, counts_LE)]

    def _apply_eval(self, ev: dict) -> None:
        keep = sum(1 for s in self.eval_steps if s < ev["step"])  # a repeated step replaces its evaluation
        del self.eval_steps[keep:], self.eval_loss[keep:]
        self.eval_steps.append(ev["step"])
        self.eval_loss.append(ev.get("loss"))

    def set_run(self, status: "str | None", error: "str | None" = None) -> None:
        """Record what the Run object says (it knows about jobs that never wrote a line, and cancellations)."""
        status, error = str(status or ""), str(error or "")
        if (status, error) != (self.run_status, self.run_error):
            self.run_status, self.run_error = status, error
            self.version += 1

    def set_corrupt(self, messages: list) -> None:
        if len(messages) != len(self.corrupt):
            self.corrupt = list(messages)
            self.version += 1

    # ------------------------------------------------------------------ derived
    @property
    def status(self) -> str:
        """The Run's terminal status wins (it saw the process end), then the stream's, then the Run's."""
        if is_terminal(self.run_status):
            return self.run_status.upper()
        if is_terminal(self.event_status):
            return self.event_status
        return self.event_status or self.run_status.upper() or "WAITING"

    @property
    def done(self) -> bool:
        """Nothing more will come. With a Run attached its status decides (a PREEMPTED stream is requeued and
        resumes; an error event on one rank comes before the job ends), except that a stream that COMPLETED
        is done even while the processes are still exiting."""
        if self.run_status:
            return is_terminal(self.run_status) or self.event_status == "COMPLETED"
        return is_terminal(self.event_status)

    @property
    def failed(self) -> bool:
        return self.done and self.status != "COMPLETED"

    @property
    def num_layers(self) -> int:
        return len(self.routing_total_LE)

    @staticmethod
    def layer_name(i: int) -> str:
        """Layers are counted as the stream and summary count them: the i-th MoE layer (dense layers skipped)."""
        return f"MoE layer {i}"

    def routing_LE(self, window: bool = True) -> list:
        """Tokens per expert summed over the last ROUTING_WINDOW steps (window) or the whole run."""
        if not window or not self.routing_window:
            return self.routing_total_LE
        return [[sum(c) for c in zip(*layer)] for layer in zip(*self.routing_window)]

    def layer_balance(self, layer: int, window: bool = True) -> dict:
        """max/mean, cv, entropy and dead experts of one MoE layer (moelab.train.summary.balance)."""
        counts = self.routing_LE(window)
        return balance(counts[layer]) if 0 <= layer < len(counts) else balance([])

    def balance_summary(self, window: bool = False) -> dict:
        """Balance over all MoE layers: the mean of max/mean, cv and entropy, and the dead experts summed; the
        figure to compare runs of a load-balancing sweep by. Empty before the first step."""
        per_layer = [balance(c) for c in self.routing_LE(window)]
        if not per_layer:
            return {}
        mean = lambda k: sum(b[k] for b in per_layer) / len(per_layer)
        return {"max_over_mean": mean("max_over_mean"), "cv": mean("cv"), "entropy": mean("entropy"),
                "dead": sum(b["dead"] for b in per_layer)}

    def worst_layer(self, window: bool = True) -> int:
        """The MoE layer with the highest max/mean load (0 when there is no routing yet)."""
        counts = self.routing_LE(window)
        if not counts:
            return 0
        return max(range(len(counts)), key=lambda i: balance(counts[i])["max_over_mean"])

    def seconds_per_step(self) -> "float | None":
        if len(self._rate) < 2:
            return None
        (t0, s0), (t1, s1) = self._rate[0], self._rate[-1]
        return (t1 - t0) / (s1 - s0) if s1 > s0 and t1 > t0 else None

    def eta_s(self) -> "float | None":
        sps = self.seconds_per_step()
        if self.done or sps is None or not self.total_steps:
            return None
        return max(self.total_steps - self.step, 0) * sps

    def elapsed_s(self, now: "float | None" = None) -> float:
        if not self.first_time:
            return 0.0
        end = self.last_time if self.done else (now or time.time())
        return max(end - self.first_time, 0.0)

    def peak_memory_gb(self) -> "float | None":
        return max(self.memory_peak_R) if self.memory_peak_R else None

    def error_text(self) -> str:
        """The first error event (message and traceback), else what the Run object reported."""
        if self.errors:
            e = self.errors[0]
            return f"rank {e.get('rank', '?')}, step {e.get('step', '?')}: {e.get('message', '')}"
        return self.run_error

    def status_line(self) -> str:
        """One line for terminals and logs, e.g.
        `tiny  RUNNING  step 12/50 (24%)  loss 3.214  1,234 tok/s/GPU  0.012 TFLOPs/GPU  mem 0.32 GB  ETA 0:20`"""
        parts = [self.name or "run", self.status]
        if self.total_steps:
            parts.append(f"step {self.step}/{self.total_steps} ({100 * self.step / self.total_steps:.0f}%)")
        last = self.last
        if last.get("loss") is not None:
            parts.append(f"loss {last['loss']:.4g}")
        if last.get("tokens_per_s_per_gpu") is not None:
            parts.append(f"{last['tokens_per_s_per_gpu']:,.0f} tok/s/GPU")
        if last.get("tflops_per_gpu") is not None:
            parts.append(f"{fmt_tflops(last['tflops_per_gpu'])} TFLOPs/GPU")
        if last.get("mfu") is not None:
            parts.append(f"MFU {100 * last['mfu']:.1f}%")
        if self.peak_memory_gb() is not None:
            parts.append(f"mem {self.peak_memory_gb():.2f} GB")
        if self.eta_s() is not None:
            parts.append(f"ETA {fmt_duration(self.eta_s())}")
        if self.failed and self.error_text():
            parts.append(f"error: {self.error_text().splitlines()[0][:120]}")
        return "  ".join(parts)


def run_folder(run) -> Path:
    """The folder of a Run (anything with `.folder`) or of a path."""
    return Path(getattr(run, "folder", run))


def load_state(run) -> DashState:
    """Fold a run folder's metrics.jsonl as it is now (a half-written last line is left out, corrupt lines are
    listed in `corrupt`). `run`: a Run or a run folder."""
    path = run_folder(run) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_folder(run)} a run folder?")
    st = DashState(name=str(getattr(run, "name", "") or ""))
    tail = JsonlTail(path)
    for event in tail.poll():
        st.apply(event)
    st.set_corrupt(tail.errors)
    return st


def fmt_duration(seconds: float) -> str:
    """0:05, 1:02:03."""
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def fmt_tflops(x: float) -> str:
    """Three significant digits, so a CPU run's 0.00046 reads as well as an H200's 412."""
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"
