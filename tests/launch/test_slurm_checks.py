"""SLURM requests that can never run, against the REAL local cluster (slurm/local/start.sh: one node): SLURM
itself leaves them PENDING (squeue says why); check_request refuses them before submission, naming the option,
the value, what the partition has and the fix; requests that fit pass; without sinfo nothing is checked."""
from __future__ import annotations

import subprocess
import time
import uuid

import pytest

from moelab.config import ConfigError
from moelab.launch.slurm_checks import check_request, partitions, pending_reason

pytestmark = pytest.mark.slurm


@pytest.fixture
def debug(slurm_cluster):
    """The cluster's default partition, as sinfo reports it."""
    part = next(p for p in partitions() if p.default)
    return part


def _sbatch(*args: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", *args, "--wrap", "true"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def _reason(job: str) -> "str | None":
    """The job's pending reason once the scheduler has looked at it (right after sbatch it may be "None")."""
    end = time.monotonic() + 60
    while (said := pending_reason(job)) is None and time.monotonic() < end:
        time.sleep(0.5)
    return said


def _scancel(job: str) -> None:
    subprocess.run(["scancel", job], capture_output=True, timeout=60)


@pytest.mark.parametrize("options, sbatch_args, reason", [
    (lambda p: {"nodes": p.nodes + 1}, lambda p: [f"--nodes={p.nodes + 1}"], "Partition"),
    (lambda p: {"cpus_per_task": p.cpus + 1}, lambda p: [f"--cpus-per-task={p.cpus + 1}"], "Partition"),
], ids=["nodes", "cpus_per_task"])
def test_what_slurm_leaves_pending_forever_is_refused_before_submission(debug, options, sbatch_args, reason):
    # SLURM accepts it and never runs it: PartitionConfig at first, then e.g. PartitionNodeLimit
    job = _sbatch(*sbatch_args(debug))
    try:
        said = _reason(job)
    finally:
        _scancel(job)
    assert said is not None and said.startswith(reason) and "(" in said, said
    request = options(debug)
    (name, value), = request.items()
    with pytest.raises(ConfigError) as e:
        check_request(request, None)
    assert str(e.value).startswith(f"{name}={value}: ") and f"partition {debug.name!r}" in str(e.value)
    have = debug.nodes if name == "nodes" else debug.cpus
    assert f"has {have} " in str(e.value) and f"ask for {name} <= {have}" in str(e.value)


def test_cpus_count_for_every_task_of_a_node(debug):
    tasks = 2
    with pytest.raises(ConfigError, match=rf"cpus_per_task=\d+ x {tasks} tasks per node = \d+: a node of "
                                          rf"partition '{debug.name}' has {debug.cpus} CPUs; ask for "
                                          rf"cpus_per_task <= {debug.cpus // tasks}"):
        check_request({"cpus_per_task": debug.cpus // tasks + 1, "tasks_per_node": tasks}, None)


def test_memory_and_gpus_a_node_does_not_have_are_refused_naming_what_it_has(debug):
    over_gb = debug.mem_mb // 1024 + 1
    for mem in (over_gb, f"{over_gb}G", f"{debug.mem_mb + 1}M", f"{debug.mem_mb + 1}"):
        with pytest.raises(ConfigError, match=rf"mem={mem!r} \([\d,]+ MB\): a node of partition '{debug.name}' "
                                              rf"has {debug.mem_mb:,} MB; ask for mem <= {debug.mem_mb // 1024}G"):
            check_request({"mem": mem}, None)
    if debug.gpus:
        pytest.skip("this cluster's nodes have GPUs")
    with pytest.raises(ConfigError, match=rf"gpus_per_node=1: partition '{debug.name}' has no GPUs .*leave "
                                          rf"gpus_per_node out"):
        check_request({"gpus_per_node": 1}, None)


def test_requests_that_fit_pass(debug):
    check_request({}, None)
    check_request({"nodes": debug.nodes, "cpus_per_task": debug.cpus, "mem": f"{debug.mem_mb}M", "time": "1:00:00",
                   "tasks_per_node": 1}, debug.name)
    check_request({"cpus_per_task": 1, "tasks_per_node": debug.cpus, "mem": 1}, None)


def test_an_unknown_partition_is_refused_listing_the_real_ones(debug):
    with pytest.raises(ConfigError, match=rf"partition='nosuch': no such partition on this cluster; "
                                          rf"partitions: .*{debug.name}"):
        check_request({}, "nosuch")


@pytest.fixture
def short_partition(slurm_cluster):
    """A second partition on the same node with a 5-minute limit (created for this test, then deleted)."""
    name = f"short{uuid.uuid4().hex[:6]}"
    node = subprocess.run(["sinfo", "-h", "-o", "%N"], capture_output=True, text=True).stdout.split()[0]
    made = subprocess.run(["scontrol", "create", f"PartitionName={name}", f"Nodes={node}", "MaxTime=5",
                           "Default=NO", "State=UP"], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a partition here: {made.stderr.strip()}")
    try:
        yield name
    finally:
        subprocess.run(["scontrol", "delete", f"PartitionName={name}"], capture_output=True)


def test_time_above_the_partitions_limit_is_refused(short_partition):
    job = _sbatch("-p", short_partition, "--time=10")
    try:
        said = _reason(job)
    finally:
        _scancel(job)
    assert said is not None and said.startswith("Partition"), said  # PartitionConfig, then PartitionTimeLimit
    for limit in (10, "0:10:00", "1-00:00:00"):
        with pytest.raises(ConfigError, match=rf"time={limit!r}: partition '{short_partition}' allows at most 5 "
                                              rf"minutes; ask for time <= 5 \(or another partition: "):
            check_request({"time": limit}, short_partition)
    with pytest.raises(ConfigError, match=r"time \(default 60 min\): .* allows at most 5 minutes"):
        check_request({}, short_partition)  # moelab's default limit would not fit either
    check_request({"time": 5}, short_partition)


def test_a_pending_jobs_reason_and_none_once_it_is_not_pending(slurm_cluster):
    job = _sbatch("--hold")
    try:
        assert _reason(job) == "JobHeldUser (held by its user; release it with scontrol release)"
    finally:
        _scancel(job)
    assert pending_reason(job) is None
    assert pending_reason("999999999") is None


def test_session_submit_refuses_before_anything_is_submitted(debug, small_session, tmp_path):
    folder = tmp_path / "run"
    with pytest.raises(ConfigError, match=rf"nodes={debug.nodes + 1}: partition '{debug.name}' has"):
        small_session().submit("slurm", folder=folder, nodes=debug.nodes + 1, time=5)
    assert not folder.exists(), "refused before the run folder was made"


def test_without_sinfo_nothing_is_checked(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no SLURM clients on PATH
    assert partitions() is None
    check_request({"nodes": 10**6, "gpus_per_node": 64}, None)
    assert pending_reason("1") is None


# ---------------------------------------------------------------------- accounting lags the controller
def _finished_job() -> str:
    job = _sbatch()
    end = time.monotonic() + 120
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < end, f"job {job} still queued"
        time.sleep(0.3)
    return job


def test_the_controller_knows_a_job_has_ended_before_accounting_may(slurm_cluster):
    from moelab.contract.status import slurm_job_state

    job = _finished_job()
    assert slurm_job_state(job, sources=("squeue",)) == "COMPLETED"
    assert slurm_job_state("999999999", sources=("squeue",)) is None  # not known to the controller
    assert slurm_job_state(job) == "COMPLETED"  # the controller first, then accounting


@pytest.fixture
def lagging_sacct(tmp_path, monkeypatch):
    """sacct as it answers while slurmdbd has not yet recorded a job's end: still RUNNING. (The lag cannot be
    produced on demand on a live cluster; squeue, the run folder and everything else stay real.)"""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text("#!/bin/sh\necho RUNNING\n")
    (bin_dir / "sacct").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")


def _external_run(folder, job: str, end: "str | None"):
    """A run folder as slurm/moelab.sbatch leaves it: a start event naming the SLURM job, maybe an end."""
    from moelab.contract.events import parse_event
    from moelab.contract.stream import MetricsWriter

    folder.mkdir()
    w = MetricsWriter(folder / "metrics.jsonl")
    w.emit(parse_event(dict(event="start", total_steps=1, start_step=0,
                            env={"slurm_job_id": job, "world_size": 1})))
    w.emit(parse_event(dict(event="step", step=1, loss=1.0)))
    if end:
        w.emit(parse_event(dict(event="end", step=1, status=end, summary={})))
    w.close()


def test_a_run_whose_job_ended_is_not_running_while_accounting_lags(slurm_cluster, lagging_sacct, tmp_path):
    from moelab import Run

    job = _finished_job()
    _external_run(tmp_path / "done", job, "COMPLETED")
    assert Run.load(tmp_path / "done").status == "COMPLETED"  # the controller says COMPLETED
    _external_run(tmp_path / "gone", "999999999", "COMPLETED")
    assert Run.load(tmp_path / "gone").status == "COMPLETED"  # the controller forgot it: the stream's end
    _external_run(tmp_path / "live", job, None)
    assert Run.load(tmp_path / "live").status == "RUNNING"  # no end in the stream: accounting is not overruled


def test_a_stream_that_ended_preempted_is_preempted_whatever_slurm_says(slurm_cluster, tmp_path):
    """Issue 33.4: `scancel --signal=TERM` lets the trainer checkpoint, write `end` PREEMPTED and exit 0, so
    SLURM (squeue and sacct) says COMPLETED; the run is PREEMPTED (resumable), in Run.status and `moelab status`."""
    import sys

    from moelab import Run

    job = _finished_job()  # a real job that exited 0: COMPLETED to the controller and to accounting
    _external_run(tmp_path / "pre", job, "PREEMPTED")
    assert Run.load(tmp_path / "pre").status == "PREEMPTED"
    out = subprocess.run([sys.executable, "-m", "moelab", "status", str(tmp_path / "pre")], capture_output=True,
                         text=True, timeout=120)
    assert "[PREEMPTED]  step 1/1" in out.stdout, out.stdout + out.stderr
    _external_run(tmp_path / "cancel", job, "CANCELLED")
    assert Run.load(tmp_path / "cancel").status == "CANCELLED"
    _external_run(tmp_path / "done", job, "COMPLETED")
    assert Run.load(tmp_path / "done").status == "COMPLETED"
