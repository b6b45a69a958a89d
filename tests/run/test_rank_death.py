"""Issue 42.12: after a rank of a local run is SIGKILLed, Run.error and `moelab status` say which rank died and by
which signal, not a line of some rank log nor a survivor's connection-reset traceback. Real processes: a run on
the local executor, its rank 1 killed with SIGKILL mid-run, warm (forked by moelab.launch.warm) and cold."""
from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from moelab import Session
from moelab.contract.stream import read_events
from moelab.launch import warm
from support import moelab_cli

SMALL = {"model": {"num_layers": 2, "hidden_size": 32, "moe": {"num_experts": 4, "expert_ffn_size": 32}},
         "train": {"seq_len": 16, "global_batch_size": 4, "micro_batch_size": 2, "device": "cpu", "steps": 100000,
                   "save_checkpoints": False}}


def _rank_pid(job_id: str, rank: int) -> int | None:
    """The training process of `rank`, not its stand-in (warm.py run): the process writing submitit's stdout file
    of the task (a warm rank's /proc environ is its server's, so the file tells it)."""
    for entry in Path("/proc").iterdir():
        try:
            out = os.readlink(entry / "fd" / "1")
            cmd = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if out.endswith(f"/{job_id}_{rank}_log.out") and b"warm.py" not in cmd:
            return int(entry.name)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("path", ["warm", "cold"])
def test_a_sigkilled_rank_is_named_with_its_signal(tmp_path, monkeypatch, path):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    if path == "warm":
        monkeypatch.setenv("TORCH_MOELAB_DEATH_TEST", uuid.uuid4().hex)  # a server of this test's own
        assert warm.start()
        sock = warm.home() / f"{warm.key()}.sock"
        deadline = time.time() + 300
        while not sock.exists():
            assert time.time() < deadline
            time.sleep(0.2)
    else:
        monkeypatch.setenv("MOELAB_WARM", "0")
    try:
        run = Session("tiny", **SMALL).set("parallel.ep", 2).submit("local", nproc=2, folder=tmp_path / "run")
        deadline = time.time() + 240
        while not any(e["event"] == "step" for e in read_events(run.folder / "metrics.jsonl", live=True)):
            assert time.time() < deadline and run.status == "RUNNING", run.error
            time.sleep(0.2)
        pid = _rank_pid(run.job_id, 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert run.wait(120).status == "FAILED"
        assert run.error.startswith(f"rank 1 was killed by signal 9 (SIGKILL), pid {pid}"), run.error
        assert "Warning" not in run.error and "Traceback" not in run.error
        cli = moelab_cli("status", run.folder)
        assert cli.returncode == 0 and "rank 1 was killed by signal 9 (SIGKILL)" in cli.stdout, cli.stdout
        assert len(cli.stdout.splitlines()) == 2, cli.stdout
    finally:
        if path == "warm":
            warm.stop()
