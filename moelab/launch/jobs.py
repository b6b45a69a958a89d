"""Job objects: one run's job as its executor sees it, with the same five verbs for every executor.

    job = job_for(RunFolder("runs/tiny-..."))   # from run.json: InlineJob, LocalJob, SlurmJob or ExternalJob
    job.state()          # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT or PREEMPTED
    job.cancel()         # scancel / SIGTERM to the local controller; refused for a foreground run
    job.outcome()        # ('success', None), ('error', traceback) or (None, None): submitit's result files
    job.log(0, "err")    # what rank 0 wrote to stderr so far
    job.timed_out()      # the job ran into its time limit
    job.wait().summary() # block until it ends; the run's summary.json

Like submitit's one Job class per executor (its LocalJob and SlurmJob), each class holds what its executor
knows: the scheduler's state combined with the run's own stream (moelab.train.metrics), which tells how the
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

from moelab.run.folder import RunFolder, owner_gone
from moelab.train.metrics import read_events

# PREEMPTED: stopped by a signal after saving a checkpoint, and not requeued (a SLURM job that requeues itself
# goes back to PENDING and RUNNING under the same job id); run.resume() continues it.
STATES = ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED")
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED"})
# SLURM job states (sacct) -> Run states; anything not listed is PENDING
SLURM_STATES = {"RUNNING": "RUNNING", "COMPLETING": "RUNNING", "SUSPENDED": "RUNNING", "STOPPED": "RUNNING",
                "SIGNALING": "RUNNING", "STAGE_OUT": "RUNNING", "COMPLETED": "COMPLETED",
                "CANCELLED": "CANCELLED", "TIMEOUT": "TIMEOUT", "DEADLINE": "TIMEOUT", "FAILED": "FAILED",
                "NODE_FAIL": "FAILED", "OUT_OF_MEMORY": "FAILED", "BOOT_FAIL": "FAILED",
                "PREEMPTED": "PREEMPTED"}


class Job:
    """What every executor's job answers; this base knows only the run's stream (each executor adds its own).

        job = Job(RunFolder("runs/by-hand"), {})
        job.state()   # from the stream's last `end` or `error` event; RUNNING while there is none
    """

    executor = "external"
    records_status = False  # whether a terminal state is written back to run.json

    def __init__(self, folder: "RunFolder | str | Path", info: dict | None = None, handle=None):
        self.folder = folder if isinstance(folder, RunFolder) else RunFolder(folder)
        self.info = info if info is not None else self.folder.read_info()
        self.handle = handle  # the executor's own job object when this process submitted it

    @property
    def job_id(self) -> str | None:
        return self.info.get("job_id")

    def events(self) -> list[dict]:
        return read_events(self.folder.metrics, live=True)

    def state(self) -> str:
        return self.stream_state()

    def cancel(self) -> None:
        raise RuntimeError(f"run {self.folder.name} runs {self.executor} (in some process' foreground); it can only "
                           f"be stopped there (Ctrl-C)")

    def outcome(self) -> tuple[str | None, str | None]:
        return None, None

    def log(self, rank: int, stream: str) -> str:
        """What `rank` wrote to `stream` ("stdout" or "stderr"); empty where the output went elsewhere."""
        return ""

    def timed_out(self) -> bool:
        """submitit turns the end-of-time-limit signal into UncompletedJobError('... timed-out ...') when the
        job cannot requeue itself."""
        _, text = self.outcome()
        texts = [text or ""] + [e.get("message", "") for e in self.events() if e["event"] == "error"]
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

    def settled(self, job_id, status: str) -> str:
        """Accounting (sacct) lags the controller: a SLURM job that has ended can still read RUNNING there for a
        while. Once the stream's last attempt has ended (an `end` or `error` event after its last `start`) and
        sacct is not terminal yet, the controller's state (squeue) decides, or the stream's when the controller
        no longer knows the job."""
        events = self.events()
        starts = [i for i, e in enumerate(events) if e["event"] == "start"]
        if status in TERMINAL or not any(e["event"] in ("end", "error") for e in events[starts[-1] if starts else 0:]):
            return status
        from moelab.launch.slurm_checks import queue_state

        state = queue_state(str(job_id))
        if state == "":
            return self.stream_state()
        ended = SLURM_STATES.get(state or "")
        return ended if ended in TERMINAL else status

    def stream_state(self) -> str:
        """For a run without a scheduler to ask: the last terminal event of its stream."""
        for e in reversed(self.events()):
            if e["event"] == "end":
                return {"COMPLETED": "COMPLETED", "PREEMPTED": "PREEMPTED"}.get(e.get("status"), "CANCELLED")
            if e["event"] == "error":
                return "FAILED"
        return "RUNNING"


class InlineJob(Job):
    """A run trained in the foreground of one process (Session.submit("inline"), `moelab run`): it records its
    own end in run.json; while it runs, only that process can stop it.

        InlineJob(RunFolder("runs/a"), {"executor": "inline", "status": "COMPLETED"}).state()   # COMPLETED
    """

    executor = "inline"

    def log(self, rank: int, stream: str) -> str:
        """What the run's process printed while it trained (logs/rank0.out / .err, moelab.launch.submit.tee_output)."""
        try:
            return self.folder.rank_log(rank, "out" if stream == "stdout" else "err").read_text(errors="replace")
        except OSError:
            return ""

    def state(self) -> str:
        status = self.info.get("status") or self.stream_state()
        if status not in TERMINAL and owner_gone(self.info):
            # killed (kill -9, a dead kernel) before it could record its end: nobody will ever write it
            status = self.stream_state()
            status = status if status in TERMINAL else "FAILED"
            self.info = self.folder.update_info(
                status=status, error=f"owner process gone: pid {self.info.get('pid')} on "
                                     f"{self.info.get('host', 'this host')} ended without recording the run's end")
        return status


