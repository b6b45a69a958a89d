"""Dashboard state: the metrics stream of one run folded into plain Python (no widgets, no threads).

Every view (widget, text, static plots) reads a `DashState`; only `apply()` reads events (the typed classes of
moelab.contract.events), so a view never parses events itself. The per-step histories keep at most MAX_POINTS
points: a longer run is thinned (every other older point dropped, the latest kept), so a run of a million steps
folds in flat memory.

    state = DashState()
    for event in JsonlTail("runs/tiny/metrics.jsonl", typed=True).poll():
        state.apply(event)
    print(state.status_line())

Shape legend: L = MoE layers (M in docs/shapes.md), E = experts per layer, R = ranks.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moelab.contract.events import (ControlEvent, EndEvent, ErrorEvent, EvalEvent, Event, Health, StartEvent,
                                    StepEvent, WarningEvent, parse_event)
from moelab.contract.folder import RunFolder
from moelab.contract.status import SLURM_ENDED, TERMINAL
from moelab.contract.stream import JsonlTail
from moelab.contract.summary import BALANCE_KEYS, balance, balance_M, demand_ME, mean_balance, step_balance, timed_steps

MAX_POINTS = 20_000  # per-step histories longer than this are thinned (every other older point dropped)
ROUTING_WINDOW = 20  # the dashboard's "last N steps": its routing heatmap, histogram, balance and throughput
HISTORY_BUCKETS = 240  # the load-over-steps heatmap keeps at most this many columns (neighbours merge)


def is_terminal(status: "str | None") -> bool:
    """A status after which nothing more will be written: a RunStatus's terminal set, or SLURM's end states."""
    return bool(status) and (str(status).upper() in TERMINAL or str(status).upper() in SLURM_ENDED)


class StepBuckets:
    """Per-step [M][E] loads in bounded memory, for the load-over-steps heatmap: at most `cap` buckets, each the
    sum over `width` consecutive steps; when full, neighbours merge and the width doubles.

        b = StepBuckets(cap=4)
        for step in range(1, 10): b.add(step, [[1.0, 3.0]])
        b.layer(0)    # ([(1, 4), (5, 8), (9, 9)], [[4., 12.], [4., 12.], [1., 3.]])
    """

    def __init__(self, cap: int = HISTORY_BUCKETS):
        self.cap, self.width = cap, 1
        self.spans: list = []  # [first step, last step, steps summed] per bucket
        self.sums: list = []  # np.ndarray [M, E] per bucket

    def add(self, step: int, counts_ME) -> None:
        c_ME = np.asarray(counts_ME, dtype=np.float32)
        if self.sums and self.spans[-1][2] < self.width and self.sums[-1].shape == c_ME.shape:
            self.sums[-1] = self.sums[-1] + c_ME
            self.spans[-1][1:] = [step, self.spans[-1][2] + 1]
        else:
            self.sums.append(c_ME)
            self.spans.append([step, step, 1])
        if len(self.sums) > self.cap:
            self.width *= 2
            pairs = range(0, len(self.sums) - 1, 2)
            merged = [(self.spans[i][0], self.spans[i + 1][1], self.spans[i][2] + self.spans[i + 1][2],
                       self.sums[i] + self.sums[i + 1]) for i in pairs if self.sums[i].shape == self.sums[i + 1].shape]
            tail = len(self.sums) % 2
            self.spans = [[a, b, n] for a, b, n, _ in merged] + self.spans[len(self.sums) - tail:]
            self.sums = [m[3] for m in merged] + self.sums[len(self.sums) - tail:]

    def truncate(self, step: int) -> None:
        """Forget the buckets that reach `step` or later (a requeued run computes them again)."""
        keep = sum(1 for span in self.spans if span[1] < step)
        del self.spans[keep:], self.sums[keep:]

    def layer(self, layer: int) -> tuple:
        """([(first, last) step of each bucket], [bucket][expert] summed loads) of one MoE layer."""
        rows = [(tuple(sp[:2]), s[layer]) for sp, s in zip(self.spans, self.sums) if layer < len(s)]
        return [r[0] for r in rows], np.asarray([r[1] for r in rows], dtype=np.float64)


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
    last: "StepEvent | None" = None  # the latest step event
    memory_key: str = ""  # "peak_allocated_gb" on GPUs, "rss_gb" where the allocator reports nothing
    memory_peak_R: list = field(default_factory=list)  # running peak per rank
    memory_max: list = field(default_factory=list)  # per step: the max over ranks
    memory_min: list = field(default_factory=list)  # per step: the min over ranks
    routing_window: deque = field(default_factory=lambda: deque(maxlen=ROUTING_WINDOW))  # of [M][E]
    routing_total_ME: list = field(default_factory=list)  # whole run
    dropped_pct: "float | None" = None  # share of the last step's routed assignments dropped by capacity
    warnings: list = field(default_factory=list)  # warning events
    errors: list = field(default_factory=list)  # error events
    controls: list = field(default_factory=list)  # control events: live changes of config fields
    corrupt: list = field(default_factory=list)  # messages about lines that did not parse
    summary: dict = field(default_factory=dict)  # from the `end` event
    first_time: float = 0.0
    last_time: float = 0.0
    _rate: deque = field(default_factory=lambda: deque(maxlen=20))  # (time, step) of recent step events
    version: int = 0
    # training curves beyond loss and throughput, one value per step event (None where a step had none)
    aux_loss: list = field(default_factory=list)
    z_loss: list = field(default_factory=list)
    grad_norm: list = field(default_factory=list)
    lr: list = field(default_factory=list)
    dropped_pct_I: list = field(default_factory=list)
    # balance, one definition (moelab.contract.summary.step_balance): per step the mean over MoE layers, and the
    # per-layer figures ([M, 3] arrays in BALANCE_KEYS order) for one layer's recent mean
    balance_I: list = field(default_factory=list)
    balance_IM: list = field(default_factory=list)
    load_history: StepBuckets = field(default_factory=StepBuckets)  # the load-over-steps heatmap
    health: Health = field(default_factory=Health)  # the last step's health (dead_experts, overloaded)
    health_I: list = field(default_factory=list)  # per step: (dead experts, overloaded experts)
    device: str = ""  # from the start event: "cpu", "cuda", ...
    controls: list = field(default_factory=list)  # `control` events (step, field, old, new, who): chart marks

    # ------------------------------------------------------------------ folding
    def apply(self, event: "Event | dict") -> None:
        """Fold one event of the stream (a moelab.contract.events class, or its JSON object) into the state."""
        ev = event if isinstance(event, Event) else parse_event(event)
        t = ev.time or 0.0
        self.first_time = self.first_time or t
        self.last_time = max(self.last_time, t)
        if isinstance(ev, StartEvent):
            self.name = self.name or ev.config.get("name", "")
            self.total_steps = ev.total_steps or self.total_steps
            self.step = max(self.step, ev.start_step or 0)
            self.device = str((ev.env.device if ev.env else None) or self.device)
            self.event_status = "RUNNING"
        elif isinstance(ev, StepEvent):
            self._apply_step(ev, t)
        elif isinstance(ev, EvalEvent):
            self._apply_eval(ev)
        elif isinstance(ev, WarningEvent):
            self.warnings.append(ev)
        elif isinstance(ev, ErrorEvent):
            self.errors.append(ev)
            self.event_status = "FAILED"
        elif isinstance(ev, ControlEvent):
            self.controls.append(ev)
        elif isinstance(ev, EndEvent):
            self.event_status = ev.status or "COMPLETED"
            self.summary = ev.summary or {}
        self.version += 1

    def _histories(self) -> tuple:
        """Every per-step list (cut together on a rewind, thinned together past MAX_POINTS)."""
        return (self.steps, self.loss, self.tokens_per_s_per_gpu, self.tflops_per_gpu, self.memory_max,
                self.memory_min, *self._curves())

    def _apply_step(self, ev: StepEvent, t: float) -> None:
        step = ev.step
        if self.steps and step <= self.steps[-1]:  # a requeued run repeats steps from its last checkpoint
            cut = next(i for i, s in enumerate(self.steps) if s >= step)
            for hist in self._histories():
                del hist[cut:]
            self.load_history.truncate(step)
            self._rate.clear()
            keep = sum(1 for s in self.eval_steps if s < step)
            del self.eval_steps[keep:], self.eval_loss[keep:]
            self.controls[:] = [c for c in self.controls if (c.step or 0) < step]  # applied again
        if len(self.steps) >= MAX_POINTS:
            for hist in self._histories():
                hist[:] = hist[0:-1:2] + hist[-1:]
        self.step, self.last = step, ev
        self.steps.append(step)
        self.loss.append(ev.loss)
        self.tokens_per_s_per_gpu.append(ev.tokens_per_s_per_gpu)
        self.tflops_per_gpu.append(ev.tflops_per_gpu)
        self._rate.append((t, step))
        per_rank = ev.memory.per_rank if ev.memory is not None else []
        if per_rank:
            if not self.memory_key:
                gpu = any((r.peak_allocated_gb or 0) > 0 for r in per_rank)
                self.memory_key = "peak_allocated_gb" if gpu else "rss_gb"
            vals_R = [getattr(r, self.memory_key) or 0.0 for r in per_rank]
            if len(self.memory_peak_R) != len(vals_R):
                self.memory_peak_R = [0.0] * len(vals_R)
            self.memory_peak_R = [max(a, b) for a, b in zip(self.memory_peak_R, vals_R)]
            self.memory_max.append(max(vals_R))
            self.memory_min.append(min(vals_R))
        # the router's demand (before capacity drops: a capacity factor must not hide an imbalance); streams
        # written before routed_per_expert existed only have what the experts computed
        counts_ME = demand_ME(ev)
        dropped = ev.routing.dropped_tokens_M if ev.routing is not None else None
        self.dropped_pct = None
        if counts_ME and dropped is not None:
            demand = sum(sum(c) for c in counts_ME)
            self.dropped_pct = 100.0 * sum(dropped) / demand if demand else 0.0
        self._apply_curves(ev, counts_ME)
        if counts_ME:
            self.routing_window.append(counts_ME)
            if [len(c) for c in self.routing_total_ME] != [len(c) for c in counts_ME]:
                self.routing_total_ME = [[0.0] * len(c) for c in counts_ME]
            self.routing_total_ME = [[a + b for a, b in zip(tot, c)]
                                     for tot, c in zip(self.routing_total_ME, counts_ME)]

    def _curves(self) -> tuple:
        """The per-step lists that _apply_curves appends to (cut together on a rewind)."""
        return (self.aux_loss, self.z_loss, self.grad_norm, self.lr, self.dropped_pct_I, self.balance_I,
                self.balance_IM, self.health_I)

    def _apply_curves(self, ev: StepEvent, counts_ME) -> None:
        for key in ("aux_loss", "z_loss", "grad_norm", "lr"):
            getattr(self, key).append(getattr(ev, key))
        self.dropped_pct_I.append(self.dropped_pct)
        self.balance_I.append(step_balance(counts_ME) if counts_ME else None)
        per_M = balance_M(counts_ME) if counts_ME else None
        self.balance_IM.append(np.asarray([per_M[k] for k in BALANCE_KEYS], dtype=np.float64).T if per_M else None)
        if counts_ME:
            self.load_history.add(ev.step, counts_ME)
        self.health = ev.health or Health()
        self.health_I.append((len(self.health.dead_experts or []), len(self.health.overloaded or [])))

    def _apply_eval(self, ev: EvalEvent) -> None:
        keep = sum(1 for s in self.eval_steps if s < ev.step)  # a repeated step replaces its evaluation
        del self.eval_steps[keep:], self.eval_loss[keep:]
        self.eval_steps.append(ev.step)
        self.eval_loss.append(ev.loss)

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
        return len(self.routing_total_ME)

    @staticmethod
    def layer_name(i: int) -> str:
        """Layers are counted as the stream and summary count them: the i-th MoE layer (dense layers skipped)."""
        return f"MoE layer {i}"

    def routing_ME(self, window: bool = True) -> list:
        """Tokens per expert summed over the last ROUTING_WINDOW steps (window) or the whole run."""
        if not window or not self.routing_window:
            return self.routing_total_ME
        return [[sum(c) for c in zip(*layer)] for layer in zip(*self.routing_window)]

    def span_text(self, window: bool = True) -> str:
        """What the window-or-whole-run figures cover, for labels: "last 20 steps" or "whole run"."""
        return f"last {min(ROUTING_WINDOW, len(self.steps))} steps" if window and self.steps else "whole run"

    def layer_balance(self, layer: int, window: bool = True) -> dict:
        """One MoE layer's max/mean, cv and entropy (mean over the last ROUTING_WINDOW steps, or the whole run:
        the one definition, moelab.contract.summary) and its dead experts (no tokens over that span)."""
        counts = self.routing_ME(window)
        rows = [b[layer] for b in (self.balance_IM[-ROUTING_WINDOW:] if window else self.balance_IM)
                if b is not None and layer < len(b)]
        out = mean_balance([dict(zip(BALANCE_KEYS, map(float, r))) for r in rows]) or \
            {k: 0.0 for k in BALANCE_KEYS}
        return {**out, "dead": balance(counts[layer])["dead"] if 0 <= layer < len(counts) else 0}

    def balance_summary(self, window: bool = False) -> dict:
        """Balance over all MoE layers, the figure to compare runs by: max/mean, cv and entropy as
        moelab.contract.summary.mean_balance defines them (over the whole run, or the last ROUTING_WINDOW steps),
        and the dead experts at the last step (model.moe.dead_expert_steps without a token). Empty before the
        first step."""
        out = mean_balance(self.balance_I[-ROUTING_WINDOW:] if window else self.balance_I)
        if not out:
            return {}
        return {**out, "dead": self.health_I[-1][0] if self.health_I else 0}

    def worst_layer(self, window: bool = True) -> int:
        """The MoE layer with the highest max/mean load (0 when there is no routing yet)."""
        if not self.num_layers:
            return 0
        return max(range(self.num_layers), key=lambda i: self.layer_balance(i, window)["max_over_mean"])

    # ------------------------------------------------------------------ throughput and health, now and overall
    def throughput(self, key: str = "tokens_per_s_per_gpu") -> dict:
        """{"last": the last step, "recent": the mean of the last ROUTING_WINDOW steps, "run": the mean over the
        run's timed steps (all but the first two, as summary.json)}; None where there is no value."""
        values = {"tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "tflops_per_gpu": self.tflops_per_gpu}[key]
        mean = lambda xs: (sum(x for x in xs if x is not None) / max(sum(x is not None for x in xs), 1)
                           if any(x is not None for x in xs) else None)
        return {"last": values[-1] if values else None, "recent": mean(values[-ROUTING_WINDOW:]),
                "run": mean(timed_steps(values))}

    @property
    def per(self) -> str:
        """What the throughput is per: "GPU" on CUDA devices, "rank" elsewhere (a CPU rank is no GPU)."""
        return "GPU" if self.device.startswith("cuda") else "rank"

    def mfu_text(self) -> str:
        """MFU of the last step as a percentage, or why there is none."""
        mfu = self.last.mfu if self.last is not None else None
        if mfu is not None:
            return f"{100 * mfu:.1f}%"
        if not self.last:
            return "–"
        return "n/a on CPU: no peak FLOP/s" if self.device.startswith("cpu") else "n/a: unknown peak FLOP/s"

    def health_now(self) -> str:
        """The experts' health at the last step: "healthy", or how many are dead / overloaded now."""
        dead, over = len(self.health.dead_experts or []), len(self.health.overloaded or [])
        if not self.steps:
            return "–"
        parts = [f"{dead} dead" if dead else "", f"{over} overloaded" if over else ""]
        return ", ".join(p for p in parts if p) or "healthy"

    def health_warnings(self) -> list:
        """The dead / overloaded expert warning events so far (the history; health_now() is the present)."""
        return [e for e in self.warnings if e.kind in ("dead_expert", "overloaded_expert")]

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
            return f"rank {or_unknown(e.rank)}, step {or_unknown(e.step)}: {e.message}"
        return self.run_error

    def status_line(self) -> str:
        """One line for terminals and logs, e.g.
        `tiny  RUNNING  step 12/50 (24%)  loss 3.214  1,234 tok/s/rank  0.012 TFLOPs/rank (per GPU on CUDA)  mem 0.32 GB  ETA 0:20`"""
        parts = [self.name or "run", self.status]
        if self.total_steps:
            parts.append(f"step {self.step}/{self.total_steps} ({100 * self.step / self.total_steps:.0f}%)")
        last = self.last or StepEvent(step=self.step)
        if last.loss is not None:
            parts.append(f"loss {last.loss:.4g}")
        if last.tokens_per_s_per_gpu is not None:
            parts.append(f"{last.tokens_per_s_per_gpu:,.0f} tok/s/{self.per}")
        if last.tflops_per_gpu is not None:
            parts.append(f"{fmt_tflops(last.tflops_per_gpu)} TFLOPs/{self.per}")
        if last.mfu is not None:
            parts.append(f"MFU {100 * last.mfu:.1f}%")
        if self.peak_memory_gb() is not None:
            parts.append(f"mem {self.peak_memory_gb():.2f} GB")
        if self.eta_s() is not None:
            parts.append(f"ETA {fmt_duration(self.eta_s())}")
        if self.failed and self.error_text():
            parts.append(f"error: {self.error_text().splitlines()[0][:120]}")
        elif self.status == "PENDING" and self.run_error:
            parts.append(f"waiting: {self.run_error.splitlines()[0][:120]}")  # the scheduler's pending reason
        return "  ".join(parts)


def run_folder(run) -> Path:
    """The folder of a Run (anything with `.folder`) or of a path."""
    return Path(getattr(run, "folder", run))


def load_state(run) -> DashState:
    """Fold a run folder's metrics.jsonl as it is now (a half-written last line is left out, corrupt lines are
    listed in `corrupt`). `run`: a Run or a run folder."""
    path = RunFolder(run_folder(run)).metrics
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_folder(run)} a run folder?")
    st = DashState(name=str(getattr(run, "name", "") or ""))
    tail = JsonlTail(path, typed=True)
    while events := tail.poll():  # in bounded chunks (JsonlTail.chunk_bytes)
        for event in events:
            st.apply(event)
    st.set_corrupt(tail.errors)
    return st


def or_unknown(value, missing: str = "?") -> str:
    return missing if value is None else str(value)


def fmt_duration(seconds: float) -> str:
    """0:05, 1:02:03."""
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def fmt_tflops(x: float) -> str:
    """Three significant digits, so a CPU run's 0.00046 reads as well as an H200's 412."""
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"
