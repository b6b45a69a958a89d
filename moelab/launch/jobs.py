"""Job objects: one run's job as its executor sees it, with the same five verbs for every executor.

    job = job_for(RunFolder("runs/tiny-..."))   # moelab.launch.executors: its executor's InlineJob, LocalJob, ...
    job.state()          # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT or PREEMPTED
    job.cancel()         # scancel / SIGTERM to the local controller; refused for a foreground run
    job.outcome()        # ('success', None), ('error', traceback) or (None, None): submitit's result files
    job.log(0, "err")    # what rank 0 wrote to stderr so far
    job.timed_out()      # the job ran into its time limit
    job.wait().summary() # block until it ends; the run's summary.json

Like submitit's one Job class per executor (its LocalJob and SlurmJob), each class holds what its executor
knows: the scheduler's state combined with the run's own stream (moelab.contract.stream), which tells how the
trainer ended. A Run (moelab.run) holds one and asks it; the Run never branches on the executor's name.

Owner liveness (is the process or job that owns the folder still there?) is `state()` not being terminal.
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import time
from pathlib import Path

from moelab.contract.events import EndEvent, ErrorEvent, Event, StartEvent
from moelab.contract.folder import RunFolder, owner_gone
from moelab.contract.status import STATES, TERMINAL, RunStatus, reconcile, slurm_job_state, stream_end_status
from moelab.contract.stream import read_events, tail_events

__all__ = ["Job", "InlineJob", "ExternalJob", "LocalJob", "SlurmJob", "STATES", "TERMINAL"]


class NotCancellable(RuntimeError):
    """A run that only the process training it can stop (an inline run, a run started without a scheduler).

        try: job_for(RunFolder("runs/inline-run")).cancel()
        except NotCancellable as e: print(e)   # ... only that process can stop it (Ctrl-C there, ...)
    """


class Job:
    """What every executor's job answers; this base knows only the run's stream (each executor adds its own).

        job = Job(RunFolder("runs/by-hand"), {})
        job.state()   # from the stream's last `end` or `error` event; RUNNING while there is none
    """

    executor = "external"
    records_status = False  # whether a terminal state is written back to run.json
    cancellable = False  # whether cancel() can stop it from another process (else it raises NotCancellable)

    def __init__(self, folder: "RunFolder | str | Path", info: dict | None = None, handle=None):
        self.folder = folder if isinstance(folder, RunFolder) else RunFolder(folder)
        self.info = info if info is not None else self.folder.read_info()
        self.handle = handle  # the executor's own job object when this process submitted it

    @property
    def job_id(self) -> str | None:
        return self.info.get("job_id")

    @property
    def owner_pid(self):
        """The process that owns the run while it trains (None where no process here does)."""
        return self.info.get("pid")

    def events(self) -> list[Event]:
        """Every event of the stream, typed (moelab.contract.events)."""
        return read_events(self.folder.metrics, live=True, typed=True)

    def last_attempt(self) -> tuple[list[Event], "StartEvent | None"]:
        """The `start`, `end` and `error` events of the stream's last attempt (everything after its last start,
        read from the end of the stream: a bounded read whatever its length), and the run's first start."""
        last, head = tail_events(self.folder.metrics, kinds=("start", "end", "error"))
        starts = [i for i, e in enumerate(last) if isinstance(e, StartEvent)]
        first = head[0] if head else (last[starts[0]] if starts else None)
        return last[starts[-1] if starts else 0:], first

    def stream_end(self) -> "RunStatus | None":
        """How the stream's last attempt ended (its `end` status, FAILED after an error event); None while it
        has not ended."""
        attempt, _ = self.last_attempt()
        end = next((e for e in reversed(attempt) if isinstance(e, EndEvent)), None)
        return stream_end_status(end.status if end else None, any(isinstance(e, ErrorEvent) for e in attempt))

    def state(self) -> RunStatus:
        return self.stream_state()

    def cancel(self) -> None:
        pid = self.info.get("pid")
        where, how = ((f"pid {pid} on {self.info.get('host', 'this host')}", f"Ctrl-C there, or `kill -INT {pid}`")
                      if pid else ("some process' foreground", "Ctrl-C there"))
        raise NotCancellable(f"run {self.folder.name} runs {self.executor} in {where}; only that process can stop it "
                             f"({how})")

    def outcome(self) -> tuple[str | None, str | None]:
        return None, None

    def killed(self) -> list[tuple[int, str]]:
        """(rank, how) for each rank a signal killed, where the executor can tell (SubmititJob); else []."""
        return []

    def log(self, rank: int, stream: str) -> str:
        """What `rank` wrote to `stream` ("stdout" or "stderr"); empty where the output went elsewhere."""
        return ""

    def timed_out(self) -> bool:
        """submitit turns the end-of-time-limit signal into UncompletedJobError('... timed-out ...') when the
        job cannot requeue itself."""
        _, text = self.outcome()
        texts = [text or ""] + [e.message for e in self.last_attempt()[0] if isinstance(e, ErrorEvent)]
        if any("UncompletedJobError" in t and "timed-out" in t for t in texts):
            return True
        # the signal can also arrive before the training code runs (or be swallowed by an import): submitit's
        # handler still logs it on rank 0
        return "this job is timed-out" in self.log(0, "stderr")

    def wait(self, timeout: float | None = None, poll_s: float = 0.5) -> "Job":
        """Block until the job ends (or `timeout` seconds pass); returns self. A failed job does not raise."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.state() not in TERMINAL and (end is None or time.monotonic() < end):
            time.sleep(poll_s)
        return self

    def summary(self) -> dict | None:
        """The run's summary.json (rank 0 writes it at the end), None before."""
        return self.folder.read_summary()

    def settled(self, job_id, status: RunStatus) -> RunStatus:
        """A SLURM job's status (sacct's, `status`) combined with its stream. Accounting lags the controller: a
        job that has ended can still read RUNNING there for a while; once the stream's last attempt has ended
        (an `end` or `error` event after its last `start`) and sacct is not terminal yet, the controller's state
        (squeue) decides, or the stream's when the controller does not know the job. Then the stream says how a
        cleanly exited job ended (moelab.contract.status.reconcile: PREEMPTED stays PREEMPTED)."""
        ended = self.stream_end()
        if ended is not None and status not in TERMINAL:
            state = slurm_job_state(job_id, sources=("squeue",))
            if state is None:
                return ended
            now = RunStatus.from_slurm(state)
            status = now if now.terminal else status
        return reconcile(status, ended)

    def stream_state(self) -> RunStatus:
        """For a run without a scheduler to ask: how the stream's last attempt ended, RUNNING while it has not."""
        return self.stream_end() or RunStatus.RUNNING


