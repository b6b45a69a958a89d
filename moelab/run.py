"""A Run: one training run in a folder, followed from any kernel while it runs and after it ends.

    run = Session("tiny", train={"steps": 50}).submit("local")
    run.status            # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT or PREEMPTED
    run.resume()          # a stopped run (PREEMPTED, TIMEOUT, FAILED, ...) continues from its last checkpoint
    run.metrics.tail()    # the step events so far (a pandas DataFrame where pandas is installed)
    run.wait().summary    # blocks until the run ends; never raises because the run failed: status tells
    run.error             # the failing rank's traceback
    Run.load("runs/tiny-20261130-101500")   # the same run, from another kernel

Everything a Run knows is in its folder: config.yaml, metrics.jsonl (the stream the trainer writes; see
moelab.train.metrics), summary.json, run.json (executor, job id and submitit folder, written at submission),
logs/ (links to each rank's stdout and stderr). State comes from the scheduler (sacct on SLURM, the controller
process for the local executor) combined with the stream and submitit's result files.
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import time
from pathlib import Path
from typing import Any

# PREEMPTED: stopped by a signal after saving a checkpoint, and not requeued (a SLURM job that requeues itself
# goes back to PENDING and RUNNING under the same job id); run.resume() continues it.
STATES = ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED")
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED"})
RUN_FILE = "run.json"
SWEEP_FILE = "sweep.json"
# SLURM job states (sacct) -> Run states; anything not listed is PENDING
_SLURM_STATES = {"RUNNING": "RUNNING", "COMPLETING": "RUNNING", "SUSPENDED": "RUNNING", "STOPPED": "RUNNING",
                 "SIGNALING": "RUNNING", "STAGE_OUT": "RUNNING", "COMPLETED": "COMPLETED",
                 "CANCELLED": "CANCELLED", "TIMEOUT": "TIMEOUT", "DEADLINE": "TIMEOUT", "FAILED": "FAILED",
                 "NODE_FAIL": "FAILED", "OUT_OF_MEMORY": "FAILED", "BOOT_FAIL": "FAILED",
                 "PREEMPTED": "PREEMPTED"}
_POLL_S = 1.0  # a scheduler is asked at most this often per Run


class Run:
    """A handle on one run folder. Build one with Session.submit(), Run.load(folder) or moelab.runs()."""

    def __init__(self, folder: "str | Path", info: dict | None = None, job=None):
        self.folder = Path(folder)
        self._info = info if info is not None else _read_json(self.folder / RUN_FILE) or {}
        self._job = job                 # the submitit Job when this kernel submitted it
        self._checked = (0.0, None)     # (time, status) of the last scheduler query

    # ------------------------------------------------------------------ opening
    @classmethod
    def load(cls, folder: "str | Path") -> "Run":
        """Reopen a run (finished or running, submitted from any kernel) from its folder."""
        folder = Path(folder)
        if not (folder / RUN_FILE).exists() and not (folder / "metrics.jsonl").exists() \
                and not (folder / "config.yaml").exists():
            raise FileNotFoundError(f"{folder} is not a moelab run folder (no run.json, config.yaml or "
                                    f"metrics.jsonl)")
        return cls(folder)

    @property
    def name(self) -> str:
        return self._info.get("name") or self.folder.name

    @property
    def executor(self) -> str:
        """'inline', 'local' or 'slurm' ('external' for a folder written without a Session, e.g. torchrun)."""
        return self._info.get("executor", "external")

    @property
    def job_id(self) -> str | None:
        return self._info.get("job_id")

    @property
    def config(self):
        from moelab.config import load_config

        return load_config(self.folder / "config.yaml")

    # ------------------------------------------------------------------ state
    @property
    def status(self) -> str:
        final = self._info.get("status")
        if final in TERMINAL:
            return final
        when, cached = self._checked
        if cached is not None and time.monotonic() - when < _POLL_S:
            return cached
        # another kernel may have cancelled it, or seen it end
        self._info = _read_json(self.folder / RUN_FILE) or self._info
        final = self._info.get("status")
        if final in TERMINAL:
            return final
        if self.executor == "local":
            status = self._local_status()
        elif self.executor == "slurm":
            status = self._slurm_status()
        elif self.executor == "external" and self._external_slurm_id():
            status = self._sacct_status(self._external_slurm_id())  # e.g. started by slurm/moelab.sbatch
        else:  # inline (a live one records its own end) or external
            status = final if self.executor == "inline" and final else self._stream_status()
        self._checked = (time.monotonic(), status)
        if status in TERMINAL and self.executor in ("local", "slurm"):
            self._update_info(status=status)
        return status

    @property
    def done(self) -> bool:
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
        """Stop the run (scancel on SLURM, SIGINT to the local job's controller). Its status becomes
        CANCELLED once the scheduler confirms."""
        if self.status in TERMINAL:
            return
        self._update_info(cancel_requested=True)
        self._checked = (0.0, None)
        if self.executor == "slurm":
            import subprocess

            subprocess.run(["scancel", str(self.job_id)], check=False, capture_output=True)
        elif self.executor == "local":
            proc = getattr(self._job, "_process", None)
            if proc is not None:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)  # submitit's controller stops its tasks on SIGINT
            elif _local_controller_alive(self.job_id):
                os.kill(int(self.job_id), signal.SIGINT)
        elif self.executor == "external" and self._external_slurm_id():
            import subprocess

            subprocess.run(["scancel", str(self._external_slurm_id())], check=False, capture_output=True)
        else:
            raise RuntimeError(f"run {self.name} runs {self.executor} (in some process' foreground); it can only "
                               f"be stopped there (Ctrl-C)")

    def resume(self, **cluster_options) -> "Run":
        """Continue a stopped run from its last checkpoint, on the same executor with the same options (those
        given replace them); returns this Run, which now follows the new job. The metrics stream continues
        with no step missing or repeated. Not needed after a SLURM preemption or time limit: the job requeues
        itself and this Run follows it.

            run = Run.load("runs/tiny-20261130-101500")   # PREEMPTED
            run.resume().wait().status                     # COMPLETED
        """
        from moelab.launch.resume import resume_config
        from moelab.launch.submit import run_inline, submit_folders, validate

        if not self.done:
            raise RuntimeError(f"run {self.name} is {self.status}; resume it once it has stopped (or cancel it)")
        cfg = resume_config(self.folder)
        kind = self.executor if self.executor in ("local", "slurm") else "inline"
        options = {**self._info.get("options", {}), **cluster_options} if kind != "inline" else {}
        nproc = 1 if options.get("gpus_per_node") or kind == "inline" else \
            int(self._info.get("ntasks", 1)) // int(options.get("nodes", 1))
        kind, world = validate(kind, nproc, options, [cfg])
        for link in (self.folder / "logs").glob("rank*"):
            if link.is_symlink():  # they point at the previous job's files
                link.unlink()
        if kind == "inline":
            new = run_inline(self.folder)
        else:
            root = Path(self._info.get("submitit_folder") or self.folder / "submitit")
            new = submit_folders(kind, [self.folder], nproc, options, root, world)[0]
        self._info, self._job, self._checked = new._info, new._job, (0.0, None)
        return self

    def _local_status(self) -> str:
        proc = getattr(self._job, "_process", None)
        alive = proc.poll() is None if proc is not None else _local_controller_alive(self.job_id)
        if alive:
            return "RUNNING"
        return self._ended_status()

    def _slurm_status(self) -> str:
        import submitit

        if self._job is None:
            self._job = submitit.SlurmJob(self._submitit_folder, str(self.job_id))
        try:
            state = self._job.get_info(mode="force").get("State")
        except Exception:  # sacct unreachable: fall back to what the files say
            state = None
        state = (state or "UNKNOWN").split()[0].rstrip("+")
        if state == "UNKNOWN":
            # not in accounting yet (just submitted), or accounting is off: finished tasks leave result files
            return self._ended_status() if self._outcome()[0] is not None else "PENDING"
        status = _SLURM_STATES.get(state, "PENDING")
        if status == "FAILED" and self._timed_out():
            status = "TIMEOUT"
        return status

    def _ended_status(self) -> str:
        """Status of a job whose processes are gone, from the result files, the stream and run.json."""
        kind, _ = self._outcome()
        if kind == "success" and not self._preempted():
            return "COMPLETED"  # even if a cancel came too late to stop it
        if self._info.get("cancel_requested"):
            return "CANCELLED"
        if kind == "success":
            return "PREEMPTED"
        if self._timed_out():
            return "TIMEOUT"
        if kind is None and any(e["event"] == "end" and e.get("status") == "COMPLETED" for e in self.events):
            return "COMPLETED"
        return "FAILED"

    def _external_slurm_id(self) -> str | None:
        """The SLURM job of a run started outside a Session (slurm/moelab.sbatch), from its start event."""
        start = next((e for e in self.events if e["event"] == "start"), None)
        return ((start or {}).get("env") or {}).get("slurm_job_id")

    def _sacct_status(self, job_id: str) -> str:
        import subprocess

        try:
            lines = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "State", "-j", str(job_id)],
                                   capture_output=True, text=True, timeout=30).stdout.split("\n")
        except (OSError, subprocess.SubprocessError):
            lines = []
        states = [line.split()[0].rstrip("+") for line in lines if line.strip()]  # "CANCELLED by 0"
        return _SLURM_STATES.get(states[-1], "PENDING") if states else self._stream_status()

    def _stream_status(self) -> str:
        """For a run without a scheduler to ask: the last terminal event of its stream."""
        for e in reversed(self.events):
            if e["event"] == "end":
                return {"COMPLETED": "COMPLETED", "PREEMPTED": "PREEMPTED"}.get(e.get("status"), "CANCELLED")
            if e["event"] == "error":
                return "FAILED"
        return "RUNNING"

    def _preempted(self) -> bool:
        """The trainer's last `end` event says PREEMPTED (it stopped on a signal after a checkpoint)."""
        ends = [e for e in self.events if e["event"] == "end"]
        return bool(ends) and ends[-1].get("status") == "PREEMPTED"

    def _timed_out(self) -> bool:
        """submitit turns the end-of-time-limit signal into UncompletedJobError('... timed-out ...') when the
        job cannot requeue itself."""
        _, text = self._outcome()
        texts = [text or ""] + [e.get("message", "") for e in self.events if e["event"] == "error"]
        if any("UncompletedJobError" in t and "timed-out" in t for t in texts):
            return True
        # the signal can also arrive before the training code runs (or be swallowed by an import): submitit's
        # handler still logs it on rank 0
        return "this job is timed-out" in self._log(0, "stderr")

    def _outcome(self) -> tuple[str | None, str | None]:
        """('success', None), ('error', traceback) or (None, None): what submitit's result files say (an
        error in any task wins)."""
        if self.executor not in ("local", "slurm") or not self.job_id:
            return None, None
        kinds = []
        for task in range(int(self._info.get("ntasks", 1))):
            path = self._paths(task).result_pickle
            try:
                with open(path, "rb") as f:
                    kind, value = pickle.load(f)
            except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError):
                continue
            if kind == "error":
                return "error", str(value)
            kinds.append(kind)
        return ("success", None) if kinds else (None, None)

    # ------------------------------------------------------------------ what the run wrote
    @property
    def events(self) -> list[dict]:
        """All events of metrics.jsonl so far (see moelab.train.metrics for the schema)."""
        from moelab.train.metrics import read_events

        return read_events(self.folder / "metrics.jsonl", live=True)

    @property
    def metrics(self):
        """The step events as a table: scalar fields and memory.* columns (routing is in .routing())."""
        rows = []
        for e in self.events:
            if e["event"] != "step":
                continue
            row = {k: v for k, v in e.items() if k not in ("event", "schema", "routing", "health", "memory")}
            row.update({f"memory.{k}": v for k, v in (e.get("memory") or {}).items() if k != "per_rank"})
            rows.append(row)
        try:
            import pandas as pd
        except ImportError:
            return rows
        return pd.DataFrame(rows) if rows else pd.DataFrame(columns=["step", "loss", "tokens_per_s", "step_time_s"])

    @property
    def evals(self):
        """The held-out evaluations (train.eval_every): step, loss, perplexity, batches, tokens per eval event."""
        rows = [{k: e.get(k) for k in ("step", "loss", "perplexity", "batches", "tokens")}
                for e in self.events if e["event"] == "eval"]
        try:
            import pandas as pd
        except ImportError:
            return rows
        return pd.DataFrame(rows, columns=["step", "loss", "perplexity", "batches", "tokens"])

    def expert_tokens(self, layer: int = 0, step: int | None = None, top: int = 5):
        """Which tokens each expert of MoE layer `layer` receives most (train.expert_tokens_every): one row per
        expert and rank with token_id, token (decoded with the run's tokenizer), count and share; `step` None =
        the latest record. ``.plot_expert_tokens(layer)`` draws it (moelab.train.expert_tokens)."""
        from moelab.train.expert_tokens import expert_token_table

        return expert_token_table(self.folder, layer, step, top)

    def plot_expert_tokens(self, layer: int = 0, step: int | None = None, top: int = 5):
        from moelab.train.expert_tokens import plot_expert_tokens

        return plot_expert_tokens(self.folder, layer, step, top)

    def routing(self):
        """Tokens routed to each expert: a numpy array [steps, moe_layers, num_experts]."""
        import numpy as np

        steps = [e["routing"]["tokens_per_expert"] for e in self.events if e["event"] == "step" and e.get("routing")]
        if steps:
            return np.asarray(steps, dtype=np.float64)
        m = self.config.model
        return np.zeros((0, m.num_layers - m.num_dense_layers, m.moe.num_experts))

    @property
    def summary(self) -> dict | None:
        data = _read_json(self.folder / "summary.json")
        if data is not None:
            return data
        for e in reversed(self.events):
            if e["event"] == "end":
                return e.get("summary")
        return None

    @property
    def error(self) -> str | None:
        """The failing rank's traceback (from the stream's error event, else submitit's record of the
        exception, else the tail of rank 0's stderr); None while nothing failed."""
        errors = [e for e in self.events if e["event"] == "error"]
        if errors:
            first = errors[0]
            return f"rank {first.get('rank')} at step {first.get('step')}: {first.get('message')}\n" \
                   f"{first.get('traceback', '')}"
        kind, text = self._outcome()
        if kind == "error":
            return text
        if self.status in ("FAILED", "TIMEOUT"):
            tail = self._log(0, "stderr").splitlines()[-40:]
            return "\n".join(tail) or f"the job ended as {self.status} without an error message"
        return None

    def logs(self, rank: int = 0) -> str:
        """What `rank` has printed so far (stdout, then stderr). Empty for inline runs: their output went to
        the calling process."""
        out, err = self._log(rank, "stdout"), self._log(rank, "stderr")
        return out + (("\n" if out and not out.endswith("\n") else "") + err if err else "")

    def _log(self, rank: int, stream: str) -> str:
        if self.executor not in ("local", "slurm") or not self.job_id:
            return ""
        paths = self._paths(rank)
        path = paths.stdout if stream == "stdout" else paths.stderr
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""

    # ------------------------------------------------------------------ views (other modules draw them)
    def dashboard(self):
        """A live widget (moelab.live) that follows this run."""
        from moelab.live import dashboard

        return dashboard(self)

    def plot_throughput(self):
        from moelab.live.plots import plot_throughput

        return plot_throughput(self)

    def plot_memory(self):
        from moelab.live.plots import plot_memory

        return plot_memory(self)

    def plot_routing(self, layer: int | None = None):
        from moelab.live.plots import plot_routing

        return plot_routing(self, layer=layer)

    def progress(self) -> dict:
        """The latest facts for a progress line: status, step, total_steps, loss, tokens_per_s."""
        events = self.events
        total = next((e.get("total_steps") for e in events if e["event"] == "start"), None)
        last = next((e for e in reversed(events) if e["event"] == "step"), None)
        return {"status": self.status, "step": last["step"] if last else 0, "total_steps": total,
                "loss": last.get("loss") if last else None, "tokens_per_s": last.get("tokens_per_s") if last else None}

    def __repr__(self) -> str:
        p = self.progress()
        loss = f", loss {p['loss']:.4f}" if p["loss"] is not None else ""
        job = f", job {self.job_id}" if self.job_id else ""
        return f"Run({self.name!r}, {p['status']}, step {p['step']}/{p['total_steps'] or '?'}{loss}, " \
               f"{self.executor}{job}, folder={str(self.folder)!r})"

    def _repr_html_(self) -> str:
        import html

        return f"<code>{html.escape(repr(self))}</code>"

    # ------------------------------------------------------------------ bookkeeping
    @property
    def _submitit_folder(self) -> Path:
        return Path(self._info["submitit_folder"])

    def _paths(self, task: int):
        from submitit.core.utils import JobPaths

        return JobPaths(self._submitit_folder, job_id=str(self.job_id), task_id=task)

    def _update_info(self, **fields: Any) -> None:
        self._info.update(fields)
        if self.executor != "external":
            write_json(self.folder / RUN_FILE, self._info)


