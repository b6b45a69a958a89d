"""compare() shows the held-out loss: an eval_loss column (the last eval event) and dashed eval curves."""
import pytest

from moelab.live.compare import compare
from moelab.config import load_config
from moelab.contract.stream import read_events
from moelab.train.trainer import Trainer


def test_compare_has_the_eval_loss_of_each_run(tmp_path):
    base = ["train.steps=4", "train.seq_len=16", "train.warmup_steps=1"]
    Trainer(load_config("tiny", base + ["train.eval_every=2", "train.eval_batches=1"]), tmp_path / "a").run()
    Trainer(load_config("tiny", base), tmp_path / "b").run()
    cmp = compare([tmp_path / "a", tmp_path / "b"], labels=["with eval", "without"])
    rows = cmp.rows
    last = [e for e in read_events(tmp_path / "a" / "metrics.jsonl") if e["event"] == "eval"][-1]
    assert rows[0]["eval_loss"] == pytest.approx(last["loss"]) and rows[1]["eval_loss"] is None
    labels = [line.get_label() for line in cmp.plot_losses().axes[0].lines]
    assert labels == ["with eval", "with eval (eval)", "without"]
