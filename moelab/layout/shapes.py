"""Per-layer facts read from a ModelConfig alone, shared by the model, the FLOPs count and the HF adapters
(torch-free, no other moelab import: the ground the planner and the model both stand on).

    layer_windows(load_config("gpt-oss-20b").model)   # [128, 0, 128, 0, ...]: sliding window per layer, 0 = full
"""
from __future__ import annotations


def layer_window(m, index: int) -> int:
    """Sliding-window size of layer `index` (0 = full attention)."""
    if not m.sliding_window:
        return 0
    if m.sliding_pattern == "alternate":
        return m.sliding_window if index % 2 == 0 else 0
    return m.sliding_window


def layer_windows(m) -> list[int]:
    return [layer_window(m, i) for i in range(m.num_layers)]
