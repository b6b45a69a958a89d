"""Per-layer facts from a ModelConfig: sliding windows and the pipeline's cost-balanced stage split."""
from moelab.config import load_config
from moelab.planner.flops import attention_params
from moelab.layout.shapes import layer_windows
from moelab.planner.stages import layer_costs, stage_layers


def test_alternating_sliding_window_starts_with_a_windowed_layer():
    m = load_config("tiny", ["model.sliding_window=8", "model.sliding_pattern=alternate"]).model
    assert layer_windows(m) == [8, 0, 8, 0]


def test_pipeline_stages_balance_layer_cost():
    m = load_config("tiny").model  # layer 0 dense, layers 1-3 MoE (top-2 of 16 experts), head on the last stage
    costs = layer_costs(m)
    assert costs[0] == attention_params(m) + 3 * m.hidden_size * m.dense_ffn_size
    assert costs[1] == costs[2] == costs[3] == attention_params(m) + m.moe.num_experts * m.hidden_size \
        + m.moe.top_k * 3 * m.hidden_size * m.moe.expert_ffn_size
    assert stage_layers(m, 4) == [[0], [1], [2], [3]]
    two = stage_layers(m, 2)
    assert sum(two, []) == [0, 1, 2, 3] and len(two[0]) >= len(two[1])  # the head weighs on the last stage
    deep = load_config("tiny", ["model.num_layers=12"]).model
    split = stage_layers(deep, 4)
    assert sum(split, []) == list(range(12)) and all(split)