class InlineJob(Job):
    """A run trained in the foreground of one process (Session.submit("inline"), `moelab run`): it records its
    own end in run.json; while it runs, only that process can stop it.

        InlineJob(RunFolder("runs/a"), {"executor": "inline", "status": "COMPLETED"}).state()   # COMPLETED
    """

    executor = "inline"

    def log(self, rank: int, stream: str) -> str:
        """What the run's process printed while it trained (logs/rank0.out / .err, moelab.launch.inline.tee_output)."""
        try:
            return self.folder.rank_log(rank, "out" if stream == "stdout" else "err").read_text(errors="replace")
        except OSError:
            return ""

    def state(self) -> RunStatus:
        status = RunStatus(self.info.get("status") or self.stream_state())
        if status not in TERMINAL and owner_gone(self.info):
            # killed (kill -9, a dead kernel) before it could record its end: nobody will ever write it
            status = self.stream_state()
            status = status if status in TERMINAL else RunStatus.FAILED
            self.info = self.folder.note_info(
                status=status, error=f"owner process gone: pid {self.info.get('pid')} on "
                                     f"{self.info.get('host', 'this host')} ended without recording the run's end")
        return status


class ExternalJob(Job):
    """A run started without a Session: by torchrun or a script (only its stream is known), or on SLURM by
    slurm/moelab.sbatch (its start event names the SLURM job, and sacct / scancel serve it).

        job = ExternalJob(RunFolder("runs/sbatch-run"), {})
        job.state()    # sacct's state when the stream names a SLURM job, else the stream's
    """

    @property
    def cancellable(self) -> bool:
        return bool(self.slurm_id())

    def slurm_id(self) -> str | None:
        _, start = self.last_attempt()
        return start.env.slurm_job_id if start is not None and start.env is not None else None

    def state(self) -> RunStatus:
        job_id = self.slurm_id()
        if not job_id:
            return self.stream_state()
        state = slurm_job_state(job_id, sources=("sacct",))
        status = RunStatus.from_slurm(state) if state else self.stream_state()
        return self.settled(job_id, status)

    def cancel(self) -> None:
        job_id = self.slurm_id()
        if not job_id:
            super().cancel()
        subprocess.run(["scancel", str(job_id)], check=False, capture_output=True)


