"""Issue 33.7: inline runs in one process. Two runs in threads put sys.stdout/stderr back and keep their logs
apart; Ctrl-C on an inline `moelab run` checkpoints, prints one line and exits 130; `moelab cancel` of an inline
run that another process trains is one line, and changes nothing."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from moelab import Run
from moelab.contract.folder import RunFolder
from moelab.launch.inline import tee_output

from support import SMALL_CLI
from support import moelab_cli as moelab


def test_overlapping_tees_of_two_threads_restore_the_streams_and_keep_logs_apart(tmp_path):
    original = sys.stdout, sys.stderr
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def run_a():
        with tee_output(RunFolder(tmp_path / "a")):
            print("from a")
            a_in.set()
            b_in.wait(10)
        a_out.set()  # a ends first, while b still trains: the old code put back b's view of the streams later

    def run_b():
        a_in.wait(10)
        with tee_output(RunFolder(tmp_path / "b")):
            b_in.set()
            a_out.wait(10)
            print("from b")

    threads = [threading.Thread(target=f) for f in (run_a, run_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert (sys.stdout, sys.stderr) == original  # not a Tee onto a closed log file
    print("still printable")
    assert (tmp_path / "a/logs/rank0.out").read_text() == "from a\n"
    assert (tmp_path / "b/logs/rank0.out").read_text() == "from b\n"


@pytest.mark.slow
def test_two_inline_runs_in_threads_train_and_leave_the_streams_as_they_were(small_session, tmp_path):
    original = sys.stdout, sys.stderr
    runs = {}

    def train(name):
        runs[name] = small_session(train={"steps": 3}).submit("inline", folder=tmp_path / name)

    threads = [threading.Thread(target=train, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert (sys.stdout, sys.stderr) == original
    assert [runs[n].status for n in ("a", "b")] == ["COMPLETED", "COMPLETED"]
    assert list(runs["a"].metrics["loss"]) == list(runs["b"].metrics["loss"])  # the same config, the same losses


@pytest.mark.slow
def test_ctrl_c_on_an_inline_run_checkpoints_and_exits_130_and_cancel_from_elsewhere_is_one_line(tmp_path):
    out = tmp_path / "d"
    p = subprocess.Popen([sys.executable, "-m", "moelab", "run", "tiny", *SMALL_CLI, "--steps", "100000", "--out",
                          str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 240
        while not ((out / "metrics.jsonl").exists() and len(Run.load(out).metrics) > 0):
            assert time.monotonic() < end and p.poll() is None, p.communicate()
            time.sleep(0.3)
        info = (out / "run.json").read_bytes()
        cancel = moelab("cancel", out)
        assert cancel.returncode == 2 and "Traceback" not in cancel.stderr, cancel.stderr
        assert cancel.stderr.startswith(f"moelab: refused: run d runs inline in pid {p.pid}")
        assert len(cancel.stderr.strip().splitlines()) == 1 and (out / "run.json").read_bytes() == info
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    said = [line for line in stderr.splitlines() if line.startswith("moelab:")]
    assert len(said) == 1 and "interrupted at step" in said[0] and "CANCELLED" in said[0], stderr[-3000:]
    run = Run.load(out)
    assert run.status == "CANCELLED"
    last = run.metrics["step"].iloc[-1] if hasattr(run.metrics, "iloc") else list(run.metrics["step"])[-1]
    assert [e["step"] for e in run.events if e["event"] == "checkpoint"][-1] == last  # saved at the interrupt
