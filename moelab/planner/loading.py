"""The memory a run needs while it loads its weights from a checkpoint (train.init_from; moelab.hf.sharded_load).

    loading_bytes(cfg, pieces, rank=0, pp=1, n_moe=2, n_dense=1, dense_div=2, expert_div=1, local=10**6, pb=4)

Each rank fills its materialised parameters one tensor slice at a time: the slice is read on the host in the
file's dtype, dequantized / converted to fp32 and, for stacked experts, stacked once more (about 12 bytes per
element of the largest local slice, at most), then copied to the device. So while loading, the device holds the
rank's parameters plus one slice in the parameter dtype, and the host the 12-byte transient. The planner takes
the device figure as a second peak beside the training one (the larger wins), and reports both.
"""
from __future__ import annotations

import math

HOST_BYTES_PER_ELEMENT = 12  # file dtype (<= 4) + fp32 dequantized + the stacked copy


def largest_slice(cfg, pieces, rank: int, pp: int, n_moe: int, n_dense: int, dense_div: int,
                  expert_div: int) -> int:
    """Elements of the largest single tensor slice a pipeline rank loads (embedding, LM head, an expert stack,
    a dense FFN or attention projection), each divided over the ranks that share it."""
    m = cfg.model
    ep = cfg.parallel.ep
    D = m.hidden_size
    dense = [m.num_heads * m.head_dim * D]  # an attention projection (q / o)
    if rank == 0:
        dense.append(pieces.embedding)
    if rank == pp - 1 and not m.tie_embeddings:
        dense.append(m.vocab_size * D)
    if n_dense:
        dense.append(m.dense_ffn_size * D)
    experts = m.moe.num_experts * D * 2 * m.moe.expert_ffn_size if n_moe else 0  # w_gate_up_EDF2
    return max(math.ceil(max(dense) / dense_div), math.ceil(experts / (ep * expert_div)))


def loading_bytes(cfg, pieces, rank: int, pp: int, n_moe: int, n_dense: int, dense_div: int, expert_div: int,
                  local: int, pb: int) -> dict:
    """{"device_bytes", "host_bytes", "largest_slice"} of one pipeline rank while it loads."""
    biggest = largest_slice(cfg, pieces, rank, pp, n_moe, n_dense, dense_div, expert_div)
    return {"device_bytes": local * pb + biggest * pb, "host_bytes": HOST_BYTES_PER_ELEMENT * biggest,
            "largest_slice": biggest}