class Sweep(list):
    """The runs of one Session.sweep(): a list of Runs with group operations.

        sweep = Session("tiny").sweep({"model.moe.aux_loss_coeff": [0, 1e-3, 1e-2]}, executor="slurm")
        sweep.wait().status      # ['COMPLETED', 'COMPLETED', 'COMPLETED']
        sweep.compare()
    """

    def __init__(self, runs=(), folder: "str | Path | None" = None):
        super().__init__(runs)
        self.folder = Path(folder) if folder is not None else None

    @classmethod
    def load(cls, folder: "str | Path") -> "Sweep":
        folder = Path(folder)
        info = _read_json(folder / SWEEP_FILE)
        if info is None:
            raise FileNotFoundError(f"{folder} is not a sweep folder (no {SWEEP_FILE})")
        return cls([Run.load(folder / r) for r in info["runs"]], folder)

    @property
    def status(self) -> list[str]:
        return [r.status for r in self]

    @property
    def done(self) -> bool:
        return all(r.done for r in self)

    @property
    def job_ids(self) -> list[str | None]:
        return [r.job_id for r in self]

    def wait(self, timeout: float | None = None) -> "Sweep":
        end = None if timeout is None else time.monotonic() + timeout
        for r in self:
            r.wait(None if end is None else max(0.0, end - time.monotonic()))
        return self

    def cancel(self) -> None:
        for r in self:
            r.cancel()

    def dashboard(self):
        from moelab.live import dashboard

        return dashboard(self)

    def compare(self):
        from moelab.compare import compare

        return compare(self)

    def __repr__(self) -> str:
        where = f" in {str(self.folder)!r}" if self.folder else ""
        return f"Sweep({len(self)} runs{where}: " + ", ".join(f"{r.name}: {r.status}" for r in self) + ")"


def runs(root: "str | Path" = "runs") -> list[Run]:
    """Every run folder under `root` (sweeps included), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = {p.parent for name in (RUN_FILE, "metrics.jsonl")
             for p in list(root.glob(f"*/{name}")) + list(root.glob(f"*/*/{name}")) + list(root.glob(name))}
    return [Run(f) for f in sorted(found, key=lambda f: (_created(f), str(f)))]


def _created(folder: Path) -> float:
    info = _read_json(folder / RUN_FILE) or {}
    if "created" in info:
        return float(info["created"])
    try:
        return (folder / "config.yaml").stat().st_mtime
    except OSError:
        return 0.0


def _local_controller_alive(job_id) -> bool:
    """Is the local executor's controller (pid = job id) still running? A zombie, or a recycled pid running
    something else, counts as gone."""
    try:
        pid = int(job_id)
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except (OSError, ValueError, TypeError, IndexError):
        if job_id is None:
            return False
        try:  # not Linux: fall back to a signal-0 probe
            os.kill(int(job_id), 0)
            return True
        except (OSError, ValueError):
            return False
    return state != "Z" and b"submitit" in cmd


def _read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, data: Any) -> None:
    """Write atomically (another kernel may be reading it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
