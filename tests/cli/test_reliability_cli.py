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
from moelab.run.folder import FolderLocked

pytestmark = pytest.mark.slow
SMALL = ["--set", "model.num_layers=2", "--set", "model.hidden_size=32", "--set", "model.moe.num_experts=4",
         "--set", "model.moe.expert_ffn_size=32", "--set", "train.seq_len=16", "--set", "train.global_batch_size=4",
         "--set", "train.micro_batch_size=2", "--set", "train.device=cpu"]


def moelab(*args, timeout=300, **kw):
    return subprocess.run([sys.executable, "-m", "moelab", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, **kw)


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
            moelab_resume(out, steps=3)
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
    resumed = moelab("resume", out, "--steps", "3")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert Run.load(out).status == "COMPLETED"
