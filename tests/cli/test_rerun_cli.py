"""The re-run rule (moelab.launch.rerun) from the command line, for real: refusals are decided before any rank
starts and leave the folder byte for byte as it was; extending a run says from which step to which and what
happens to the learning-rate schedule."""
from __future__ import annotations

from pathlib import Path

import pytest

from moelab import Run, Session
from moelab.config import ConfigError

from support import SMALL_CLI
from support import moelab_cli as moelab

pytestmark = pytest.mark.slow
SMALL = [*SMALL_CLI, "--set", "train.warmup_steps=1"]



def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def test_rerun_rule_refusals_change_nothing_and_extension_is_explained(tmp_path):
    d = tmp_path / "d"
    assert moelab("run", "tiny", *SMALL, "--steps", "4", "--out", d).returncode == 0
    before = snapshot(d)

    again = moelab("run", "tiny", *SMALL, "--steps", "4", "--out", d)
    assert again.returncode == 2 and "COMPLETED at step 4/4: nothing to do" in again.stderr, again.stderr
    other = moelab("run", "tiny", *SMALL, "--steps", "4", "--nproc", "2", "--set", "parallel.ep=2",
                   "--set", "train.lr=0.001", "--out", d)
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr
    assert "train.lr (0.003 -> 0.001)" in other.stderr and "parallel.ep (1 -> 2)" in other.stderr
    longer = moelab("run", "tiny", *SMALL, "--steps", "6", "--executor", "local", "--out", d)
    assert longer.returncode == 2 and f"moelab resume {d} --steps 6" in longer.stderr, longer.stderr
    with pytest.raises(ConfigError, match="COMPLETED at step 4/4"):
        Session(Run.load(d).config).submit("local", folder=d)
    same = moelab("resume", d)
    assert same.returncode == 2 and "already COMPLETED at step 4/4" in same.stderr, same.stderr
    assert snapshot(d) == before and Run.load(d).status == "COMPLETED"  # every refusal left it untouched

    extended = moelab("resume", d, "--steps", "6")
    assert extended.returncode == 0, extended.stderr
    assert "resuming from step 4 to 6" in extended.stderr and "learning-rate schedule" in extended.stderr
    run = Run.load(d)
    assert run.status == "COMPLETED" and list(run.metrics["step"]) == [1, 2, 3, 4, 5, 6]
    shorter = moelab("resume", d, "--steps", "3")
    assert shorter.returncode == 2 and "already reached step 6" in shorter.stderr


def test_rerun_without_checkpoints_keeps_the_first_runs_events(tmp_path):
    e = tmp_path / "e"
    assert moelab("run", "tiny", *SMALL, "--steps", "3", "--set", "train.save_checkpoints=false",
                  "--out", e).returncode == 0
    events = (e / "metrics.jsonl").read_text()
    out = moelab("run", "tiny", *SMALL, "--steps", "3", "--set", "train.save_checkpoints=false",
                 "--set", "train.lr=0.001", "--out", e)
    assert out.returncode == 2 and "train.lr" in out.stderr
    assert (e / "metrics.jsonl").read_text() == events
