"""Every field of the supported families' transformers configs is read by moelab, has no effect on the math, or
is refused when set to a value moelab does not compute: never silently ignored."""
import pytest

transformers = pytest.importorskip("transformers")

from moelab.config import ConfigError, load_config  # noqa: E402
from moelab.hf import ADAPTERS, config_from_hf  # noqa: E402
from moelab.hf.adapter import BASE_INERT, COMMON_READ  # noqa: E402


def _hf(hfm, family, **changes):
    cls = getattr(transformers, {"qwen3_moe": "Qwen3MoeConfig", "deepseek_v3": "DeepseekV3Config",
                                 "gpt_oss": "GptOssConfig"}[family])
    return {**cls(**hfm.BASE[family]).to_dict(), **changes}


@pytest.mark.parametrize("family", list(ADAPTERS))
def test_every_transformers_config_field_is_classified(family, hfm):
    adapter = ADAPTERS[family]
    known = BASE_INERT | COMMON_READ | adapter.READ | adapter.INERT
    unknown = sorted(set(_hf(hfm, family)) - known)
    assert not unknown, f"{family}: transformers' config has fields moelab neither reads nor lists as inert: {unknown}"
    load_config(config_from_hf(_hf(hfm, family)))  # the default config loads


REFUSED = [  # (family, changes, the field the message must name)
    ("qwen3_moe", {"hidden_act": "prelu"}, "hidden_act"),
    ("deepseek_v3", {"hidden_act": "xielu"}, "hidden_act"),
    ("qwen3_moe", {"attention_dropout": 0.1}, "attention_dropout"),
    ("gpt_oss", {"attention_dropout": 0.1}, "attention_dropout"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ("qwen3_moe", {"decoder_sparse_step": 2, "mlp_only_layers": []}, "decoder_sparse_step"),
    ("qwen3_moe", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope"),
    ("gpt_oss", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "attention_factor": 2.0,
                                     "original_max_position_embeddings": 64}}, "attention_factor"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method"),
    ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq"),
    ("gpt_oss", {"swiglu_limit": 5.0}, "swiglu_alpha/limit"),
    ("gpt_oss", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("qwen3_moe", {"quantization_config": {"quant_method": "awq"}}, "quant_method"),
]


@pytest.mark.parametrize("family,changes,field", REFUSED, ids=[f"{f}-{n}" for f, _, n in REFUSED])
def test_fields_moelab_does_not_compute_are_refused_naming_the_field(family, changes, field, hfm):
    with pytest.raises(ConfigError, match=field.replace("/", ".")):
        config_from_hf(_hf(hfm, family, **changes))