class SubmititJob(Job):
    """What the two submitit executors share: result files per task, logs, and how an ended job ended.

        job.paths(0).stderr        # submitit's stderr file of task 0 (logs/rank0.err links to it)
    """

    records_status = True
    cancellable = True

    def paths(self, task: int):
        """submitit's files of `task` (stdout, stderr, result pickle)."""
        from submitit.core.utils import JobPaths

        return JobPaths(Path(self.info["submitit_folder"]), job_id=str(self.job_id), task_id=task)

    def outcome(self) -> tuple[str | None, str | None]:
        """What submitit's result files say (an error in any task wins)."""
        if not self.job_id:
            return None, None
        kinds = []
        for task in range(int(self.info.get("ntasks", 1))):
            try:
                with open(self.paths(task).result_pickle, "rb") as f:
                    kind, value = pickle.load(f)
            except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError):
                continue
            if kind == "error":
                return "error", str(value)
            kinds.append(kind)
        return ("success", None) if kinds else (None, None)

    def killed(self) -> list[tuple[int, str]]:
        """(rank, "signal N (SIGNAME), pid P") for each rank whose process a signal killed, as its
        stand-in wrote in its log (moelab.launch.warm.KILLED): a SIGKILL leaves no traceback to show."""
        import re

        found = []
        for task in range(int(self.info.get("ntasks", 1))):
            m = re.search(r"rank process (\d+) was killed by signal (\d+) \((\w+|\?)\)", self.log(task, "stderr"))
            if m:
                found.append((task, f"signal {m[2]} ({m[3]}), pid {m[1]}"))
        return found

    def log(self, rank: int, stream: str) -> str:
        if not self.job_id:
            return ""
        paths = self.paths(rank)
        try:
            return (paths.stdout if stream == "stdout" else paths.stderr).read_text(errors="replace")
        except OSError:
            return ""

    def ended_state(self) -> RunStatus:
        """Status of a job whose processes are gone, from the result files, the stream and run.json."""
        kind, _ = self.outcome()
        ends = [e for e in tail_events(self.folder.metrics, kinds=("end",))[0]]
        last = RunStatus(ends[-1].status) if ends else None
        if last == RunStatus.CANCELLED:
            return RunStatus.CANCELLED  # checkpointed and ended at the step boundary after a cancel
        if kind == "success" and last != RunStatus.PREEMPTED:
            return RunStatus.COMPLETED  # even if a cancel came too late to stop it
        if self.folder.read_info().get("cancel_requested") or self.info.get("cancel_requested"):
            return RunStatus.CANCELLED
        if kind == "success":
            return RunStatus.PREEMPTED
        if self.timed_out():
            return RunStatus.TIMEOUT
        if kind is None and any(e.status == "COMPLETED" for e in ends):
            return RunStatus.COMPLETED
        return RunStatus.FAILED


class LocalJob(SubmititJob):
    """A run on submitit's LocalExecutor: background processes under one controller (pid = job id).

        job = LocalJob(RunFolder("runs/a"))    # info from run.json
        job.state(); job.cancel()              # SIGTERM to the controller, forwarded to its tasks
    """

    executor = "local"

    @property
    def owner_pid(self):
        """The controller (pid = job id)."""
        return self.info.get("pid") or self.job_id

    def alive(self) -> bool:
        proc = getattr(self.handle, "_process", None)
        return proc.poll() is None if proc is not None else controller_alive(self.job_id)

    def state(self) -> RunStatus:
        return RunStatus.RUNNING if self.alive() else self.ended_state()

    def preempt(self, signum: int = signal.SIGTERM) -> None:
        """Send `signum` to the controller, which forwards it to every task: they checkpoint at the step
        boundary and end PREEMPTED (`moelab run` does this when it receives SIGTERM)."""
        proc = getattr(self.handle, "_process", None)
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signum)
        elif controller_alive(self.job_id):
            os.kill(int(self.job_id), signum)

    def cancel(self) -> None:
        """SIGTERM to the controller, which forwards it to the tasks: with cancel_requested in run.json (Run.cancel
        writes it first) they checkpoint at the step boundary and end CANCELLED, as on SLURM (scancel)."""
        self.preempt(signal.SIGTERM)


class SlurmJob(SubmititJob):
    """A run on submitit's SlurmExecutor: the state is squeue's and sacct's (moelab.contract.status's
    slurm_job_state), cancel is scancel.

        job = SlurmJob(RunFolder("runs/a"))
        job.state()     # PENDING until the scheduler starts it
    """

    executor = "slurm"

    def state(self) -> RunStatus:
        state = slurm_job_state(self.job_id, sources=("sacct",))
        if state is None or state == "UNKNOWN":
            # not in accounting yet (just submitted), or accounting is off: finished tasks leave result files
            return self.ended_state() if self.outcome()[0] is not None else RunStatus.PENDING
        if state == "NODE_FAIL":
            return self.after_node_failure()
        status = self.settled(self.job_id, RunStatus.from_slurm(state))
        if status == RunStatus.FAILED and self.timed_out():
            status = RunStatus.TIMEOUT
        return status

    def after_node_failure(self) -> RunStatus:
        """A node of the job died. SLURM requeues a batch job then (JobRequeue=1, its default): the attempt
        reads NODE_FAIL in sacct, and in submitit's cache, which stops asking about a job once it read an end,
        while the controller holds the job again under the same id (PENDING, then RUNNING from the last
        checkpoint). So the controller's state decides, and the stream's once the controller forgot the job:
        a requeued job is not over, and a resume beside it would be a second job in the folder."""
        again = slurm_job_state(self.job_id, sources=("squeue",))
        return self.stream_state() if again is None else RunStatus.from_slurm(again)

    def cancel(self) -> None:
        subprocess.run(["scancel", str(self.job_id)], check=False, capture_output=True)

    def pending_reason(self) -> str | None:
        """Why the scheduler still holds the job (squeue's reason, explained); None when it is not pending."""
        from moelab.launch.slurm_checks import pending_reason

        return pending_reason(self.job_id)


def controller_alive(job_id) -> bool:
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
