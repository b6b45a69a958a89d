"""A rank that dies or hangs mid-run ends the run with an error within a bounded time, never a hang: the
survivors' collectives fail (closed connection, or train.collective_timeout_s on gloo) and the launcher raises
RankFailed carrying the failing rank's traceback."""
import time

import pytest

from moelab.launch.local import RankFailed
from moelab.contract.stream import read_events

pytestmark = pytest.mark.slow


def _errors(run_dir):
    return [e for e in read_events(run_dir / "metrics.jsonl", live=True) if e["event"] == "error"]


def _seconds_to_error(run_dir):
    """From the last completed step to rank 0's error event: how long the survivor took to notice."""
    steps = [e for e in read_events(run_dir / "metrics.jsonl", live=True) if e["event"] == "step"]
    return _errors(run_dir)[0]["time"] - steps[-1]["time"]


def test_a_dead_rank_makes_the_others_fail_on_their_own(helpers, tmp_path):
    cfg = helpers.small_config("train.steps=6", "parallel.ep=2", "train.collective_timeout_s=120")
    with pytest.raises(RankFailed) as info:
        helpers.run_multi(cfg, tmp_path, 2, env={"TEST_FAULT": "1:3:exit"}, grace_s=120)
    assert info.value.rank == 1 and info.value.returncode == 13
    # rank 0 noticed by itself (a closed connection, long before the 120 s collective timeout), recorded the
    # error at step 3 and exited with an error code, not a signal from the launcher
    assert "rank 0: exit code 1" in str(info.value)
    assert [(e["rank"], e["step"]) for e in _errors(tmp_path)] == [(0, 3)]
    assert [e["step"] for e in helpers.step_events(tmp_path)] == [1, 2]
    assert _seconds_to_error(tmp_path) < 30


def test_a_hung_rank_is_detected_by_the_collective_timeout(helpers, tmp_path):
    cfg = helpers.small_config("train.steps=6", "train.collective_timeout_s=4")
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        helpers.run_multi(cfg, tmp_path, 2, env={"TEST_FAULT": "1:3:hang"}, grace_s=2)
    # rank 0 timed out in a collective of step 3 and failed with its traceback; the launcher then stopped rank 1
    assert info.value.rank == 0
    assert "Traceback" in str(info.value) and "rank 1: killed by signal" in str(info.value)
    assert [(e["rank"], e["step"]) for e in _errors(tmp_path)] == [(0, 3)]
    assert 4 <= _seconds_to_error(tmp_path) < 30
    assert time.monotonic() - t0 < 300  # never a hang (rank 1 sleeps for an hour)
