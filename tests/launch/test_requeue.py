"""Preemption through the real executors: a SLURM job told to stop (submitit's preemption signal) saves a
checkpoint at the step boundary, requeues itself and resumes, and its Run follows it under the same job id; a
SLURM job that may not requeue (JobRequeue=0, --no-requeue) ends PREEMPTED with a warning that says to resume it,
and Run.resume() continues it; a local job stopped by SIGTERM is PREEMPTED and Run.resume() continues it. All give
the losses of an uninterrupted run at every step."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from moelab import Run

pytestmark = pytest.mark.slow
# Long enough that the stop signal, sent once step 3 is in the stream, lands mid-run even on an idle machine
# (this model runs about 100 steps/s on 2 cores).
STEPS = 300
WAIT_S = 240


def _wait_for_step(run: Run, step: int) -> None:
    end = time.monotonic() + WAIT_S
    while not any(e["event"] == "step" and e["step"] >= step for e in run.events):
        assert time.monotonic() < end and not run.done, f"never reached step {step}: {run.status} {run.error}"
        time.sleep(0.1)


def _check_exact(run: Run, reference: Run) -> int:
    steps = list(run.metrics["step"])
    assert steps == list(range(1, STEPS + 1)), f"every step exactly once: {steps}"
    worst = max(abs(a - b) for a, b in zip(run.metrics["loss"], reference.metrics["loss"]))
    assert worst <= 1e-6, f"losses differ from the uninterrupted run by up to {worst}"
    starts = [e["start_step"] for e in run.events if e["event"] == "start"]
    assert len(starts) == 2 and starts[0] == 0 and 0 < starts[1] < STEPS
    return starts[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_session):
    run = small_session(train={"steps": STEPS}).submit("inline", folder=tmp_path_factory.mktemp("ref") / "r")
    assert run.status == "COMPLETED", run.error
    return run


def _release_when_requeued(job_id: str) -> None:
    """SLURM holds a requeued job back (BeginTime about two minutes ahead); let the test cluster start it soon.
    Not within the second of the requeue: slurmd refuses a start whose credential is no newer than the killed
    attempt's revocation ("Job credential revoked"), and the job then ends FAILED."""
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True, text=True).stdout
        if out.startswith("PENDING"):
            time.sleep(2.0)
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True)
            return
        time.sleep(0.2)


@pytest.mark.slurm
def test_a_preempted_slurm_job_requeues_itself_and_resumes_exactly(slurm_cluster, reference, small_session,
                                                                   tmp_path):
    run = small_session(train={"steps": STEPS}).submit("slurm", folder=tmp_path / "run", time=10)
    job_id = run.job_id
    _wait_for_step(run, 3)
    # what SLURM sends before preempting a job or at its time limit (submitit's signal, USR2)
    subprocess.run(["scancel", "--signal", "USR2", job_id], check=True)
    _release_when_requeued(job_id)
    run.wait(WAIT_S)
    assert run.status == "COMPLETED", (run.status, run.error)
    assert run.job_id == job_id, "the same job, requeued"
    resumed_at = _check_exact(run, reference)
    ends = [e["status"] for e in run.events if e["event"] == "end"]
    assert ends == ["PREEMPTED", "COMPLETED"]
    assert "Requeued job" in (run.folder / "logs/rank0.err").read_text() + (run.folder / "logs/rank0.out").read_text()
    print(f"\nRELIABILITY SLURM job {job_id} preempted at step {resumed_at}, requeued, resumed exactly")


@pytest.mark.slurm
def test_a_slurm_job_that_may_not_requeue_ends_preempted_and_says_how_to_resume(slurm_cluster, reference,
                                                                                 small_session, tmp_path):
    # --no-requeue: the job as a cluster with JobRequeue=0 submits it; `scontrol requeue` is refused for it
    run = small_session(train={"steps": STEPS}).submit("slurm", folder=tmp_path / "run", time=10,
                                                       sbatch={"no-requeue": True})
    job_id = run.job_id
    _wait_for_step(run, 3)
    subprocess.run(["scancel", "--signal", "USR2", job_id], check=True)
    run.wait(WAIT_S)
    assert run.status == "PREEMPTED" and run.error is None, (run.status, run.error)
    ends = [e for e in run.events if e["event"] == "end"]
    notes = [e for e in run.events if e["event"] == "warning" and e["kind"] == "not_requeued"]
    assert [e["status"] for e in ends] == ["PREEMPTED"] and len(notes) == 1
    assert notes[0]["message"].startswith(f"SLURM refused to requeue job {job_id} ")
    assert notes[0]["message"].endswith(f"checkpoint at step {ends[0]['step']}: continue it with "
                                        f"`moelab resume {run.folder}`")
    assert "Traceback" not in (run.folder / "logs/rank0.err").read_text()
    run.resume().wait(WAIT_S)
    assert run.status == "COMPLETED", (run.status, run.error)
    resumed_at = _check_exact(run, reference)
    print(f"\nRELIABILITY SLURM job {job_id} without requeue preempted at step {resumed_at}, ended PREEMPTED, "
          f"resumed by hand exactly")


def test_only_a_refused_requeue_ends_the_job_preempted(tmp_path):
    """The decision without a cluster: submitit's `scontrol requeue` failing is the refused requeue; any other
    failed command is an error. The run's stream gets the warning after its end; the summary comes back."""
    from moelab.contract.events import EndEvent
    from moelab.contract.folder import RunFolder, write_json
    from moelab.contract.stream import MetricsWriter
    from moelab.launch.executors import not_requeued, requeue_refused

    refused = subprocess.CalledProcessError(1, ["scontrol", "requeue", "42"])
    assert requeue_refused(refused)
    assert not requeue_refused(subprocess.CalledProcessError(1, ["scontrol", "show", "job"]))
    assert not requeue_refused(RuntimeError("scontrol requeue"))
    folder = RunFolder(tmp_path / "run")
    folder.path.mkdir()
    MetricsWriter(folder.metrics).emit(EndEvent(step=7, status="PREEMPTED"))
    write_json(folder.summary, {"status": "PREEMPTED"})
    assert not_requeued(folder.path, refused) == {"status": "PREEMPTED"}
    run = Run.load(folder.path)
    note = run.events[-1]
    assert note["event"] == "warning" and note["kind"] == "not_requeued" and note["step"] == 7
    assert note["message"].endswith(f"continue it with `moelab resume {folder.path}`")


def test_a_local_job_stopped_by_sigterm_is_preempted_and_resumes(reference, small_session, tmp_path):
    run = small_session(train={"steps": STEPS}).submit("local", folder=tmp_path / "run")
    _wait_for_step(run, 3)
    os.kill(int(run.job_id), signal.SIGTERM)  # submitit's local controller forwards it to its task
    run.wait(WAIT_S)
    assert run.status == "PREEMPTED", (run.status, run.error)
    assert Run.load(run.folder).status == "PREEMPTED"
    first_job = run.job_id
    run.resume().wait(WAIT_S)
    assert run.status == "COMPLETED", (run.status, run.error)
    assert run.job_id != first_job
    resumed_at = _check_exact(run, reference)
    print(f"\nRELIABILITY local job stopped by SIGTERM at step {resumed_at}, Run.resume() continued it exactly")
