"""Per-layer shape facts derived from a ModelConfig, shared by the model and the analytic planner."""
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
