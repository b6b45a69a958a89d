"""Issue 33.1-2: one rule for every path that starts training in a folder (moelab.launch.claim): the lock first,
every refusal before the first write, so a refused run or resume leaves the folder byte-identical."""
from __future__ import annotations

from pathlib import Path

import pytest

from moelab import Run
from moelab.contract.folder import FolderLocked
from moelab.launch.resume import resume
from moelab.contract.checkpoints import CheckpointError, list_checkpoints


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.mark.slow
def test_resume_and_rerun_while_a_local_job_starts_up_are_refused_and_the_run_completes(small_session, tmp_path):
    small = small_session
    d = tmp_path / "d"
    run = small(train={"steps": 20}).submit("local", folder=d)  # returns once run.json exists, before rank 0 locks
    info = (d / "run.json").read_bytes()
    try:
        with pytest.raises(FolderLocked, match="cancel"):
            resume(d)  # was accepted: a second job, run.json rewritten, the first run ended FAILED
        with pytest.raises(Exception) as refused:
            small(train={"steps": 20}).submit("local", folder=d)
        assert "moelab resume" not in str(refused.value) and "cancel" in str(refused.value), refused.value
        assert (d / "run.json").read_bytes() == info
    finally:
        assert run.wait(timeout=240).status == "COMPLETED", run.error
    assert Run.load(d).status == "COMPLETED" and list(Run.load(d).metrics["step"])[-1] == 20


def test_a_resume_refused_for_want_of_a_usable_checkpoint_changes_nothing(small_session, tmp_path):
    small = small_session
    d = tmp_path / "d"
    assert small(train={"steps": 3}).submit("inline", folder=d).status == "COMPLETED"
    for ckpt in list_checkpoints(d):  # every checkpoint damaged: nothing to resume from
        for f in ckpt.rglob("*"):
            if f.is_file() and f.name != "metadata.json":
                f.write_bytes(f.read_bytes()[:-8])
    before = snapshot(d)
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        resume(d, steps=5)  # was: config.yaml rewritten to 5 steps, the COMPLETED run turned FAILED
    assert snapshot(d) == before and Run.load(d).status == "COMPLETED"


def test_resume_of_a_folder_without_a_run_creates_nothing(tmp_path):
    from moelab.config import ConfigError

    with pytest.raises(ConfigError, match="not a run folder"):
        resume(tmp_path / "nothing")
    assert not (tmp_path / "nothing").exists()
