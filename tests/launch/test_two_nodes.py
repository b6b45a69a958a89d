"""Two SLURM nodes for real: the cluster of slurm/local/start-two-nodes.sh runs each node's slurmd in its own
network and UTS namespace, so a job's ranks live on two hosts with their own names and addresses, and the
rendezvous (MASTER_ADDR = the first node's name, the port from the job id, gloo's address from each host's own
name) crosses the bridge between them, as on a real cluster.

A 2-node x 2-task job through Session.submit("slurm", nodes=2, ...) gives the losses of one process. A node that
dies mid-run (its slurmd and its job processes SIGKILLed) ends the job's attempt as SLURM's NODE_FAIL and SLURM
requeues the job (JobRequeue=1, SLURM's default); the Run stays PENDING meanwhile (not FAILED: a resume beside
SLURM's requeue would be a second job in the folder), and once the node is back the same job restarts from the
last periodic checkpoint and reaches the uninterrupted losses.
"""
from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from support import run_one_thread

from moelab import Run, Session

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
START = REPO / "slurm/local/start-two-nodes.sh"
SLURM_CONF = "/etc/slurm-2n/slurm.conf"
NODES = ("moelab-n1", "moelab-n2")
STEPS = 40
EVERY = 10     # train.checkpoint_every: what a dead node leaves to resume from
WAIT_S = 420   # 4 ranks on 2 cores, and a dead node is declared after SlurmdTimeout


def tiny(**parallel) -> Session:
    """The tiny preset, micro-batches small enough for 4 data-parallel ranks, periodic checkpoints."""
    return Session("tiny", train={"steps": STEPS, "micro_batch_size": 2, "device": "cpu",
                                  "checkpoint_every": EVERY}, parallel=parallel)


def _sinfo_nodes() -> dict:
    r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=30,
                       env={**os.environ, "SLURM_CONF": SLURM_CONF})
    return dict(line.split() for line in r.stdout.splitlines()) if r.returncode == 0 else {}


def _start_nodes() -> None:
    """slurm/local/start-two-nodes.sh: starts what is missing, brings a killed node back, waits until idle."""
    r = subprocess.run(["bash", str(START)], capture_output=True, text=True, timeout=600,
                       env={k: v for k, v in os.environ.items() if k != "SLURM_CONF"})
    assert r.returncode == 0, f"{START} failed:\n{r.stdout}\n{r.stderr}"


@pytest.fixture(scope="module")
def two_nodes():
    """The two-node cluster, started when its nodes are not both usable (root on Debian/Ubuntu only)."""
    if os.path.exists(SLURM_CONF) and all(_sinfo_nodes().get(n) in ("idle", "mixed") for n in NODES):
        return
    if os.geteuid() != 0 or not Path("/etc/debian_version").exists():
        pytest.skip("the two-node SLURM cluster needs root on Debian/Ubuntu (slurm/local/start-two-nodes.sh)")
    _start_nodes()


@pytest.fixture
def on_two_nodes(two_nodes, monkeypatch):
    """SLURM commands of this process (submitit's sbatch / sacct / scancel, moelab's sinfo / squeue) and of the
    job go to the two-node cluster."""
    monkeypatch.setenv("SLURM_CONF", SLURM_CONF)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same training in one process (one thread, like a rank): the losses every layout must give."""
    run_dir = tmp_path_factory.mktemp("ref") / "r"
    run_one_thread(tiny().config, run_dir)
    return Run.load(run_dir).metrics["loss"].to_numpy()


def _hosts(run: Run) -> dict:
    """rank -> the host it ran on, from submitit's first line in each rank's log."""
    hosts = {}
    for log in sorted((run.folder / "logs").glob("rank*.out")):
        m = re.search(r"hostname=(\S+),.*global_rank=(\d+)\(", log.read_text())
        if m:
            hosts[int(m.group(2))] = m.group(1)
    return hosts


def _sacct_attempts(job_id: str) -> list:
    """The state of every attempt of the job (a requeued job has one accounting record per start)."""
    return subprocess.run(["sacct", "-X", "-D", "-n", "-P", "-o", "State", "-j", job_id], capture_output=True,
                          text=True, timeout=30).stdout.split()


def _ended_attempts(job_id: str, wait_s: float = 120.0) -> list:
    """_sacct_attempts once accounting has recorded the job's end: slurmdbd takes the controller's record
    asynchronously, so a job the controller (and the Run) already knows as ended can still read RUNNING there
    for a while on a loaded machine (seen under OMP_NUM_THREADS=2 on two cores)."""
    end = time.monotonic() + wait_s
    while True:
        attempts = _sacct_attempts(job_id)
        live = not attempts or attempts[-1] in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "SUSPENDED")
        if not live or time.monotonic() > end:
            return attempts
        time.sleep(0.5)


def _queue(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                          timeout=30).stdout.strip()


def test_two_nodes_two_tasks_each_reproduce_one_process(on_two_nodes, reference, tmp_path):
    run = tiny(ep=2).submit("slurm", folder=tmp_path / "run", nodes=2, tasks_per_node=2, time=15)
    run.wait(WAIT_S)
    assert run.status == "COMPLETED", (run.status, run.error)
    assert _hosts(run) == {0: "moelab-n1", 1: "moelab-n1", 2: "moelab-n2", 3: "moelab-n2"}
    start = next(e for e in run.events if e["event"] == "start")
    assert start["env"]["world_size"] == 4 and start["env"]["host"] == "moelab-n1"
    assert list(run.metrics["step"]) == list(range(1, STEPS + 1))
    np.testing.assert_allclose(run.metrics["loss"], reference, rtol=1e-5, atol=1e-5)
    assert _ended_attempts(run.job_id) == ["COMPLETED"]


def test_an_ep_group_over_both_nodes_crosses_between_them_once_per_token_and_node(on_two_nodes, reference, tmp_path):
    """EP over all 4 ranks spans both nodes: parallel.ep_dispatch=auto takes the node-aware dispatcher
    (moelab.parallel.ep_hierarchical), its nodes from SLURM's tasks per node, and gives the losses of one process."""
    run = tiny(ep=4).submit("slurm", folder=tmp_path / "run", nodes=2, tasks_per_node=2, time=15)
    run.wait(WAIT_S)
    assert run.status == "COMPLETED", (run.status, run.error)
    assert _hosts(run) == {0: "moelab-n1", 1: "moelab-n1", 2: "moelab-n2", 3: "moelab-n2"}
    np.testing.assert_allclose(run.metrics["loss"], reference, rtol=1e-5, atol=1e-5)
    comm = [e["comm"] for e in run.events if e["event"] == "step"]
    assert all(c["inter_node_rows"] > 0 and "dispatch_rows" not in c for c in comm), comm[0]


