"""The memory train.fp8 adds: the routed experts' e4m3 weight cache (moelab.model.fp8_cache).

    fp8_cache_bytes(cfg, pieces, n_moe=8, ep=1, experts_sharded=False, micro_batches=8)   # ~9.7e9 at the Qwen3 proxy

With several micro batches per step the trainer quantises every expert weight once per step into two e4m3 operands
(the forward's, scaled along K, and the dgrad's, scaled along N: 1 byte per element each) with their fp32 scales,
and keeps these buffers for the rest of the run. One micro batch per step quantises per GEMM instead (a
transient of one weight, not counted), and so do experts FSDP2 shards (DTensors are not cached). The FP8 GEMMs
keep the same activations as the bf16 ones (their bf16 inputs).
"""
from __future__ import annotations


def fp8_cache_bytes(cfg, pieces, n_moe: int, ep: int, experts_sharded: bool, micro_batches: int) -> int:
    """Bytes of the FP8 expert weight cache on a rank holding `n_moe` MoE blocks with 1/`ep` of their experts;
    `pieces`: moelab.planner.flops.block_params; 0 where it is not kept (see the module docstring)."""
    if cfg.train.fp8 == "off" or micro_batches < 2 or experts_sharded or not n_moe:
        return 0
    k, D = cfg.model.moe, cfg.model.hidden_size
    F, local = k.expert_ffn_size, k.num_experts // ep
    # gate|up [D, 2F] and down [F, D]: scales per (expert, output column) and per (expert, input row)
    scales = 4 * local * (2 * F + D + D + F)
    return n_moe * (2 * pieces.moe_experts // ep + scales)
