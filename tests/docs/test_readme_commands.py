"""README's first commands run as written on CPU, in a fresh folder: the set-up's main job twice (a second run is
not refused), the tour's run with checkpoints, a fork from its step-20 checkpoint with a change that changes
something, and `set` on the finished run, refused with the advice to fork."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from moelab.config import load_config

README = Path(__file__).resolve().parents[2] / "README.md"
MOELAB = [sys.executable, "-m", "moelab"]


def _line(pattern: str) -> list[str]:
    """The README command line (comment dropped) that matches `pattern`, as argv after `moelab`."""
    for line in README.read_text().splitlines():
        m = re.search(pattern, line)
        if m:
            return shlex.split(re.sub(r"\s+#.*$", "", m.group(0)))[1:]
    raise AssertionError(f"README has no line matching {pattern!r}")


def _moelab(argv, cwd):
    return subprocess.run(MOELAB + argv, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_readme_commands_run_as_written(tmp_path):
    main_job = _line(r"moelab run tiny --steps 50$")          # the set-up line's moelab part
    first = _moelab(main_job, tmp_path)
    again = _moelab(main_job, tmp_path)
    assert first.returncode == 0 and again.returncode == 0, first.stderr + again.stderr
    assert len(list((tmp_path / "runs").iterdir())) == 2

    tour = _line(r"moelab run tiny --steps 50 --set train.checkpoint_every\S*( --set \S+)*")
    done = _moelab(tour, tmp_path)
    assert done.returncode == 0, done.stderr
    run = re.search(r"\(run folder: (\S+)\)", done.stdout).group(1)

    change = _line(r"moelab set RUN \S+")
    key, value = change[2].split("=")
    section, field = key.rsplit(".", 1)
    obj = load_config("tiny")
    for part in section.split("."):
        obj = getattr(obj, part)
    assert getattr(obj, field) != float(value), f"README's set example sets {key} to tiny's own value"
    refused = _moelab([a.replace("RUN", run) for a in change], tmp_path)
    assert refused.returncode != 0 and "fork" in refused.stderr

    fork = _line(r"moelab fork RUN --step \d+ --set \S+")
    forked = _moelab([a.replace("RUN", run) for a in fork], tmp_path)
    assert forked.returncode == 0, forked.stderr
    assert "COMPLETED" in forked.stdout
