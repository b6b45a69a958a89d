"""Session -> Run through the real executors: submitit's LocalExecutor, and a REAL local SLURM cluster.

Every job of one executor is submitted up front by a module fixture (so the slow ones, like the time-limit
job, overlap the others), then each test waits for and checks its own job. Each job has a fresh folder.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from moelab import Run, Sweep

pytestmark = pytest.mark.slow
EXECUTORS = ["local", pytest.param("slurm", marks=pytest.mark.slurm)]
WAIT_S = 240
LIVE_STEPS = 400
AUX = [0.0, 1e-3, 1e-2]


@pytest.fixture(scope="module", params=EXECUTORS)
def jobs(request, tmp_path_factory, small_session):
    small = small_session
    kind = request.param
    if kind == "slurm":
        request.getfixturevalue("slurm_cluster")
    root = tmp_path_factory.mktemp(f"jobs-{kind}")
    # jobs inherit this environment: one thread each, or a dozen concurrent CPU jobs thrash two cores
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    j = {"root": root}
    # longest first: it must outlive its 1 minute limit
    # (max_num_timeout=0: no requeue to continue from the checkpoint; SLURM's limits are whole minutes)
    j["timeout"] = small(train={"steps": 100000}).submit(kind, folder=root / "timeout", time=1, max_num_timeout=0)
    j["two"] = small(train={"steps": 6}, parallel={"ep": 2}).submit(kind, nproc=2, folder=root / "two", time=10)
    # LIVE_STEPS: long enough (seconds, even on a fast idle machine) to be caught mid-run by 0.3 s polling
    j["live"] = small(train={"steps": LIVE_STEPS}).submit(kind, folder=root / "live", time=10)
    j["fail"] = small(train={"steps": 6, "lr": 1e30}).submit(kind, folder=root / "fail", time=10)
    j["sweep"] = small(train={"steps": 4}).sweep({"model.moe.aux_loss_coeff": AUX}, executor=kind,
                                                  folder=root / "sweep", time=10)
    yield kind, j
    if threads is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = threads
    for r in [*j["sweep"], *(v for k, v in j.items() if k not in ("sweep", "root"))]:
        if not r.done:
            r.cancel()


def test_one_task_completes_and_metrics_are_read_while_it_runs(jobs):
    kind, j = jobs
    run = j["live"]
    seen_live = None
    end = time.monotonic() + WAIT_S
    while not run.done and time.monotonic() < end:
        n = len(run.metrics)
        if run.status == "RUNNING" and 0 < n < LIVE_STEPS:
            seen_live = n
            # another kernel (a fresh process) reopens the same run from its folder while it runs
            out = subprocess.run([sys.executable, "-c", "import sys; from moelab import Run; "
                                  "r = Run.load(sys.argv[1]); print(r.executor, r.job_id, len(r.metrics))",
                                  str(run.folder)], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            executor, job_id, n_other = out.stdout.split()
            assert (executor, job_id) == (kind, run.job_id) and int(n_other) >= n
            break
        time.sleep(0.3)
    assert seen_live, f"never saw the run RUNNING with some but not all steps (status {run.status})"
    run.wait(WAIT_S)
    assert run.status == "COMPLETED", run.error
    df = run.metrics
    assert list(df["step"]) == list(range(1, LIVE_STEPS + 1)) and np.isfinite(df["loss"]).all()
    assert df["loss"].iloc[-5:].mean() < df["loss"].iloc[:5].mean()
    assert run.summary["status"] == "COMPLETED" and run.summary["steps"] == LIVE_STEPS
    assert run.routing().shape == (LIVE_STEPS, 1, 4)
    assert "Job completed successfully" in run.logs(0)
    again = Run.load(run.folder)
    assert again.status == "COMPLETED" and again.error is None and len(again.metrics) == LIVE_STEPS


def test_two_tasks_ep2_match_one_process(jobs, tmp_path, small_session):
    kind, j = jobs
    run = j["two"].wait(WAIT_S)
    assert run.status == "COMPLETED", run.error
    ref = small_session(train={"steps": 6}).submit("inline", folder=tmp_path / "ref")
    assert ref.status == "COMPLETED", ref.error
    start = next(e for e in run.events if e["event"] == "start")
    assert start["env"]["world_size"] == 2 and start["env"]["layout"]["ep"] == 2
    np.testing.assert_allclose(run.metrics["loss"], ref.metrics["loss"], rtol=1e-4, atol=1e-5)
    assert run.logs(1), "rank 1 wrote no log"


def test_sweep_of_three(jobs):
    kind, j = jobs
    sweep = j["sweep"]
    assert isinstance(sweep, Sweep) and len(sweep) == 3
    assert sweep.wait(WAIT_S).status == ["COMPLETED"] * 3, [r.error for r in sweep]
    assert [r.config.model.moe.aux_loss_coeff for r in sweep] == AUX
    assert all("Job completed successfully" in r.logs(0) for r in sweep)
    aux = [r.metrics["aux_loss"].iloc[-1] for r in sweep]
    assert aux[0] == 0 and aux[1] > 0 and aux[2] > aux[1]
    again = Sweep.load(sweep.folder)
    assert [r.folder for r in again] == [r.folder for r in sweep]
    if kind == "slurm":
        # ONE job array: <array id>_0 .. _2, and sacct knows the three elements
        array_id = sweep[0].job_id.split("_")[0]
        assert sweep.job_ids == [f"{array_id}_{i}" for i in range(3)]
        script = next((sweep.folder / "submitit").glob("*submission.sh")).read_text()
        assert "#SBATCH --array=0-2" in script
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", array_id],
                             capture_output=True, text=True, check=True).stdout.split()
        assert sorted(out) == [f"{array_id}_{i}|COMPLETED" for i in range(3)]
    else:
        assert len(set(sweep.job_ids)) == 3


def test_cancel_a_running_job(jobs, small_session):
    kind, j = jobs
    run = j["cancel"] = small_session(train={"steps": 100000}).submit(kind, folder=j["root"] / "cancel", time=10)
    end = time.monotonic() + WAIT_S
    while not (run.status == "RUNNING" and len(run.metrics) > 0):
        assert time.monotonic() < end and not run.done, f"never running ({run.status}): {run.error}"
        time.sleep(0.2)
    Run.load(run.folder).cancel()  # as another kernel would: from the folder alone
    t0 = time.monotonic()
    run.wait(60)
    assert run.status == "CANCELLED"
    assert time.monotonic() - t0 < 60
    n = len(run.metrics)
    time.sleep(1.5)
    assert len(run.metrics) == n, "the job still writes after being cancelled"
    assert Run.load(run.folder).status == "CANCELLED"


def test_a_job_that_raises_is_failed_with_its_traceback(jobs):
    kind, j = jobs
    run = j["fail"].wait(WAIT_S)
    assert run.status == "FAILED"
    assert "NonFiniteLoss" in run.error and "Traceback" in run.error and "rank 0" in run.error
    assert Run.load(run.folder).status == "FAILED"


def test_a_job_over_its_time_limit_is_timeout(jobs):
    kind, j = jobs
    run = j["timeout"].wait(WAIT_S)
    assert run.status == "TIMEOUT", (run.status, run.error)
    assert "timed-out" in run.error and len(run.metrics) < 100000
    assert Run.load(run.folder).status == "TIMEOUT"


def test_ranks_let_idle_openmp_threads_sleep_unless_told_otherwise():
    """TrainJob and the rank entry point set OMP_WAIT_POLICY=PASSIVE before torch loads (the OpenMP runtime
    reads it once): importing them must not load torch, and a value the user set is kept."""
    code = ("import os, sys\nimport moelab.launch.executors, moelab.launch.entry as entry\n"
            "loaded = 'torch' in sys.modules\nentry.quiet_idle_threads()\nprint(loaded, os.environ['OMP_WAIT_POLICY'])")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "PASSIVE"], out.stderr
    out = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "ACTIVE"]


def test_rank_threads_follow_the_cores_the_process_may_use():
    """Under taskset (or a cgroup's cpuset) a rank starts one thread per core it may run on, not per core of the
    machine: more threads than cores is the oversubscription that made CPU steps crawl."""
    code = ("import os, torch\nfrom moelab.launch.executors import _limit_cpu_threads\n"
            "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n_limit_cpu_threads(1)\n"
            "print(torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1", out.stdout + out.stderr
