"""Every check before submission (issue 21 item 6), for real: the data checks the ranks make run in
Session.submit before any folder is written, a failed sbatch leaves no run folder and one clear line, and a
pending SLURM job's reason is shown by Run (progress, repr), `moelab status` and the dashboard's status line."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from moelab import Run
from moelab.config import ConfigError


def test_a_missing_or_out_of_range_token_file_is_refused_before_anything_is_written(tmp_path, small_session):
    with pytest.raises(ConfigError, match="data.path"):
        small_session(data={"kind": "tokens", "path": str(tmp_path / "missing.bin")}).submit(
            "local", folder=tmp_path / "a")
    assert not (tmp_path / "a").exists()
    tokens = tmp_path / "tokens.bin"
    np.arange(0, 4000, dtype=np.uint16).tofile(tokens)  # ids up to 3999 >= the vocabulary of 128
    with pytest.raises(ConfigError, match="vocab"):
        small_session(data={"kind": "tokens", "path": str(tokens)}).submit("local", folder=tmp_path / "b")
    assert not (tmp_path / "b").exists()


def moelab(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "moelab", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_failed_sbatch_is_one_line_and_leaves_no_folder_and_a_pending_reason_is_shown(slurm_cluster, tmp_path):
    bad = moelab("run", "tiny", "--steps", "2", "--set", "train.device=cpu", "--executor", "slurm",
                 "--cluster", "sbatch={begin: garbage}", "--out", tmp_path / "bad")
    assert bad.returncode == 1 and "job submission failed" in bad.stderr and "Traceback" not in bad.stderr
    assert sum(line.startswith("moelab:") for line in bad.stderr.splitlines()) == 1, bad.stderr  # (+ sbatch's own)
    assert not (tmp_path / "bad").exists()

    from moelab import Session
    from moelab.live.state import DashState

    run = Session("tiny", train={"steps": 2, "device": "cpu"}).submit(
        "slurm", folder=tmp_path / "later", time=5, sbatch={"begin": "now+3600"})
    try:
        assert run.status == "PENDING"
        assert "BeginTime" in (run.progress()["pending_reason"] or "") and "BeginTime" in repr(run)
        status = moelab("status", tmp_path / "later")
        assert "[PENDING]" in status.stdout and "waiting: BeginTime" in status.stdout, status.stdout
        state = DashState(name="later", run_status="PENDING", run_error=run.pending_reason)
        assert "waiting: BeginTime" in state.status_line()
    finally:
        run.cancel()
    assert run.wait(60).status == "CANCELLED"
