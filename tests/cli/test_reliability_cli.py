"""Issue 21 from the command line, with real processes: one writer per run folder, a killed owner noticed at
once (FAILED, "owner process gone"), and such a run resumed and "cancelled" from Python and the CLI."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moelab import Run, Session
from moelab.contract.folder import FolderLocked, pid_alive

from support import SMALL_CLI as SMALL
from support import moelab_cli as moelab

pytestmark = pytest.mark.slow



def start_long_inline(out: Path) -> subprocess.Popen:
    """`moelab run` in the foreground of its own process, training until killed; returns once it has stepped."""
    p = subprocess.Popen([sys.executable, "-m", "moelab", "run", "tiny", *SMALL, "--steps", "100000", "--out",
                          str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 240
    while not ((out / "metrics.jsonl").exists() and len(Run.load(out).metrics) > 0):
        assert time.monotonic() < end and p.poll() is None, p.communicate()
        time.sleep(0.3)
    return p


def test_one_writer_per_folder_and_a_killed_owner_is_noticed_resumed_and_cancellable(tmp_path):
    out = tmp_path / "d"
    first = start_long_inline(out)
    try:
        config_before = (out / "config.yaml").read_text()
        second = moelab("run", "tiny", *SMALL, "--steps", "5", "--set", "train.lr=0.001", "--out", out)
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"pid {first.pid}" in second.stderr and "Traceback" not in second.stderr
        with pytest.raises(FolderLocked, match=f"pid {first.pid}"):
            Session("tiny").submit("local", folder=out)
        with pytest.raises(FolderLocked, match=f"pid {first.pid}"):
            moelab_resume = __import__("moelab.launch.resume", fromlist=["resume"]).resume
            moelab_resume(out, steps=200000)
        assert (out / "config.yaml").read_text() == config_before  # the refusals changed nothing
        assert Run.load(out).status == "RUNNING"
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()

    run = Run.load(out)
    assert run.wait(timeout=30).status == "FAILED"                # at once: the owner pid is gone
    assert "owner process gone" in run.error and str(first.pid) in run.error
    status = moelab("status", out)
    assert "[FAILED]" in status.stdout and "owner process gone" in status.stdout
    assert moelab("cancel", out).stdout.startswith("nothing to cancel")  # not an exception
    run.cancel()                                                  # nor from Python
    resumed = moelab("resume", out, "--steps", int(Run.load(out).metrics["step"].max()) + 2)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert Run.load(out).status == "COMPLETED"


def _children(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if stat[0] != "Z":
                parents.setdefault(int(stat[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _wait_for(cond, timeout=120):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end
        time.sleep(0.3)


def test_sigterm_to_moelab_run_nproc_2_preempts_its_ranks_and_none_is_left(tmp_path):
    out = tmp_path / "p"
    cli = subprocess.Popen([sys.executable, "-m", "moelab", "run", "tiny", *SMALL, "--set", "parallel.ep=2",
                            "--steps", "100000", "--nproc", "2", "--out", str(out)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (out / "metrics.jsonl").exists() and len(Run.load(out).metrics) > 0, 240)
        ranks = _children(cli.pid)
        assert len(ranks) >= 3  # submitit's controller and its two tasks
        cli.send_signal(signal.SIGTERM)
        stdout, stderr = cli.communicate(timeout=180)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode != 0 and "PREEMPTED" in stdout and "SIGTERM" in stderr, stdout + stderr
    run = Run.load(out)
    assert run.status == "PREEMPTED"
    assert any(e["event"] == "checkpoint" for e in run.events)
    _wait_for(lambda: not any(pid_alive(p) for p in ranks), 60)  # no rank outlives its launcher


def test_ranks_of_a_killed_controller_checkpoint_and_end(tmp_path):
    """kill -9 of the local executor's controller: its tasks get SIGTERM from the kernel (PR_SET_PDEATHSIG),
    checkpoint at the step boundary and exit, instead of training on as orphans."""
    run = Session("tiny", model={"num_layers": 2, "hidden_size": 32, "moe": {"num_experts": 4,
                                                                           "expert_ffn_size": 32}},
                  train={"seq_len": 16, "global_batch_size": 4, "micro_batch_size": 2, "device": "cpu",
                         "steps": 100000}).submit("local", folder=tmp_path / "k")
    _wait_for(lambda: len(run.metrics) > 0, 240)
    controller = int(run.job_id)
    tasks = _children(controller)
    assert tasks
    os.kill(controller, signal.SIGKILL)
    _wait_for(lambda: not any(pid_alive(t) for t in tasks), 120)
    ends = [e for e in run.events if e["event"] == "end"]
    assert ends and ends[-1]["status"] == "PREEMPTED"
    assert any(e["event"] == "checkpoint" for e in run.events)


@pytest.mark.parametrize("executor", ["local", "slurm"])
def test_cancel_checkpoints_and_ends_cancelled_on_every_executor(executor, tmp_path, request):
    if executor == "slurm":
        request.getfixturevalue("slurm_cluster")
    run = Session("tiny", model={"num_layers": 2, "hidden_size": 32, "moe": {"num_experts": 4,
                                                                           "expert_ffn_size": 32}},
                  train={"seq_len": 16, "global_batch_size": 4, "micro_batch_size": 2, "device": "cpu",
                         "steps": 100000}).submit(executor, folder=tmp_path / executor, time=10)
    try:
        _wait_for(lambda: run.status == "RUNNING" and len(run.metrics) > 0, 240)
        Run.load(run.folder).cancel()  # from the folder alone, as another kernel would
        assert run.wait(120).status == "CANCELLED"
    finally:
        run.cancel()
    _wait_for(lambda: any(e["event"] == "end" for e in run.events), 60)
    ends = [e for e in run.events if e["event"] == "end"]
    assert ends[-1]["status"] == "CANCELLED"
    assert any(e["event"] == "checkpoint" and e["step"] == ends[-1]["step"] for e in run.events)
    assert not any("continue with `moelab resume" in e.get("message", "") for e in run.events
                   if e["event"] == "warning")
    assert Run.load(run.folder).status == "CANCELLED"


KERNEL = """import sys
from moelab import Session
run = Session("tiny", model={"num_layers": 2, "hidden_size": 32, "moe": {"num_experts": 4, "expert_ffn_size": 32}},
              train={"seq_len": 16, "global_batch_size": 4, "micro_batch_size": 2, "device": "cpu",
                     "steps": int(sys.argv[2])}).submit("local", folder=sys.argv[1])
