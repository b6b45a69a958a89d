"""A Run: one training run in a folder, followed from any kernel while it runs and after it ends.

    run = Session("tiny", train={"steps": 50}).submit("local")
    run.status            # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT or PREEMPTED
    run.resume()          # a stopped run (PREEMPTED, TIMEOUT, FAILED, ...) continues from its last checkpoint
    run.metrics.tail()    # the step events so far (a pandas DataFrame where pandas is installed)
    run.wait().summary    # blocks until the run ends; never raises because the run failed: status tells
    run.error             # the failing rank's traceback
    Run.load("runs/tiny-20261130-101500")   # the same run, from another kernel

Everything a Run knows is in its folder (moelab.contract.folder names the files): config.yaml, metrics.jsonl (the
stream the trainer writes; see moelab.contract.stream), summary.json, run.json (executor, job id and submitit
folder, written at submission), logs/ (each rank's stdout and stderr). A Run only reads; the state comes from
its Job (moelab.launch.jobs: the scheduler combined with the stream and submitit's result files).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from moelab.contract.events import Memory, StepEvent
from moelab.contract.folder import RunFolder
from moelab.contract.status import STATES, TERMINAL, RunStatus
from moelab.contract.stream import scan_events, tail_events
from moelab.launch.executors import EXECUTORS, job_for
from moelab.launch.jobs import Job

__all__ = ["Run", "STATES", "TERMINAL"]
_POLL_S = 1.0  # a scheduler is asked at most this often per Run
METRICS_ROWS = 5_000  # Run.metrics keeps at most this many steps of a longer run (evenly spaced; metrics_table(None): all)
# the columns of Run.metrics: a step event's scalar fields, and memory.* (rank 0's and the max over ranks)
_STEP_COLUMNS = [f.name for f in dataclasses.fields(StepEvent) if f.name not in ("schema", "routing", "health",
                                                                                  "memory", "extra")]
_MEMORY_COLUMNS = [f.name for f in dataclasses.fields(Memory) if f.name not in ("per_rank", "extra")]


class Run:
    """A handle on one run folder. Build one with Session.submit(), Run.load(folder) or moelab.runs().

        run = Run.load("runs/tiny-20261130-101500"); run.status, run.metrics.tail()
    """

    def __init__(self, folder: "str | Path", info: dict | None = None, job: Job | None = None):
        self.run_folder = RunFolder(folder)
        self.folder = self.run_folder.path
        self._info = info if info is not None else self.run_folder.read_info()
        self._job = job                 # the launcher's Job when this kernel submitted it
        self._checked = (0.0, None)     # (time, status) of the last scheduler query

    # ------------------------------------------------------------------ opening
    @classmethod
    def load(cls, folder: "str | Path") -> "Run":
        """Reopen a run (finished or running, submitted from any kernel) from its folder."""
        if not RunFolder(folder).is_run():
            raise FileNotFoundError(f"{folder} is not a moelab run folder (no run.json, config.yaml or "
                                    f"metrics.jsonl)")
        return cls(folder)

    @property
    def name(self) -> str:
        """The run's name (run.json's, else the folder's)."""
        return self._info.get("name") or self.folder.name

    @property
    def executor(self) -> str:
        """The registered executor that trains it ('inline', 'local', 'slurm', ...: moelab.launch.executors);
        'external' for a folder written without a Session, e.g. torchrun."""
        return self._info.get("executor", "external")

    @property
    def in_background(self) -> bool:
        """Whether its executor trains it apart from the process that submitted it (local, slurm), rather than in
        that process' foreground (inline, or a run started without a Session)."""
        executor = EXECUTORS.get(self.executor)
        return executor is not None and executor.in_background

    @property
    def job_id(self) -> str | None:
        """The executor's job id (None inline or without a Session)."""
        return self._info.get("job_id")

    @property
    def config(self):
        """The run's config as written in its folder (config.yaml)."""
        from moelab.config import load_config

        return load_config(self.run_folder.config)

    # ------------------------------------------------------------------ state
    @property
    def status(self) -> RunStatus:
        """The run's RunStatus: run.json's final status, else what its Job says (checked at most every few seconds)."""
        final = self._info.get("status")
        if final in TERMINAL:
            return RunStatus(final)
        when, cached = self._checked
        if cached is not None and time.monotonic() - when < _POLL_S:
            return cached
        # another kernel may have cancelled it, or seen it end
        self._info = self.run_folder.read_info() or self._info
        final = self._info.get("status")
        if final in TERMINAL:
            return RunStatus(final)
        job = self.job
        status = job.state()
        self._info = job.info  # what the job recorded (e.g. an owner gone)
        self._checked = (time.monotonic(), status)
        if status in TERMINAL and job.records_status:
            self._info = self.run_folder.note_info(status=str(status))  # not where the folder is read-only
        return status

    @property
    def job(self) -> Job:
        """This run's Job (moelab.launch.jobs), which asks its executor."""
        if self._job is None:
            self._job = job_for(self.run_folder, self._info)
        self._job.info = self._info
        return self._job

    @property
    def done(self) -> bool:
        """Has the run ended?"""
        return self.status in TERMINAL

    def wait(self, timeout: float | None = None, poll_s: float = 0.5) -> "Run":
        """Block until the run ends (or `timeout` seconds pass); returns self. A failed run does not raise:
        look at .status and .error."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.status not in TERMINAL:
            if end is not None and time.monotonic() >= end:
                break
            time.sleep(poll_s)
        return self

    def cancel(self) -> None:
        """Stop the run (scancel on SLURM, SIGTERM to the local job's controller): the ranks checkpoint at the
        step boundary and write an `end` event CANCELLED. Its status becomes CANCELLED once the scheduler confirms."""
        if self.status in TERMINAL:
            return
        if not self.job.cancellable:
            self.job.cancel()  # NotCancellable, saying who can stop it; nothing is written
        self._update_info(cancel_requested=True)
        self._checked = (0.0, None)
        self.job.cancel()

    def resume(self, steps: int | None = None, **cluster_options) -> "Run":
        """Continue a stopped run from its last checkpoint, on the same executor with the same options (those
        given replace them); returns this Run, which now follows the new job. The metrics stream continues
        with no step missing or repeated. Not needed after a SLURM preemption or time limit: the job requeues
        itself and this Run follows it. `steps` trains to another train.steps (moelab.launch.rerun says what
        that does to the learning-rate schedule).

            run = Run.load("runs/tiny-20261130-101500")   # PREEMPTED
            run.resume().wait().status                     # COMPLETED
        """
        from moelab.launch.resume import resume

        if not self.done:
            raise RuntimeError(f"run {self.name} is {self.status}; resume it once it has stopped (or cancel it)")
        self._job = resume(self.folder, steps=steps, **cluster_options)
        self._info, self._checked = self._job.info, (0.0, None)
        return self

    # ------------------------------------------------------------------ steering (moelab.run.controls, .fork)
    def set(self, changes: dict | None = None, /, wait: float | None = None, origin: str = "notebook",
            at: int | None = None, **fields: Any) -> "str | dict | None":
        """Change fields while the run trains (moelab.config.live.LIVE_FIELDS; short names such as
        `aux_loss_coeff` work): every rank applies them at the next step boundary, or with `at` at the boundary
        after step `at` (the next one where the run is past it), each recorded as a `control` event. A field that
        cannot change, a bad value or a run that has completed (fork it instead) raises ConfigError and writes
        nothing; a request the run cannot reach any more as it completes is rejected with the reason. Returns the
        request id, or with `wait` (seconds) how it ended: {"kind": "applied", "step": ...}, "rejected", or None.

            run.set(aux_loss_coeff=1e-2)                    # "checkpoint=True" saves one at the boundary
            run.set({"model.moe.bias_update_rate": 1e-3}, wait=60)["step"]
            run.set(lr=1e-4, at=500)                        # from step 501 on, whenever it is asked
        """
        from moelab.run.controls import request

        rid = request(self, {**(changes or {}), **fields}, origin=origin, at=at)
        return rid if wait is None else self.outcome(rid, wait=wait)

    def outcome(self, request_id: str, wait: float | None = None) -> "dict | str | None":
        """How a change `set` returned the id of ended: {"kind": "applied", "step": ...}, "rejected", or None while
        it is undecided; `wait` (seconds) blocks until it is decided or the run ends.

            rid = run.set(lr=1e-4, at=500); ...; run.outcome(rid, wait=600)["step"]   # 501
        """
        from moelab.run.controls import wait_outcome

        return wait_outcome(self.folder, request_id, timeout=wait or 0.0, run=self)

    @property
    def controls(self) -> list[dict]:
        """The changes applied while it trained: its `control` events (step, field, old, new, who)."""
        return [e for e in self.events if e["event"] == "control"]

    @property
    def parent(self) -> "dict | None":
        """For a fork: {"parent": the parent's folder, "step": k, "changes": {...}}; None otherwise."""
        from moelab.run.fork import parent_of

        return parent_of(self.folder)

    def fork(self, step: int | None = None, name: str | None = None, folder: "str | Path | None" = None,
             executor: str | None = None, nproc: int | None = None, cluster: dict | None = None,
             **changes: Any) -> "Run":
        """A new run from this run's checkpoint at `step` (default the newest) with `changes`, on `executor`
        (default this run's); without changes it repeats this run's steps after `step` exactly (moelab.run.fork).

            a = run.fork(step=20, name="aux", aux_loss_coeff=1e-2); b = run.fork(step=20, name="same")
        """
        from moelab.run.fork import fork

        job = fork(self, step, name, folder, executor, nproc, changes, **(cluster or {}))
        return Run(job.folder.path, job.info, job)

    # ------------------------------------------------------------------ what the run wrote
    @property
    def events(self) -> list[dict]:
        """All events of metrics.jsonl so far, as their JSON objects (moelab.contract.events has the classes)."""
        from moelab.contract.stream import read_events

        return read_events(self.run_folder.metrics, live=True)

    @property
    def metrics(self):
        """The step events as a table (metrics_table(): at most METRICS_ROWS evenly spaced steps of a longer run,
        the last one always)."""
        return self.metrics_table()

    def metrics_table(self, max_rows: "int | None" = METRICS_ROWS):
        """The step events as a table: scalar fields and memory.* columns (routing is in .routing()); `time` is
        a UTC datetime (a float of unix seconds without pandas) and `elapsed_s` the seconds since the first step
        event. A run of more than `max_rows` steps gives about `max_rows` evenly spaced ones (None: every step);
        the stream is read line by line, so memory stays flat."""
        rows = []
        for e in scan_events(self.run_folder.metrics, kinds=("step",), max_steps=max_rows):
            row = {**{k: getattr(e, k) for k in _STEP_COLUMNS}, **e.extra}
            if e.memory is not None:
                row.update({f"memory.{k}": getattr(e.memory, k) for k in _MEMORY_COLUMNS})
            rows.append(row)
        for row in rows:
            row["elapsed_s"] = row["time"] - rows[0]["time"]
        try:
            import pandas as pd
        except ImportError:
            return rows
        if not rows:
            return pd.DataFrame(columns=["step", "loss", "tokens_per_s", "step_time_s"])
        df = pd.DataFrame(rows)
        df["time"] = pd.to_datetime(df["time"], unit="s")
        return df

    @property
    def evals(self):
        """The held-out evaluations (train.eval_every): step, loss, perplexity, batches, tokens per eval event."""
        rows = [{k: getattr(e, k) for k in ("step", "loss", "perplexity", "batches", "tokens")}
                for e in scan_events(self.run_folder.metrics, kinds=("eval",))]
        try:
            import pandas as pd
        except ImportError:
            return rows
        return pd.DataFrame(rows, columns=["step", "loss", "perplexity", "batches", "tokens"])

    def expert_tokens(self, layer: int = 0, step: int | None = None, top: int = 5):
        """Which tokens each expert of MoE layer `layer` receives most (train.expert_tokens_every): one row per
        expert and rank with token_id, token (decoded with the run's tokenizer), count and share; `step` None =
        the latest record. ``.plot_expert_tokens(layer)`` draws it (moelab.live.expert_tokens)."""
        from moelab.live.expert_tokens import expert_token_table

        return expert_token_table(self.folder, layer, step, top)

    def plot_expert_tokens(self, layer: int = 0, step: int | None = None, top: int = 5):
        """A figure of MoE layer `layer`'s experts and their most frequent tokens (moelab.live.expert_tokens)."""
        from moelab.live.expert_tokens import plot_expert_tokens

        return plot_expert_tokens(self.folder, layer, step, top)

    def routing(self):
        """Tokens routed to each expert: a numpy array [steps, moe_layers, num_experts]."""
        import numpy as np

        steps = [e.routing.tokens_per_expert_ME for e in scan_events(self.run_folder.metrics, kinds=("step",))
                 if e.routing is not None and e.routing.tokens_per_expert_ME]
        if steps:
            return np.asarray(steps, dtype=np.float64)
        m = self.config.model
        return np.zeros((0, m.num_layers - m.num_dense_layers, m.moe.num_experts))

    @property
    def summary(self) -> dict | None:
        """summary.json, else the end event's summary; None while the run trains."""
        data = self.run_folder.read_summary()
        if data is not None:
            return data
        ends = tail_events(self.run_folder.metrics, kinds=("end",))[0]
        return ends[-1].summary if ends else None

    @property
    def error(self) -> str | None:
        """The failing rank's traceback (from the stream's error event, else submitit's record of the
        exception, else the tail of rank 0's stderr); a rank killed by a signal is named first, with the signal
        (its peers' errors follow from it); None while nothing failed."""
        errors = tail_events(self.run_folder.metrics, kinds=("error",))[0]  # the last attempt's, read from the end
        killed = self.job.killed() if self.status in ("FAILED", "TIMEOUT") else []
        if killed:  # a rank killed by a signal wrote nothing; its peers' errors (a connection reset) follow from it
            rank, how = killed[0]
            others = f"; then {len(errors)} other rank(s) failed on the lost peer" if errors else ""
            return f"rank {rank} was killed by {how} (no traceback: a signal ended it){others}"
        if errors:
            first = errors[0]
            return f"rank {first.rank} at step {first.step}: {first.message}\n{first.traceback}"
        kind, text = self.job.outcome()
        if kind == "error":
            return text
        if self._info.get("error"):  # recorded by the launcher (e.g. "owner process gone")
            return self._info["error"]
        if self.status in ("FAILED", "TIMEOUT"):
            tail = self.job.log(0, "stderr").splitlines()[-40:]
            return "\n".join(tail) or f"the job ended as {self.status} without an error message"
        return None

    def logs(self, rank: int = 0) -> str:
        """What `rank` has printed so far (stdout, then stderr); for an inline run, what its process printed
        while it trained (also shown where it ran: the cell or the terminal)."""
        out, err = self.job.log(rank, "stdout"), self.job.log(rank, "stderr")
        return out + (("\n" if out and not out.endswith("\n") else "") + err if err else "")

    def export_hf(self, out: "str | Path", **options) -> Path:
        """Write the newest intact checkpoint in transformers' layout (moelab.export.hf: dtype,
        max_shard_size, lora, force, base); returns the folder.

            run.export_hf("out/tiny-hf"); AutoModelForCausalLM.from_pretrained("out/tiny-hf")
        """
        from moelab.export.hf import export_hf

        return export_hf(self.folder, out, **options)

    # ------------------------------------------------------------------ views (other modules draw them)
    def dashboard(self):
        """A live widget (moelab.live) that follows this run."""
        from moelab.live import dashboard

        return dashboard(self)

    def plot_throughput(self):
        """Loss, tokens/s per GPU and TFLOPs per GPU over the steps (moelab.live.plots)."""
        from moelab.live.plots import plot_throughput

        return plot_throughput(self)

    def plot_memory(self):
        """Memory over the steps (max and min over ranks) and every rank's peak (moelab.live.plots)."""
        from moelab.live.plots import plot_memory

        return plot_memory(self)

    def plot_routing(self, layer: int | None = None):
        """The routing: a layer x expert heatmap and tokens per expert of `layer` (default the least balanced MoE
        layer) (moelab.live.plots)."""
        from moelab.live.plots import plot_routing

        return plot_routing(self, layer=layer)

    @property
    def pending_reason(self) -> str | None:
        """Why a PENDING SLURM job waits (squeue's reason, e.g. "Resources (waiting for resources to be free)");
        None otherwise."""
        ask = getattr(self.job, "pending_reason", None)
        return ask() if ask is not None and self.status == "PENDING" else None

    def progress(self) -> dict:
        """The latest facts for a progress line: status, step, total_steps, loss, tokens_per_s (and
        pending_reason while a SLURM job waits)."""
        # read from the end of the stream (and its first start): a bounded read however long the run
        steps, _ = tail_events(self.run_folder.metrics, kinds=("step",), limit=1, first=())
        starts, head = tail_events(self.run_folder.metrics, kinds=("start",), limit=1)
        starts = starts or head
        total = starts[-1].total_steps if starts else None
        last = steps[-1] if steps else None
        status = self.status
        return {"status": str(status), "step": last.step if last else (starts[-1].start_step if starts else 0),
                "total_steps": total, "loss": last.loss if last else None,
                "tokens_per_s": last.tokens_per_s if last else None,
                "pending_reason": self.pending_reason if status == "PENDING" else None}

    def __repr__(self) -> str:
        p = self.progress()
        loss = f", loss {p['loss']:.4f}" if p["loss"] is not None else ""
        job = f", job {self.job_id}" if self.job_id else ""
        steps = f"step {p['step']}/{p['total_steps']}" if p["total_steps"] else "not started"
        if p["pending_reason"]:
            steps += f" (waiting: {p['pending_reason']})"
        return f"Run({self.name!r}, {p['status']}, {steps}{loss}, {self.executor}{job}, folder={str(self.folder)!r})"

    def _repr_html_(self) -> str:
        import html

        return f"<code>{html.escape(repr(self))}</code>"

    # ------------------------------------------------------------------ bookkeeping
    def _update_info(self, **fields: Any) -> None:
        """What this Run learnt (a final status, a cancel request) goes to run.json; a folder written without
        a Session has none, and gets none."""
        self._info.update(fields)
        if "executor" in self._info:
            self.run_folder.write_info(self._info)
