"""Config errors name the field, the value and the fix; YAML round trips; dotted overrides."""
import pytest

from moelab.config import ConfigError, load_config, save_config
from moelab.layout.dims import check_layout


def test_yaml_round_trip_is_equal(tmp_path):
    cfg = load_config("tiny", ["model.moe.num_experts=8", "train.lr=0.01"])
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


def test_overrides_from_cli_strings_and_dicts():
    cfg = load_config("tiny", ["model.moe.num_experts=32", "backend.fake_balanced_gate=true"])
    assert cfg.model.moe.num_experts == 32 and cfg.backend.fake_balanced_gate is True
    assert load_config("tiny", {"train.steps": 7}).train.steps == 7
    assert cfg.replace(**{"train.seed": 3}).train.seed == 3


@pytest.mark.parametrize("overrides, field, words", [
    (["model.moe.top_k=32"], "model.moe.top_k=32", "num_experts"),
    (["model.num_kv_heads=3"], "model.num_kv_heads=3", "num_heads"),
    (["model.moe.num_experst=4"], "model.moe.num_experst", "did you mean 'model.moe.num_experts'"),
    (["modle.hidden_size=4"], "modle.hidden_size", "did you mean 'model'"),
    (["train.lr=fast"], "train.lr='fast'", "expected a number"),
    (["model.moe.score_func=softmx"], "model.moe.score_func='softmx'", "did you mean 'softmax'"),
    (["parallel.ep=3"], "parallel.ep=3", "must divide model.moe.num_experts=16"),
    (["train.global_batch_size=7"], "train.global_batch_size=7", "multiple of train.micro_batch_size"),
    (["parallel.tp=2", "backend.loss=liger"], "backend.loss='liger'", "does not run with parallel.tp=2 yet"),
    (["model.num_layers=0"], "model.num_layers=0", ">= 1"),
    (["parallel.tp_shared_experts=column_row", "model.moe.num_shared_experts=1"],
     "parallel.tp_shared_experts='column_row'", "needs parallel.tp > 1 (tp=1)"),
    (["parallel.tp=2", "parallel.tp_shared_experts=column_row"], "parallel.tp_shared_experts='column_row'",
     "model.moe.num_shared_experts > 0 (here 0)"),
    (["parallel.ep_overlap=true"], "parallel.ep_overlap=True", "needs parallel.ep > 1"),
    (["parallel.ep=2", "parallel.ep_overlap=true", "backend.dispatcher=deepep",
      "train.dtype=bfloat16"], "parallel.ep_overlap=True",
     "set backend.dispatcher=all_to_all"),
])
def test_invalid_values_name_field_value_and_fix(overrides, field, words):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides)
    assert field in str(e.value) and words in str(e.value)


def test_wrong_types_from_yaml_are_rejected(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  moe:\n    num_experts: [1, 2]\n")
    with pytest.raises(ConfigError, match=r"model.moe.num_experts=\[1, 2\]: expected an integer"):
        load_config(p)
    p.write_text("model: 3\n")
    with pytest.raises(ConfigError, match="model=3: expected a mapping"):
        load_config(p)


def test_yaml_may_start_from_a_preset(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("base: tiny\nmodel:\n  moe:\n    top_k: 4\n")
    cfg = load_config(p)
    assert cfg.model.moe.top_k == 4 and cfg.model.moe.num_experts == 16 and cfg.name == "mine"


def test_missing_file_and_unknown_preset_messages():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("nope/missing.yaml")
    with pytest.raises(ConfigError, match="Did you mean 'tiny'.*Presets:"):
        load_config("tinny")


def test_layout_must_multiply_to_the_world_size():
    cfg = load_config("tiny", ["parallel.fsdp=2", "parallel.ep=2"])
    assert check_layout(cfg, 2).fsdp == 2
    with pytest.raises(ConfigError, match="parallel.fsdp=2: tp\\*pp\\*cp\\*fsdp = 2 but the world size is 4"):
        check_layout(cfg, 4)
    with pytest.raises(ConfigError, match="parallel.ep=4: must divide fsdp\\*cp\\*tp=2"):
        check_layout(load_config("tiny", ["parallel.ep=4"]), 2)
    assert check_layout(load_config("tiny", ["train.micro_batch_size=2"]), 4).fsdp == 4  # -1 fills the world


def test_off_in_yaml_and_overrides_is_the_choice_not_a_boolean(tmp_path):
    """YAML 1.1 reads a bare `off` as False: a choice field that offers "off" takes it as that choice, from a
    dotted override and from a file alike (a GPU parity run with train.fp8=off was refused before)."""
    from moelab.config import load_config

    assert load_config("tiny", ["train.fp8=off"]).train.fp8 == "off"
    path = tmp_path / "run.yaml"
    path.write_text("base: tiny\nbackend:\n  te_fp8: off\ntrain:\n  fp8: off\n")
    cfg = load_config(str(path))
    assert (cfg.train.fp8, cfg.backend.te_fp8) == ("off", "off")


def test_router_kind_names_how_tokens_are_routed_and_an_ignored_noise_is_refused():
    assert load_config("tiny").backend.router_kind == "learned"
    assert load_config("tiny", ["backend.fake_balanced_gate=true"]).backend.router_kind == "fake_balanced"
    cfg = load_config("tiny", ["backend.fake_balanced_gate=true", "backend.fake_gate_noise=0.5"])
    assert cfg.backend.router_kind == "fake_noise=0.5"
    assert load_config("tiny", ["backend.fake_balanced_gate=true", "backend.fake_gate_noise=0"]).backend.router_kind \
        == "fake_balanced"
    # the learned router ignores the noise: refused, not silently dropped
    with pytest.raises(ConfigError, match="backend.fake_gate_noise.*fake_balanced_gate=true"):
        load_config("tiny", ["backend.fake_gate_noise=0.1"])
