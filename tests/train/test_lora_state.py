"""A LoRA checkpoint (adapters only) becomes the whole model again: the base its metadata points to plus the
saved adapters, equal to the trained model (an HF base: tests/hf/test_peft.py)."""
import pytest
import torch

from moelab.config import ConfigError, load_config
from moelab.model.lora import is_adapter, merge_lora_state
from moelab.parallel.env import DistEnv
from moelab.train.lora_state import lora_model_state
from moelab.train.trainer import Trainer

SHORT = {"train.steps": 2, "train.seq_len": 16, "train.global_batch_size": 4, "train.micro_batch_size": 2,
         "train.warmup_steps": 0, "train.lr": 1e-2}


def test_lora_checkpoint_gives_the_trained_model_state(tmp_path):
    cfg = load_config("tiny", {"train.lora.rank": 4, "train.lora.targets": "attention,experts", **SHORT})
    trainer = Trainer(cfg, tmp_path, env=DistEnv())
    trainer.run()
    state = lora_model_state(tmp_path / "checkpoints/step_000002", cfg)
    trained = trainer.model.state_dict()
    assert state.keys() == trained.keys()
    for key, value in trained.items():
        assert torch.equal(state[key], value), key
    assert any(state[k].abs().sum() > 0 for k in state if k.endswith("lora_B"))  # trained adapters, not fresh
    merged = merge_lora_state(state, cfg)
    assert not any(is_adapter(k) for k in merged)
    with pytest.raises(ConfigError, match="not a LoRA checkpoint"):
        lora_model_state(tmp_path / "checkpoints/step_000002", cfg.replace(**{"train.lora.rank": 0}))

