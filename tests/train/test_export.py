"""TensorBoard and W&B mirror the metrics stream: live from the trainer (train.tensorboard, train.wandb) and
after the fact (`moelab export RUN --to tensorboard`); the event files hold the stream's numbers."""
from pathlib import Path

import pytest

from moelab.cli import main
from moelab.config import ConfigError, load_config
from moelab.loggers.mirror import check_export, scalars
from moelab.contract.stream import read_events
from moelab.train.trainer import Trainer

FAST = ["train.steps=4", "train.seq_len=16", "train.warmup_steps=1", "train.eval_every=2", "train.eval_batches=1"]


def _tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _stream(run):
    return read_events(Path(run) / "metrics.jsonl", typed=True)


def test_live_tensorboard_files_hold_the_streams_losses(tmp_path):
    pytest.importorskip("tensorboard")
    Trainer(load_config("tiny", FAST + ["train.tensorboard=true"]), tmp_path / "run").run()
    got = _tensorboard_scalars(tmp_path / "run" / "tensorboard")
    events = _stream(tmp_path / "run")
    steps = [(e.step, e.loss) for e in events if e.EVENT == "step"]
    evals = [(e.step, e.loss) for e in events if e.EVENT == "eval"]
    assert [s for s, _ in got["train/loss"]] == [s for s, _ in steps]
    assert [v for _, v in got["train/loss"]] == pytest.approx([v for _, v in steps], rel=1e-6)
    assert [v for _, v in got["eval/loss"]] == pytest.approx([v for _, v in evals], rel=1e-6)
    assert {"train/lr", "perf/tokens_per_s", "routing/max_over_mean/layer_0"} <= set(got)


def test_moelab_export_writes_the_same_scalars_after_the_fact(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    Trainer(load_config("tiny", FAST), tmp_path / "run").run()
    assert not (tmp_path / "run" / "tensorboard").exists()  # not asked for: nothing written
    assert main(["export", str(tmp_path / "run"), "--to", "tensorboard", "--out", str(tmp_path / "tb")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "tb")
    got = _tensorboard_scalars(tmp_path / "tb")
    want = {}
    for e in _stream(tmp_path / "run"):
        for tag, v in scalars(e).items():
            want.setdefault(tag, []).append((e.step, v))
    assert got.keys() == want.keys()
    for tag in want:
        assert [s for s, _ in got[tag]] == [s for s, _ in want[tag]], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in want[tag]], rel=1e-6), tag


def test_wandb_offline_needs_no_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    Trainer(load_config("tiny", FAST + ["train.wandb=offline"]), tmp_path / "run").run()
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_a_missing_export_package_is_a_config_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match="train.tensorboard=True: needs the tensorboard package"):
        check_export(load_config("tiny", ["train.tensorboard=true"]))
