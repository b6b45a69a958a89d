"""The local executor's warm rank process (moelab.launch.warm): a rank forked from a process that already
imported torch and moelab trains exactly as a cold one, and without a server the task starts cold."""
import time
import uuid

import pytest

from moelab import Session
from moelab.launch import warm

SMALL = {"model": {"num_layers": 2, "hidden_size": 32, "moe": {"num_experts": 4, "expert_ffn_size": 32}},
         "train": {"seq_len": 16, "global_batch_size": 4, "micro_batch_size": 2, "device": "cpu", "steps": 3}}
FORKED = "moelab.launch.warm: this rank was forked from the warm process"


@pytest.fixture
def own_server(monkeypatch):
    """A server of this test's own (a TORCH_ variable is part of a server's key), stopped afterwards."""
    monkeypatch.setenv("TORCH_MOELAB_WARM_TEST", uuid.uuid4().hex)
    monkeypatch.setenv("MOELAB_WARM", "1")
    yield warm.key()
    warm.stop()


def losses(run):
    return [e["loss"] for e in run.events if e["event"] == "step"]


def test_a_warm_rank_trains_as_a_cold_one(own_server, tmp_path, monkeypatch):
    assert warm.start()
    sock = warm.home() / f"{own_server}.sock"
    deadline = time.time() + 300
    while not sock.exists():  # the server imports before it listens
        assert time.time() < deadline, (warm.home() / f"{own_server}.log").read_text()
        time.sleep(0.2)
    hot = Session("tiny", **SMALL).set("parallel.ep", 2).submit("local", nproc=2, folder=tmp_path / "warm")
    assert hot.wait(300).status == "COMPLETED", hot.error
    assert FORKED in hot.logs(rank=0) and FORKED in hot.logs(rank=1)
    for rank in (0, 1):  # issue 42.16: a clean run prints no warning (runpy's "found in sys.modules", submitit's)
        assert "Warning" not in hot.logs(rank=rank) and "WARNING" not in hot.logs(rank=rank), hot.logs(rank=rank)
    monkeypatch.setenv("MOELAB_WARM", "0")
    cold = Session("tiny", **SMALL).set("parallel.ep", 2).submit("local", nproc=2, folder=tmp_path / "cold")
    assert cold.wait(300).status == "COMPLETED", cold.error
    assert FORKED not in cold.logs(rank=0)
    assert "Warning" not in cold.logs(rank=0) and "WARNING" not in cold.logs(rank=0), cold.logs(rank=0)
    assert losses(hot) == losses(cold) and len(losses(hot)) == 3


def test_the_client_recognises_only_module_commands():
    assert warm._module_command(["python", "-u", "-m", "submitit.core._submit", "/x"]) == (
        "submitit.core._submit", ["/x"])
    assert warm._module_command(["python", "script.py"]) is None
    assert warm.key({"OMP_NUM_THREADS": "1"}) == warm.key({"OMP_NUM_THREADS": "7"})  # set per rank instead
    assert warm.key({}) != warm.key({"ATEN_CPU_CAPABILITY": "default"})


def test_a_pid_file_being_written_counts_as_a_server_starting(own_server):
    """Two starters at once: the second sees the first's empty pid file and starts no second server."""
    pid_file = warm.home() / f"{own_server}.pid"
    pid_file.write_text("")
    try:
        assert warm.start() and pid_file.read_text() == ""  # no second server: the file is left to its writer
    finally:
        pid_file.unlink(missing_ok=True)
