"""Held-out evaluation and expert-token records in the trainer: eval events at every train.eval_every steps and
the last, a falling eval loss on real text, no effect on training, exactly once per step after a resume; the eval
loss is the training loss (padding left out, the model's fused loss path)."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from moelab.backends.full_loss import cross_entropy
from moelab.config import load_config
from moelab.data.batches import eval_batch, make_eval_dataset
from moelab.run import Run
from moelab.contract.checkpoints import latest_checkpoint
from moelab.contract.expert_tokens import read_expert_tokens
from moelab.live.expert_tokens import expert_token_table, plot_expert_tokens
from moelab.contract.stream import read_events
from moelab.train.evaluate import rank_micro_batches
from moelab.train.trainer import Trainer

SMALL = {"model.num_layers": 2, "train.seq_len": 32, "train.global_batch_size": 4, "train.micro_batch_size": 2,
         "train.device": "cpu", "train.warmup_steps": 2, "model.moe.bias_update_rate": 0.01}


def _events(run, kind):
    return [e for e in read_events(Path(run) / "metrics.jsonl") if e["event"] == kind]


def _text_cfg(tmp_path, **extra):
    return load_config("tiny", {**SMALL, "data.kind": "text", "data.path": "stdlib", "data.val_fraction": 0.05,
                                "data.cache_dir": str(tmp_path / "cache"), **extra})


def test_text_run_has_falling_train_and_eval_loss_and_expert_tokens(tmp_path):
    cfg = _text_cfg(tmp_path, **{"train.steps": 20, "train.eval_every": 5, "train.eval_batches": 2,
                                 "train.expert_tokens_every": 10})
    summary = Trainer(cfg, tmp_path / "run").run()
    evals = _events(tmp_path / "run", "eval")
    assert [e["step"] for e in evals] == [5, 10, 15, 20]
    assert evals[-1]["loss"] < evals[0]["loss"] < 5.55  # ln(256): below uniform, and falling
    assert summary["eval_loss"] == evals[-1]["loss"] and summary["first_eval_loss"] == evals[0]["loss"]
    assert summary["eval_perplexity"] == pytest.approx(2.718281828 ** evals[-1]["loss"])
    assert summary["final_loss"] < summary["first_loss"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["eval_loss"] == summary["eval_loss"]
    records = read_expert_tokens(tmp_path / "run")
    assert [r["step"] for r in records] == [10, 20]
    E, K = cfg.model.moe.num_experts, cfg.model.moe.top_k
    for layer in records[-1]["layers"]:
        assert len(layer) == E
        assert sum(e["tokens"] for e in layer) == 4 * 32 * K  # no dropping: every assignment counted once
        for e in layer:
            assert all(a[1] >= b[1] for a, b in zip(e["top"], e["top"][1:]))  # most frequent first
    table = expert_token_table(tmp_path / "run", layer=0, top=3)
    assert set(table["rank"]) == {1, 2, 3} and table["token"].str.startswith(("'", '"', "0x")).all()
    assert plot_expert_tokens(tmp_path / "run", layer=0).axes
    run = Run.load(tmp_path / "run")
    assert run.expert_tokens(0, top=3).equals(table) and list(run.evals["loss"]) == [e["loss"] for e in evals]
    assert list(run.expert_tokens(0, step=10, top=1)["step"]) == [10] * sum(
        1 for e in records[0]["layers"][0] if e["top"])
    with pytest.raises(ValueError, match="layer 3 out of range; the run has 1 MoE layers"):
        run.expert_tokens(3)


@pytest.mark.parametrize("hook", ["train.eval_every", "train.expert_tokens_every"])
def test_evaluation_and_expert_tokens_do_not_change_training(tmp_path, hook):
    base = {**SMALL, "train.steps": 4}
    Trainer(load_config("tiny", base), tmp_path / "plain").run()
    Trainer(load_config("tiny", {**base, hook: 1}), tmp_path / "hooked").run()
    plain, hooked = _events(tmp_path / "plain", "step"), _events(tmp_path / "hooked", "step")
    assert [e["loss"] for e in plain] == [e["loss"] for e in hooked]
    assert [e["routing"] for e in plain] == [e["routing"] for e in hooked]  # their forwards left no routing trace
    written = len(_events(tmp_path / "hooked", "eval")) + len(read_expert_tokens(tmp_path / "hooked"))
    assert written == 4


def test_eval_events_appear_once_per_step_after_a_resume(tmp_path):
    cfg = _text_cfg(tmp_path, **{"train.steps": 8, "train.eval_every": 2, "train.checkpoint_every": 4,
                                 "train.keep_checkpoints": 3})
    Trainer(cfg, tmp_path / "full").run()
    shutil.copytree(tmp_path / "full", tmp_path / "cut")
    shutil.rmtree(latest_checkpoint(tmp_path / "cut"))  # the step-8 checkpoint: resume from step 4
    summary = Trainer(cfg, tmp_path / "cut").run()
    full, cut = _events(tmp_path / "full", "eval"), _events(tmp_path / "cut", "eval")
    assert [e["step"] for e in cut] == [2, 4, 6, 8]
    assert [e["loss"] for e in cut] == pytest.approx([e["loss"] for e in full], abs=1e-6)
    assert summary["first_eval_loss"] == cut[0]["loss"]


def test_eval_loss_is_the_training_loss_with_padding_left_out(tmp_path):
    base = load_config("tiny", {**SMALL, "train.steps": 1, "train.eval_every": 1, "train.eval_batches": 2})
    # the pad id: the commonest target of the held-out batches, so that padding weighs in the loss
    targets = torch.cat([eval_batch(make_eval_dataset(base), base, b, 0, 4)[:, 1:] for b in range(2)])
    pad = int(targets.flatten().mode().values)
    cfg = base.replace(**{"model.pad_token_id": pad})
    tr = Trainer(cfg, tmp_path / "run")
    tr.setup()
    got = tr.evaluator.run(step=0)["loss"]
    masked, unmasked = [], []  # the training loss function on the full logits, and the loss with pads counted
    tr.model.eval()
    with torch.no_grad():
        for b in range(2):
            for first in rank_micro_batches(tr):
                batch = eval_batch(tr.evaluator.dataset, cfg, b, first, 2)
                logits = tr.model(batch[:, :-1])
                masked.append(float(cross_entropy(logits, batch[:, 1:], pad_token_id=pad)))
                unmasked.append(float(cross_entropy(logits, batch[:, 1:])))
    assert got == pytest.approx(sum(masked) / len(masked), rel=1e-5)
    assert abs(got - sum(unmasked) / len(unmasked)) > 1e-4 * got  # the pads would weigh: 10x the tolerance


def test_evaluation_never_holds_the_logits_with_the_fused_loss(tmp_path, monkeypatch):
    tr = Trainer(load_config("tiny", {**SMALL, "train.steps": 1, "train.eval_every": 1}), tmp_path / "run")
    tr.setup()
    assert tr.model.loss_kind == "chunked"
    shapes = []
    monkeypatch.setattr(tr.model.output, "forward", lambda h: shapes.append(h.shape) or h)
    tr.evaluator.run(step=0)
    assert shapes == []  # the head ran inside the chunked loss, never over the whole hidden states
