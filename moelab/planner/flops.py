"""Parameter and FLOP accounting from a config alone (no torch needed), shared by the trainer and the planner.

FLOPs convention (stated in every metrics stream and benchmark result as FLOPS_CONVENTION):
    flops_per_token = 6 * activated_params + attention
    activated_params: every parameter a token's matmuls touch: attention projections, dense FFNs, the router,
        shared experts, top_k routed experts, and the LM head; the embedding lookup is excluded (not a matmul),
        and so are norms.
    attention: causal score and value matmuls, forward + backward (3x forward), halved for causality:
        per layer 3 * 2 * ctx * H * (d_qk + d_v) / 2 with ctx = seq_len (or the window of a sliding layer,
        counted as the mean keys a query sees).
This is NeMo Automodel's convention (LM head included, causal halving) plus the router; torchtitan's omits the
causal halving and the head, giving larger TFLOPs for the same run.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moelab.layout.shapes import layer_windows

FLOPS_CONVENTION = ("6 x activated params (attention, dense FFN, router, shared + top-k experts, LM head; "
                    "no embedding) + causal attention 3 x 2 x ctx x heads x (d_qk + d_v) / 2 per layer")


@dataclass
class ParamCount:
    """Parameter counts of a model config: total, activated per token, embedding, routed experts.

        pc = count_params(load_config("qwen3-moe-30b-a3b").model)
        pc.total / 1e9, pc.activated / 1e9        # about 30.5 and 3.0
    """
    total: int
    activated: int
    embedding: int
    experts_total: int


def attention_params(m) -> int:
    D, H = m.hidden_size, m.num_heads
    if m.attention == "mla":
        d_qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = (D * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * H * d_qk) if m.q_lora_rank else D * H * d_qk
        kv = D * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank \
            + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim)
        bias = (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim + D) if m.attention_bias else 0
        return q + kv + H * m.v_head_dim * D + bias
    G, Dh = m.num_kv_heads, m.head_dim
    n = D * H * Dh + 2 * D * G * Dh + H * Dh * D
    if m.attention_bias:
        n += H * Dh + 2 * G * Dh + D
    if m.qk_norm:
        n += 2 * Dh
    if m.attention_sinks:
        n += H
    return n


def count_params(m) -> ParamCount:
    """Total and activated parameters of a ModelConfig (norm weights included in the total)."""
    D, moe = m.hidden_size, m.moe
    attn = attention_params(m)
    norms = 2 * D
    dense_ffn = 3 * D * m.dense_ffn_size
    expert = 3 * D * moe.expert_ffn_size + ((2 * moe.expert_ffn_size + D) if moe.expert_proj_bias else 0)
    router = moe.num_experts * (D + (1 if moe.router_bias else 0))
    shared = moe.num_shared_experts * 3 * D * moe.expert_ffn_size  # shared experts have no biases
    n_moe = m.num_layers - m.num_dense_layers
    embedding = m.vocab_size * D
    head = 0 if m.tie_embeddings else m.vocab_size * D
    total = (embedding + head + D + m.num_dense_layers * (attn + norms + dense_ffn)
             + n_moe * (attn + norms + router + shared + moe.num_experts * expert))
    activated = (m.vocab_size * D + m.num_dense_layers * (attn + dense_ffn)
                 + n_moe * (attn + router + shared + moe.top_k * expert))
    return ParamCount(total=total, activated=activated, embedding=embedding,
                      experts_total=n_moe * moe.num_experts * expert)


def attention_flops_per_token(m, seq_len: int) -> float:
    """Causal attention matmul FLOPs per token, forward + backward, summed over layers."""
    if m.attention == "mla":
        d_qk, d_v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    else:
        d_qk = d_v = m.head_dim
    total = 0.0
    for window in layer_windows(m):
        # mean number of keys a query sees: (L+1)/2 for full causal, about the window for a sliding layer
        ctx = (seq_len + 1) / 2 if not window or window >= seq_len else window - (window * window) / (2 * seq_len)
        total += 3 * 2 * ctx * m.num_heads * (d_qk + d_v)
    return total


def flops_per_token(m, seq_len: int) -> float:
    return 6 * count_params(m).activated + attention_flops_per_token(m, seq_len)


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """Datasheet dense peak for MFU; None where unknown (CPU)."""
    name = device_name.upper()
    table = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "B200": 2250.0, "A100": 312.0, "L40S": 362.0}
    for key, bf16 in table.items():
        if key in name:
            return bf16 if dtype == "bfloat16" else bf16 / 2
    return None


@dataclass
class BlockParams:
    """Parameters per piece of a model, from count_params (the planner's memory and loading terms).

        block_params(load_config("tiny").model).moe_experts     # the routed experts of one MoE block
    """
    embedding: int  # the token embedding
    head: int  # final norm + LM head (0 head params when tied)
    dense_layer: int  # a dense block, all parameters
    moe_layer: int  # a MoE block, all parameters
    moe_experts: int  # the routed experts of a MoE block
    # under TP (moelab.planner.plan.tensor_parallel_pieces), of moe_layer's TP-rank share: its router and
    # replicated shared experts, a tp-th of what FSDP2 gathers whole over dp*cp*tp ranks; column/row shared
    # experts, their own FSDP2 unit over dp*cp (moelab.parallel.fsdp)
    tp_replicated: int = 0
    tp_shared: int = 0


def block_params(m) -> BlockParams:
    """Per-block parameter counts, by differencing count_params on 0- and 1-layer models."""
    none = count_params(dataclasses.replace(m, num_layers=0, num_dense_layers=0))
    dense = count_params(dataclasses.replace(m, num_layers=1, num_dense_layers=1))
    moe = count_params(dataclasses.replace(m, num_layers=1, num_dense_layers=0))
    return BlockParams(embedding=none.embedding, head=none.total - none.embedding,
                       dense_layer=dense.total - none.total, moe_layer=moe.total - none.total,
                       moe_experts=moe.experts_total)
