"""moelab's own training with model.tie_embeddings=true (the head IS the embedding, after materialisation, after
optimizer steps and after a resume) and with model.pad_token_id (padding counts in neither the loss nor the
routing statistics)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moelab.layout.dims import ParallelDims
import torch

from moelab.config import ConfigError, load_config
from moelab.layout.dims import ParallelDims
from moelab.data.batches import make_dataset, micro_batch
from moelab.contract.stream import read_events
from moelab.train.trainer import Trainer

OVERRIDES = {"train.steps": 4, "model.num_layers": 2, "train.seq_len": 16, "train.global_batch_size": 4,
             "train.micro_batch_size": 2, "train.device": "cpu", "train.warmup_steps": 1,
             "train.checkpoint_every": 2, "train.keep_checkpoints": 3, "model.tie_embeddings": True}


def _steps(run_dir):
    return [e for e in read_events(Path(run_dir) / "metrics.jsonl") if e["event"] == "step"]


def test_tied_embeddings_stay_one_parameter_through_training_and_resume(tmp_path):
    cfg = load_config("tiny", OVERRIDES)
    trainer = Trainer(cfg, tmp_path / "a")
    trainer.run()
    model = trainer.model
    assert model.output.weight is model.tok_embeddings.weight  # materialize re-ties after to_empty
    assert sum(p is model.tok_embeddings.weight for p in model.parameters()) == 1
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(list(model.parameters()))
    # resume from step 2: steps 3 and 4 and the final weights are the uninterrupted run's, tie included
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_000004")
    resumed = Trainer(cfg, tmp_path / "b")
    resumed.run()
    assert resumed.start_step == 2
    assert [e["loss"] for e in _steps(tmp_path / "b")] == [e["loss"] for e in _steps(tmp_path / "a")]
    assert resumed.model.output.weight is resumed.model.tok_embeddings.weight
    torch.testing.assert_close(resumed.model.tok_embeddings.weight, model.tok_embeddings.weight, rtol=0, atol=0)


def test_padding_is_left_out_of_loss_and_routing_counts(tmp_path):
    """With pad_token_id=p (a token id the synthetic data holds) the targets equal to p count nowhere: the routed
    assignments per step are K x the tokens whose target is not p, and the pad row of the embedding never moves."""
    plain = {**OVERRIDES, "model.tie_embeddings": False, "train.steps": 2, "train.checkpoint_every": 0}
    pad = int(micro_batch(make_dataset(load_config("tiny", plain)), 1, 0, 1)[0, 1])  # a target of step 1
    cfg = load_config("tiny", {**plain, "model.pad_token_id": pad})
    trainer = Trainer(cfg, tmp_path)
    trainer.run()
    data, t = make_dataset(cfg), cfg.train
    padded = 0
    for e in _steps(tmp_path):
        targets = micro_batch(data, e["step"], 0, t.global_batch_size)[:, 1:]
        counted = int((targets != pad).sum())
        padded += targets.numel() - counted
        for layer in e["routing"]["routed_per_expert"]:
            assert sum(layer) == counted * cfg.model.moe.top_k
    assert padded > 0  # the data did hold padding targets
    assert not trainer.model.tok_embeddings.weight[pad].any()  # zero at init, and no gradient since


def test_padding_with_pipeline_stages_is_refused():
    with pytest.raises(ConfigError, match="model.pad_token_id"):
        cfg = load_config("tiny", {"model.pad_token_id": 0, "parallel.pp": 2, "model.num_layers": 4})
        ParallelDims.build(cfg, 2).layout