def test_a_node_killed_mid_run_requeues_the_job_which_resumes_exactly(on_two_nodes, reference, tmp_path):
    run = tiny(ep=2).submit("slurm", folder=tmp_path / "run", nodes=2, tasks_per_node=2, time=15)
    job_id = run.job_id
    end = time.monotonic() + WAIT_S
    # past the first periodic checkpoint, well before the end
    while not any(e["event"] == "step" and e["step"] >= EVERY + 2 for e in run.events):
        assert time.monotonic() < end and not run.done, f"never reached step {EVERY + 2}: {run.status} {run.error}"
        time.sleep(0.1)
    try:
        # the node dies: its slurmd, slurmstepd and ranks are SIGKILLed at once
        subprocess.run(["bash", str(START), "kill-node", "moelab-n2"], check=True, timeout=60)
        killed_at = max(e["step"] for e in run.events if e["event"] == "step")
        assert killed_at < STEPS, "the node died after the run had finished"
        # SLURM declares the node dead (SlurmdTimeout), ends the job NODE_FAIL and requeues it (JobRequeue=1, its
        # default): all along the Run is not over, so nobody resumes it a second time beside SLURM
        seen = set()
        while "NODE_FAIL" not in _sacct_attempts(job_id) or _queue(job_id) != "PENDING":
            seen.add(run.status)
            assert time.monotonic() < end, f"no NODE_FAIL and requeue: {_sacct_attempts(job_id)} {_queue(job_id)}"
            time.sleep(0.1)
        seen.add(run.status)
        assert seen <= {"RUNNING", "PENDING"}, f"the Run read {seen} while SLURM requeued its job"
        assert Run.load(run.folder).status == "PENDING" and not run.done
        with pytest.raises(RuntimeError, match="resume it once it has stopped"):
            run.resume()
        saved = [e["step"] for e in run.events if e["event"] == "checkpoint"]
        assert saved and saved[-1] % EVERY == 0 and saved[-1] <= killed_at
    finally:
        _start_nodes()  # the node comes back (slurmd restarted, the node resumed in SLURM), whatever happened
    # SLURM starts a requeued job again after its BeginTime (about two minutes): not hurried here, because a job
    # allocated within a second of the node's return can find the node IDLE with its CPUs allocated, and its
    # step then waits forever ("Requested nodes are busy"; seen with Debian's SLURM 22.05)
    run.wait(WAIT_S)
    assert run.status == "COMPLETED", (run.status, run.error)
    assert run.job_id == job_id, "the same job, requeued by SLURM"
    assert _ended_attempts(job_id) == ["NODE_FAIL", "COMPLETED"]
    assert _hosts(run) == {0: "moelab-n1", 1: "moelab-n1", 2: "moelab-n2", 3: "moelab-n2"}
    starts = [e["start_step"] for e in run.events if e["event"] == "start"]
    assert starts == [0, saved[-1]]
    assert list(run.metrics["step"]) == list(range(1, STEPS + 1)), "every step exactly once"
    np.testing.assert_allclose(run.metrics["loss"], reference, rtol=1e-5, atol=1e-5)
    print(f"\nRELIABILITY node moelab-n2 killed at step {killed_at}: job {job_id} NODE_FAIL, requeued by SLURM, "
          f"resumed from the step-{saved[-1]} checkpoint on both nodes, losses equal one process's")
