"""moelab.train.signals (issues 33.5, 33.7): Ctrl-C in the step loop is a stop request (CANCELLED); a second
SIGTERM or Ctrl-C while a run is stopping acts at once, even inside a step that would take long to reach its
boundary, and leaves the checkpoints as they were."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from moelab.contract.stream import read_events
from moelab.train.signals import StopSignals

from support import SMALL_CLI

def test_ctrl_c_is_a_stop_request_in_the_loop_and_a_second_one_interrupts_at_once():
    stop = StopSignals().install()
    try:
        with pytest.raises(KeyboardInterrupt):  # before the step loop: as without us
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        stop.deferring = True
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        assert stop.requested and stop.interrupted  # the run ends CANCELLED at the step boundary
        with pytest.raises(KeyboardInterrupt):  # while stopping: at once
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_process_that_ignores_ctrl_c_keeps_ignoring_it():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        stop = StopSignals().install()
        stop.deferring = True
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        assert not stop.requested
        stop.restore()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.slow
def test_a_second_sigterm_while_stopping_ends_the_process_at_once(tmp_path):
    out = tmp_path / "d"
    # 2,048 micro batches a step: about 10 s to the first step boundary on an idle 2-core machine (256 took 1 s
    # there, so the first signal stopped the run before the second came), long after the second signal
    p = subprocess.Popen([sys.executable, "-m", "moelab", "run", "tiny", *SMALL_CLI, "--set",
                          "train.global_batch_size=4096", "--steps", "1000", "--out", str(out)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 240
        while not (out / "metrics.jsonl").exists() or not any(
                e["event"] == "start" for e in read_events(out / "metrics.jsonl", live=True)):
            assert time.monotonic() < end and p.poll() is None, p.communicate()
            time.sleep(0.2)
        time.sleep(1.0)  # into the step loop
        p.send_signal(signal.SIGTERM)  # a stop at the next step boundary
        time.sleep(1.5)
        assert p.poll() is None
        p.send_signal(signal.SIGTERM)  # while it stops: now
        second = time.monotonic()
        p.wait(timeout=60)
        took = time.monotonic() - second
    finally:
        if p.poll() is None:
            p.kill()
    events = read_events(out / "metrics.jsonl", live=True)
    steps = [e for e in events if e["event"] == "step"]
    assert p.returncode == -signal.SIGTERM and took < 5, (p.returncode, took, p.stderr.read()[-2000:])
    assert not steps and not list((out / "checkpoints").glob("step_*"))  # no step finished, nothing saved
    # issue 42.13: the attempt's end is still recorded (resumable from the last checkpoint: none here)
    assert events[-1]["event"] == "end" and events[-1]["status"] == "PREEMPTED", events[-1]
    assert "second SIGTERM" in events[-1]["summary"]["stopped_by"]
    from moelab.run.run import Run
    assert Run.load(out).status == "PREEMPTED"


ABANDONED_THEN_STOPPED = """
import os, signal, sys
from moelab.config import load_config
from moelab.train.trainer import Trainer
small = dict(arg.split("=", 1) for arg in sys.argv[2:] if arg != "--set")
cfg = load_config("tiny", {**small, "train.steps": "4"})
Trainer(cfg, sys.argv[1] + "/only-set-up").setup()  # set up and abandoned, as the bench and tests do


class Stopped(Trainer):
    def after_step(self, step, last):
        super().after_step(step, last)
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)


print("status", Stopped(cfg, sys.argv[1] + "/stopped").run()["status"])
"""


def test_a_trainer_only_set_up_leaves_no_handler_that_kills_a_later_run(tmp_path):
    """The stop handlers live as long as Trainer.run(): a Trainer that was only set up (moelab bench, tests) left
    its handler installed, and a later run's chain() after a SIGTERM reached it and killed the process."""
    r = subprocess.run([sys.executable, "-c", ABANDONED_THEN_STOPPED, str(tmp_path), *SMALL_CLI],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "status PREEMPTED" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])
