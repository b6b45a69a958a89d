"""Where a resume starts (moelab.launch.rerun, moelab.launch.resume): from the newest intact checkpoint, not from
the last step of the metrics stream. A run killed after step N with its last checkpoint at C < N continues from
C and says so, and the re-run rule's messages give both numbers."""
from __future__ import annotations

import shutil

import pytest

from moelab import Run
from moelab.config import ConfigError, load_config
from moelab.launch.rerun import checkpoint_step, reached_step, rerun_refusal
from moelab.launch.resume import resume
from moelab.contract.folder import RunFolder


@pytest.fixture(scope="module")
def killed(tmp_path_factory, small_session):
    """A run of 6 steps with checkpoints at 4 and 6, turned into what kill -9 after step 6 leaves when the
    checkpoint of step 6 had not been written: the stream at step 6 (no end event), the newest checkpoint at 4."""
    d = tmp_path_factory.mktemp("killed") / "run"
    run = small_session(train={"steps": 6, "checkpoint_every": 4}).submit("inline", folder=d)
    assert run.status == "COMPLETED"
    shutil.rmtree(d / "checkpoints/step_000006")
    lines = (d / "metrics.jsonl").read_text().splitlines(keepends=True)
    (d / "metrics.jsonl").write_text("".join(x for x in lines if '"event": "end"' not in x
                                             and not ('"event": "checkpoint"' in x and '"step": 6' in x)))
    (d / "summary.json").unlink()
    RunFolder(d).update_info(status="FAILED", error="owner process gone")
    return d


def _copy(src, tmp_path):
    return shutil.copytree(src, tmp_path / "run")


def test_the_rerun_rule_names_the_step_reached_and_the_checkpoint_a_resume_starts_from(killed):
    folder = RunFolder(killed)
    assert (reached_step(folder), checkpoint_step(folder)) == (6, 4)
    cfg = load_config(folder.config)
    same = rerun_refusal(folder, cfg)
    assert "FAILED at step 6/6" in same and "a resume continues from its checkpoint at step 4" in same, same
    longer = rerun_refusal(folder, load_config(folder.config, {"train.steps": 9}))
    assert "its checkpoint at step 4" in longer and "--steps 9" in longer, longer


def test_resume_continues_from_the_last_intact_checkpoint_and_says_so(killed, tmp_path, capsys):
    d = _copy(killed, tmp_path)
    resume(d)
    err = capsys.readouterr().err
    assert "the stream reached step 6; a resume continues from its checkpoint at step 4" in err, err
    run = Run.load(d)
    assert run.status == "COMPLETED" and list(run.metrics["step"]) == [1, 2, 3, 4, 5, 6]


def test_resume_to_fewer_steps_than_the_stream_reached_counts_from_the_checkpoint(killed, tmp_path, capsys):
    """Steps 5..6 of the stream are trained again anyway: a total of 5 is above the checkpoint's step 4."""
    d = _copy(killed, tmp_path)
    resume(d, steps=5)
    assert "resuming from step 4 to 5 (was 6)" in capsys.readouterr().err
    assert list(Run.load(d).metrics["step"]) == [1, 2, 3, 4, 5] and Run.load(d).status == "COMPLETED"
    with pytest.raises(ConfigError, match=r"already reached step 5 \(its newest checkpoint\)"):
        resume(d, steps=3)
