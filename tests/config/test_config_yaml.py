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
