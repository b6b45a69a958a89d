"""The job verbs of the command line (`moelab run --executor`, `status`, `cancel`) and the sbatch template for
users without a notebook, run for real (local executor; the template on the local SLURM cluster)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moelab import Run

from support import SMALL_CLI as SMALL
from support import moelab_cli as moelab

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]



def test_run_follows_a_local_job_then_status_and_cancel(tmp_path):
    out = moelab("run", "tiny", *SMALL, "--steps", "5", "--executor", "local", "--out", tmp_path / "a",
                 "--cluster", "time=10")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("submitted a: executor local, job ")
    assert any(line.startswith("[RUNNING]") for line in lines) and "[COMPLETED]  step 5/5" in out.stdout
    assert "a: COMPLETED" in lines[-1]
    status = moelab("status", tmp_path / "a")
    assert status.returncode == 0 and "[COMPLETED]  step 5/5" in status.stdout and "local" in status.stdout

    # a long job, cancelled from another process by folder
    follower = subprocess.Popen([sys.executable, "-m", "moelab", "run", "tiny", *SMALL, "--steps", "100000",
                                 "--executor", "local", "--out", str(tmp_path / "b")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 240
        while not ((tmp_path / "b/metrics.jsonl").exists() and len(Run.load(tmp_path / "b").metrics) > 0):
            assert time.monotonic() < end and follower.poll() is None, follower.communicate()
            time.sleep(0.3)
        cancel = moelab("cancel", tmp_path / "b")
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        assert "b: CANCELLED" in cancel.stdout
        stdout, _ = follower.communicate(timeout=60)
        assert follower.returncode == 1 and "b: CANCELLED" in stdout
    finally:
        if follower.poll() is None:
            follower.kill()
    listing = moelab("status", tmp_path)
    assert "[COMPLETED]" in listing.stdout and "[CANCELLED]" in listing.stdout
    assert moelab("cancel", tmp_path / "a").stdout.startswith("nothing to cancel")
    bad = moelab("run", "tiny", "--executor", "local", "--cluster", "partition=gpu", "--out", tmp_path / "c")
    assert bad.returncode == 2 and "valid local options" in bad.stderr


@pytest.mark.slurm
def test_sbatch_template_runs_two_tasks_and_is_followed_from_its_folder(slurm_cluster, tmp_path):
    """`sbatch slurm/moelab.sbatch CONFIG --set ...`: one task per rank, the same entry point, EP=2 over gloo;
    Run.load / `moelab status` / `moelab cancel` find the SLURM job from the run folder alone."""
    def sbatch(name, tasks, *sets, wait=False):
        env = {**os.environ, "MOELAB_RUN_DIR": str(tmp_path / name), "OMP_NUM_THREADS": "1"}
        cmd = ["sbatch", "--parsable", f"--ntasks-per-node={tasks}", "--cpus-per-task=1", "--time=5",
               f"--output={tmp_path}/{name}-%j.out", *(["--wait"] if wait else []),
               str(REPO / "slurm/moelab.sbatch"), "tiny", *SMALL, *sets]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
        return out.returncode, out.stdout.strip()

    rc, job = sbatch("two", 2, "--set", "train.steps=3", "--set", "parallel.ep=2")
    assert rc == 0
    rc, long_job = sbatch("long", 1, "--set", "train.steps=100000")
    assert rc == 0
    end = time.monotonic() + 240
    while not ((tmp_path / "long/metrics.jsonl").exists() and len(Run.load(tmp_path / "long").metrics) > 0):
        assert time.monotonic() < end, (tmp_path / f"long-{long_job}.out").read_text()
        time.sleep(0.3)
    while Run.load(tmp_path / "long").status != "RUNNING":  # accounting may lag the first metrics line
        assert time.monotonic() < end, Run.load(tmp_path / "long").status
        time.sleep(0.3)
    cancel = moelab("cancel", tmp_path / "long")
    assert cancel.returncode == 0 and "long: CANCELLED" in cancel.stdout, cancel.stdout + cancel.stderr
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < end, f"job {job} still queued"
        time.sleep(0.5)
    run = Run.load(tmp_path / "two")
    assert run.status == "COMPLETED", (tmp_path / f"two-{job}.out").read_text()
    assert run.executor == "external" and list(run.metrics["step"]) == [1, 2, 3]
    start = next(e for e in run.events if e["event"] == "start")
    assert start["env"]["world_size"] == 2 and start["env"]["slurm_job_id"] == job
    assert "[COMPLETED]  step 3/3" in moelab("status", tmp_path / "two").stdout
    # a layout that does not fit the task count fails before any task starts, with the fix in the message
    rc, bad = sbatch("bad", 3, "--set", "parallel.ep=2", wait=True)
    assert rc != 0 and "config error: parallel.ep" in (tmp_path / f"bad-{bad}.out").read_text()


def test_status_into_a_pipe_closed_early_ends_quietly(tmp_path):
    """Issue 42.13: `moelab status RUNS | head -1` ended in a BrokenPipeError traceback. 1,500 finished runs give
    more lines than a pipe buffers, so the writer meets the closed pipe."""
    import json

    for i in range(1500):
        (tmp_path / f"run{i:04d}").mkdir()
        (tmp_path / f"run{i:04d}" / "run.json").write_text(json.dumps({"executor": "inline", "status": "COMPLETED"}))
    p = subprocess.run(f"{sys.executable} -m moelab status {tmp_path} | head -1; echo rc=${{PIPESTATUS[0]}}",
                       shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=300)
    assert p.stdout.splitlines()[0].startswith(str(tmp_path / "run0000")) and "rc=0" in p.stdout, p.stdout
    assert p.stderr == "", p.stderr
