"""Config YAML edges: a key given twice is refused (naming the key and its lines), never silently last-wins;
train.steps follows one rule (>= 1) whatever the bad value."""
from __future__ import annotations

import pytest

from moelab.config import ConfigError, load_config, parse_override


@pytest.mark.parametrize("text, key, line, first", [
    ("base: tiny\ntrain:\n  steps: 5\n  lr: 0.001\n  steps: 50\n", "steps", 5, 3),
    ("base: tiny\nname: a\ntrain: {steps: 5}\nname: b\n", "name", 4, 2),
    ("base: tiny\nmodel:\n  moe: {top_k: 1, top_k: 2}\n", "top_k", 3, 3),
    ("base: tiny\ntrain:\n  steps: 5\ntrain:\n  lr: 0.1\n", "train", 4, 2),
])
def test_a_key_given_twice_is_refused_naming_the_key_and_the_lines(tmp_path, text, key, line, first):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).startswith(f"{path}:{line}: key {key!r} is given twice (first on line {first}); keep one")


def test_a_key_given_twice_in_a_set_value_is_refused():
    with pytest.raises(ConfigError, match=r"--set model.moe: key 'top_k' is given twice; keep one"):
        parse_override("model.moe={top_k: 1, top_k: 2}")


def test_a_merge_then_an_overriding_key_is_not_a_duplicate(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("base: tiny\ntrain:\n  <<: {steps: 5, lr: 0.01}\n  steps: 7\n")
    cfg = load_config(path)
    assert (cfg.train.steps, cfg.train.lr) == (7, 0.01)


def test_python_tags_stay_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("base: tiny\nname: !!python/object/apply:os.getcwd []\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


@pytest.mark.parametrize("steps", [-5, -1, 0])
def test_train_steps_below_one_gets_one_message(steps):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", {"train.steps": steps})
    assert str(e.value) == f"train.steps={steps}: must be >= 1"


def test_base_hf_reads_the_checkpoint_config_and_records_the_folder(tmp_path, monkeypatch):
    """`base: hf:PATH` builds the model from the checkpoint's config.json (moelab.hf's mapping) and sets
    train.init_from to the folder's absolute path; the YAML's own keys still win. The config layer alone has
    no reader for hf: (moelab.run.session.SOURCE_READERS is the one Session and the CLI pass)."""
    import json

    import torch
    from safetensors.torch import save_file

    from moelab.hf import config_to_hf
    from moelab.run.session import SOURCE_READERS

    ck = tmp_path / "ck"
    ck.mkdir()
    model = load_config("tiny", ["model.hidden_size=48", "model.moe.num_experts=6", "model.qk_norm=true"]).model
    (ck / "config.json").write_text(json.dumps(config_to_hf(model, "qwen3_moe")))
    save_file({"model.norm.weight": torch.ones(48)}, str(ck / "model.safetensors"))
    y = tmp_path / "ft.yaml"
    y.write_text("base: hf:ck\ntrain:\n  steps: 3\nmodel:\n  moe:\n    capacity_factor: 1.5\n")
    monkeypatch.chdir(tmp_path)  # a relative base is read from the working directory, as YAML bases are
    cfg = load_config(y, ["train.seq_len=32"], readers=SOURCE_READERS)
    assert cfg.train.init_from == f"hf:{ck.resolve()}"
    assert (cfg.model.hidden_size, cfg.model.moe.num_experts, cfg.model.qk_norm) == (48, 6, True)
    assert (cfg.train.steps, cfg.train.seq_len, cfg.model.moe.capacity_factor) == (3, 32, 1.5)
    with pytest.raises(ConfigError, match="hf: checkpoints are read by moelab.Session"):
        load_config(y)
    (ck / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="has no weights"):
        load_config(y, readers=SOURCE_READERS)
