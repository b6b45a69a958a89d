"""The planner's local_weighting option: the code before a3f8c38 weighted the expert outputs at combine and kept
them for the weights' gradient; records measured with it are planned that way (moelab.gallery.records)."""
import pytest

from moelab.config import ConfigError, load_config
from moelab.gallery.records import planner_options
from moelab.planner.plan import plan
from moelab.planner.saved import saved_per_token

BF16 = ["train.dtype=bfloat16", "train.param_dtype=bfloat16"]


@pytest.mark.parametrize("compiled", [False, True])
def test_combine_keeps_the_expert_outputs_of_the_local_path(compiled):
    cfg = load_config("qwen3-moe-30b-a3b-proxy", BF16 + [f"train.compile={compiled}"])
    m = cfg.model
    K, D, a = m.moe.top_k, m.hidden_size, 2
    now = saved_per_token(cfg, True, a)["ffn"]
    then = saved_per_token(cfg, True, a, weighting="combine")["ffn"]
    F = m.moe.expert_ffn_size
    # compiled: the expert output for the weights' gradient; eager: also the index_copy source, and no activation
    # before its weighting
    assert then - now == (K * a * D if compiled else 2 * K * a * D - K * a * F)
    fake = cfg.replace(**{"backend.fake_balanced_gate": True})
    assert saved_per_token(fake, True, a, weighting="combine")["ffn"] - saved_per_token(fake, True, a)["ffn"] == \
        (0 if compiled else K * a * D)  # constant weights: only the eager index_copy source
    p_now, p_then = plan(cfg, gpus=1), plan(cfg, gpus=1, local_weighting="combine")
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len
    moe_layers = m.num_layers - m.num_dense_layers
    assert p_then.memory["activations"] - p_now.memory["activations"] == moe_layers * tokens * (then - now)
    assert any("local_weighting=combine" in line for line in p_then.assumptions)


def test_expert_parallel_plans_are_the_same_either_way():
    cfg = load_config("qwen3-moe-30b-a3b-proxy", BF16 + ["parallel.ep=2", "train.global_batch_size=4"])
    assert plan(cfg, gpus=2).memory == plan(cfg, gpus=2, local_weighting="combine").memory


def test_a_bad_value_is_refused_and_records_get_their_days_option():
    with pytest.raises(ConfigError, match="local_weighting='after'"):
        plan(load_config("tiny"), local_weighting="after")
    assert planner_options({"date": "2026-12-02T04:00:00Z"})["local_weighting"] == "combine"
    assert "local_weighting" not in planner_options({"date": "2026-12-02T06:00:00Z"})