print(run.job_id, flush=True)
import time; time.sleep(600)
"""


def test_a_local_run_outlives_the_kernel_that_submitted_it_and_is_reattached(tmp_path):
    """Jupyter restarts or shuts a kernel down by killing its process group: the run goes on training, and
    Run.load(folder) from another process follows it to the end."""
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, str(tmp_path / "nb"), "40"], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        controller = int(kernel.stdout.readline())
        run = Run.load(tmp_path / "nb")
        _wait_for(lambda: len(run.metrics) > 0, 240)
    finally:
        os.killpg(kernel.pid, signal.SIGKILL)  # the kernel and everything in its process group
        kernel.wait()
    assert pid_alive(controller)
    assert Run.load(tmp_path / "nb").wait(240).status == "COMPLETED"
    assert list(Run.load(tmp_path / "nb").metrics["step"])[-1] == 40


def test_cli_edges_nproc_refused_inline_sigterm_non_zero_and_one_line_errors(tmp_path):
    for n in ("0", "-2"):
        bad = moelab("run", "tiny", *SMALL, "--nproc", n, "--out", tmp_path / f"n{n}")
        assert bad.returncode == 2 and f"nproc={n}: must be >= 1" in bad.stderr and not (tmp_path / f"n{n}").exists()
    inline = start_long_inline(tmp_path / "t")
    inline.send_signal(signal.SIGTERM)
    _, err = inline.communicate(timeout=120)
    assert inline.returncode != 0 and "stopped by a signal" in err  # PREEMPTED, like the executor path
    assert Run.load(tmp_path / "t").status == "PREEMPTED"
    # known errors are one line; --debug (or MOELAB_DEBUG=1) shows the traceback
    full = moelab("--debug", "run", "tiny", "--nproc", "0", "--out", tmp_path / "dbg")
    assert full.returncode != 0 and "Traceback" in full.stderr and "nproc=0" in full.stderr
