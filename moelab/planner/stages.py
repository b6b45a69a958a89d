"""The pipeline's stage partitioning: which layers each stage holds (its cost-balanced split), shared by the
pipeline (moelab.parallel) and the analytic planner; torch-free.

    stage_layers(load_config("tiny").model, 2)     # [[0, 1], [2, 3]]: contiguous layer ranges, one per stage
"""
from __future__ import annotations

from moelab.planner.flops import attention_params, count_params


def layer_costs(m) -> list[float]:
    """Matmul cost per layer (activated parameters): dense layers and MoE layers differ."""
    pc = count_params(m)
    dense = attention_params(m) + 3 * m.hidden_size * m.dense_ffn_size
    n_moe = m.num_layers - m.num_dense_layers
    moe = (pc.activated - m.vocab_size * m.hidden_size - m.num_dense_layers * dense) / max(n_moe, 1)
    return [dense if i < m.num_dense_layers else moe for i in range(m.num_layers)]


def stage_layers(m, num_stages: int) -> list[list[int]]:
    """Contiguous layer ranges, one per stage, minimising the most expensive stage (the LM head counts on the
    last one). Every stage gets at least one layer."""
    costs = layer_costs(m)
    n = len(costs)
    if num_stages > n:
        raise ValueError(f"moelab.planner.stages.stage_layers: {num_stages} stages need at least as many layers (have {n})")
    costs[-1] += m.vocab_size * m.hidden_size
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[s][i]: the smallest maximum stage cost splitting the first i layers into s stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                v = max(best[s - 1][j], prefix[i] - prefix[j])
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    bounds, i = [], n
    for s in range(num_stages, 0, -1):
        bounds.append((cut[s][i], i))
        i = cut[s][i]
    return [list(range(a, b)) for a, b in reversed(bounds)]


def split_layers(m, pp: int, vp: int) -> list[list[int]]:
    """Layer indices held by each pipeline rank: the pipeline's own cost-balanced split into pp*vp virtual
    stages (stage_layers), virtual stage v on rank v % pp."""
    ranks: list[list[int]] = [[] for _ in range(pp)]
    for v, layers in enumerate(stage_layers(m, pp * vp)):
        ranks[v % pp].extend(layers)
    return ranks