class ExternalJob(Job):
    """A run started without a Session: by torchrun or a script (only its stream is known), or on SLURM by
    slurm/moelab.sbatch (its start event names the SLURM job, and sacct / scancel serve it).

        job = ExternalJob(RunFolder("runs/sbatch-run"), {})
        job.state()    # sacct's state when the stream names a SLURM job, else the stream's
    """

    def slurm_id(self) -> str | None:
        start = next((e for e in self.events() if e["event"] == "start"), None)
        return ((start or {}).get("env") or {}).get("slurm_job_id")

    def state(self) -> str:
        job_id = self.slurm_id()
        if not job_id:
            return self.stream_state()
        try:
            lines = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "State", "-j", str(job_id)],
                                   capture_output=True, text=True, timeout=30).stdout.split("\n")
        except (OSError, subprocess.SubprocessError):
            lines = []
        states = [line.split()[0].rstrip("+") for line in lines if line.strip()]  # "CANCELLED by 0"
        status = SLURM_STATES.get(states[-1], "PENDING") if states else self.stream_state()
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

    def log(self, rank: int, stream: str) -> str:
        if not self.job_id:
            return ""
        paths = self.paths(rank)
        try:
            return (paths.stdout if stream == "stdout" else paths.stderr).read_text(errors="replace")
        except OSError:
            return ""

    def ended_state(self) -> str:
        """Status of a job whose processes are gone, from the result files, the stream and run.json."""
        kind, _ = self.outcome()
        events = self.events()
        ends = [e for e in events if e["event"] == "end"]
        preempted = bool(ends) and ends[-1].get("status") in ("PREEMPTED", "CANCELLED")
        if ends and ends[-1].get("status") == "CANCELLED":
            return "CANCELLED"  # checkpointed and ended at the step boundary after a cancel
        if kind == "success" and not preempted:
            return "COMPLETED"  # even if a cancel came too late to stop it
        if self.folder.read_info().get("cancel_requested") or self.info.get("cancel_requested"):
            return "CANCELLED"
        if kind == "success":
            return "PREEMPTED"
        if self.timed_out():
            return "TIMEOUT"
        if kind is None and any(e.get("status") == "COMPLETED" for e in ends):
            return "COMPLETED"
        return "FAILED"


class LocalJob(SubmititJob):
    """A run on submitit's LocalExecutor: background processes under one controller (pid = job id).

        job = LocalJob(RunFolder("runs/a"))    # info from run.json
        job.state(); job.cancel()              # SIGTERM to the controller, forwarded to its tasks
    """

    executor = "local"

    def alive(self) -> bool:
        proc = getattr(self.handle, "_process", None)
        return proc.poll() is None if proc is not None else controller_alive(self.job_id)

    def state(self) -> str:
        return "RUNNING" if self.alive() else self.ended_state()

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
    """A run on submitit's SlurmExecutor: the state is sacct's (through submitit), cancel is scancel.

        job = SlurmJob(RunFolder("runs/a"))
        job.state()     # PENDING until the scheduler starts it
    """

    executor = "slurm"

    def state(self) -> str:
        import submitit

        if self.handle is None:
            self.handle = submitit.SlurmJob(Path(self.info["submitit_folder"]), str(self.job_id))
        try:
            state = self.handle.get_info(mode="force").get("State")
        except Exception:  # sacct unreachable: fall back to what the files say
            state = None
        state = (state or "UNKNOWN").split()[0].rstrip("+")
        if state == "UNKNOWN":
            # not in accounting yet (just submitted), or accounting is off: finished tasks leave result files
            return self.ended_state() if self.outcome()[0] is not None else "PENDING"
        if state == "NODE_FAIL":
            return self.after_node_failure()
        status = self.settled(self.job_id, SLURM_STATES.get(state, "PENDING"))
        if status == "FAILED" and self.timed_out():
            status = "TIMEOUT"
        return status

    def after_node_failure(self) -> str:
        """A node of the job died. SLURM requeues a batch job then (JobRequeue=1, its default): the attempt
        reads NODE_FAIL in sacct, and in submitit's cache, which stops asking about a job once it read an end,
        while the controller holds the job again under the same id (PENDING, then RUNNING from the last
        checkpoint). So the controller's state decides, and the stream's once the controller forgot the job:
        a requeued job is not over, and a resume beside it would be a second job in the folder."""
        from moelab.launch.slurm_checks import queue_state

        again = queue_state(str(self.job_id))
        if again == "":
            return self.stream_state()
        return SLURM_STATES.get(again, "PENDING") if again else "FAILED"

    def cancel(self) -> None:
        subprocess.run(["scancel", str(self.job_id)], check=False, capture_output=True)

    def pending_reason(self) -> str | None:
        """Why the scheduler still holds the job (squeue's reason, explained); None when it is not pending."""
        from moelab.launch.slurm_checks import pending_reason

        return pending_reason(self.job_id)


JOBS = {"inline": InlineJob, "local": LocalJob, "slurm": SlurmJob, "external": ExternalJob}


def job_for(folder: "RunFolder | str | Path", info: dict | None = None, handle=None) -> Job:
    """The Job of a run folder, by the executor its run.json names (none: external)."""
    folder = folder if isinstance(folder, RunFolder) else RunFolder(folder)
    info = info if info is not None else folder.read_info()
    return JOBS[info.get("executor", "external")](folder, info, handle)


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
