"""A run's status, defined once: the RunStatus enum, its terminal set, SLURM's states mapped onto it, the one
SLURM state query, and the one rule that reconciles a scheduler's view with the run's own stream.

    RunStatus.PREEMPTED.terminal                       # True
    RunStatus.from_slurm("OUT_OF_MEMORY")              # RunStatus.FAILED
    slurm_job_state(1234)                              # "COMPLETED" (squeue -t all, else sacct), None if unknown
    reconcile(RunStatus.COMPLETED, "PREEMPTED")        # RunStatus.PREEMPTED: the stream knows how it ended

Standard library only (the contract layer): launch, run, live and the CLI all stand on it.
"""
from __future__ import annotations

import enum
import shutil
import subprocess


class RunStatus(enum.StrEnum):
    """Where a run is. A str: ``RunStatus.COMPLETED == "COMPLETED"`` and run.json stores the plain name.

        status = RunStatus("PREEMPTED"); status.terminal   # True: nothing runs until `moelab resume`
    """

    def __repr__(self) -> str:  # shown as the plain name it stands for (a list of statuses in a notebook)
        return repr(self.value)

    PENDING = "PENDING"        # submitted, not started
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"    # every step trained
    FAILED = "FAILED"          # an error (a rank's error event, a crash, a killed owner)
    CANCELLED = "CANCELLED"    # stopped by `moelab cancel` / Run.cancel (checkpointed at the step boundary)
    TIMEOUT = "TIMEOUT"        # the scheduler's time limit, without a requeue
    PREEMPTED = "PREEMPTED"    # stopped by a signal after a checkpoint, not requeued: `moelab resume` continues it

    @property
    def terminal(self) -> bool:
        """Has the run ended (no further change of state)?"""
        return self in TERMINAL

    @classmethod
    def from_slurm(cls, state: str) -> "RunStatus":
        """SLURM's job state (squeue %T or sacct State, "CANCELLED by 0" and "RUNNING+" as they come) as a
        RunStatus; a state not listed (CONFIGURING, REQUEUED, RESIZING, ...) is PENDING."""
        return SLURM_STATES.get((state or "").split()[0].rstrip("+") if state else "", cls.PENDING)


TERMINAL = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.TIMEOUT,
                      RunStatus.PREEMPTED})
STATES = tuple(RunStatus)

# SLURM's job states -> RunStatus (anything not listed: PENDING). The terminal ones are SLURM_ENDED.
SLURM_STATES = {
    "RUNNING": RunStatus.RUNNING, "COMPLETING": RunStatus.RUNNING, "SUSPENDED": RunStatus.RUNNING,
    "STOPPED": RunStatus.RUNNING, "SIGNALING": RunStatus.RUNNING, "STAGE_OUT": RunStatus.RUNNING,
    "COMPLETED": RunStatus.COMPLETED, "CANCELLED": RunStatus.CANCELLED, "TIMEOUT": RunStatus.TIMEOUT,
    "DEADLINE": RunStatus.TIMEOUT, "FAILED": RunStatus.FAILED, "NODE_FAIL": RunStatus.FAILED,
    "OUT_OF_MEMORY": RunStatus.FAILED, "BOOT_FAIL": RunStatus.FAILED, "PREEMPTED": RunStatus.PREEMPTED,
    "REVOKED": RunStatus.CANCELLED, "SPECIAL_EXIT": RunStatus.FAILED,
}
# SLURM job states after which no process of the job runs
SLURM_ENDED = frozenset(s for s, status in SLURM_STATES.items() if status in TERMINAL)

_TIMEOUT_S = 20
QUERIES = {"squeue": ["squeue", "-h", "-t", "all", "-o", "%T", "-j"],        # the controller: knows an end first
           "sacct": ["sacct", "-X", "-n", "-P", "-o", "State", "-j"]}        # accounting: remembers it longer


def slurm_job_state(job_id, sources: "tuple[str, ...]" = ("squeue", "sacct")) -> "str | None":
    """SLURM's state of a job ("RUNNING", "COMPLETED", "CANCELLED", ...), from the first of `sources` that
    knows it: the controller (squeue -t all, which knows an end before accounting does and keeps it for
    MinJobAge), then accounting (sacct, once the controller has forgotten the job). None when none of them
    answers or knows the job. The one place moelab asks SLURM about a job."""
    for source in sources:
        cmd = QUERIES[source]
        if shutil.which(cmd[0]) is None:
            continue
        try:
            out = subprocess.run([*cmd, str(job_id)], capture_output=True, text=True, timeout=_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError):
            continue
        states = [line.split()[0].rstrip("+") for line in out.stdout.splitlines() if line.strip()]  # "CANCELLED by 0"
        if out.returncode == 0 and states:
            return states[-1]
    return None


def stream_end_status(end_status: "str | None", failed: bool) -> "RunStatus | None":
    """How the stream's last attempt ended: its `end` event's status, FAILED after an error event, None while
    it has neither."""
    if end_status:
        return RunStatus(end_status) if end_status in RunStatus.__members__ else RunStatus.FAILED
    return RunStatus.FAILED if failed else None


def reconcile(scheduler: "RunStatus | str", stream: "RunStatus | str | None") -> RunStatus:
    """The one rule that combines the scheduler's view of a job with the run's stream (`stream`: how its last
    attempt ended, stream_end_status). A job whose processes exited cleanly reads COMPLETED to the scheduler
    whatever the trainer did: after `scancel --signal=TERM` the trainer checkpoints, writes `end` PREEMPTED and
    exits 0, and sacct says COMPLETED. So a clean exit is what the stream says (PREEMPTED or CANCELLED); every
    other scheduler state stands (a job still running, requeued, killed, timed out)."""
    scheduler = RunStatus(scheduler)
    if scheduler == RunStatus.COMPLETED and stream in (RunStatus.PREEMPTED, RunStatus.CANCELLED):
        return RunStatus(stream)
    return scheduler
