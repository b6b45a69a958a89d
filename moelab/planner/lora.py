"""What train.lora trains, counted from a config alone: the adapters moelab.model.lora adds (and the router with
train.lora.train_router). The planner charges gradients and AdamW state to these only; the frozen base weights
keep their weights and nothing else.

    lp = lora_params(load_config("tiny", {"train.lora.rank": 8, "train.lora.targets": "attention,experts"}))
    lp.dense_block, lp.moe_block, lp.experts, lp.router        # per block, whole (before any sharding)

A linear layer I -> O gains A [R, I] and B [O, R]: R * (I + O) parameters; stacked routed experts gain
A [E, D, R] + B [E, R, 2F] beside w_gate_up_EDF2 and A [E, F, R] + B [E, R, D] beside w_down_EFD.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from moelab.config.lora import resolve_lora_targets


@dataclass
class LoRAParams:
    """Parameters train.lora adds or trains in one block, before sharding.

        lora_params(cfg).experts      # the grouped adapters of one MoE block's routed experts
    """
    dense_block: int  # adapters of a dense block (attention projections, dense MLP)
    moe_block: int  # adapters of a MoE block outside its routed experts (attention, shared experts)
    experts: int  # the routed experts' grouped adapters of a MoE block
    router: int  # a MoE block's router weights when train.lora.train_router (0 otherwise); not new parameters

    def on_rank(self, n_dense: int, n_moe: int, dense_div: int, expert_div: int) -> tuple[int, int]:
        """(adapters, trained parameters) one rank holds for `n_dense` + `n_moe` blocks, with dense parameters
        over `dense_div` ranks and experts over `expert_div` (ep x expert-FSDP)."""
        adapters = (math.ceil((n_dense * self.dense_block + n_moe * self.moe_block) / dense_div)
                    + math.ceil(n_moe * self.experts / expert_div))
        return adapters, adapters + math.ceil(n_moe * self.router / dense_div)


def _projections(m) -> dict[str, tuple[int, int]]:
    """(in, out) widths of the attention projections of ModelConfig `m` (moelab.model.attention / mla)."""
    D, H = m.hidden_size, m.num_heads
    if m.attention != "mla":
        q, kv = H * m.head_dim, m.num_kv_heads * m.head_dim
        return {"q_proj": (D, q), "k_proj": (D, kv), "v_proj": (D, kv), "o_proj": (q, D)}
    qk = H * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    out = {"q_a_proj": (D, m.q_lora_rank), "q_b_proj": (m.q_lora_rank, qk)} if m.q_lora_rank else {"q_proj": (D, qk)}
    return {**out, "kv_a_proj": (D, m.kv_lora_rank + m.qk_rope_head_dim),
            "kv_b_proj": (m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim)), "o_proj": (H * m.v_head_dim, D)}


def lora_params(cfg) -> LoRAParams | None:
    """Per-block LoRA parameters of Config `cfg`; None when train.lora is off (rank 0)."""
    lo, m = cfg.train.lora, cfg.model
    if lo.rank == 0:
        return None
    R, D, moe = lo.rank, m.hidden_size, m.moe
    targets = set(resolve_lora_targets(m, lo.targets))
    attn = sum(R * (i + o) for name, (i, o) in _projections(m).items() if name in targets)
    mlp = lambda width: 3 * R * (D + width)  # noqa: E731  gate_proj, up_proj: D -> width; down_proj: width -> D
    shared = mlp(moe.expert_ffn_size * moe.num_shared_experts) if "shared_experts" in targets and \
        moe.num_shared_experts else 0
    F = moe.expert_ffn_size
    return LoRAParams(
        dense_block=attn + (mlp(m.dense_ffn_size) if "dense_mlp" in targets else 0),
        moe_block=attn + shared,
        experts=moe.num_experts * R * (2 * D + 3 * F) if "experts" in targets else 0,
        router=moe.num_experts * (D + (1 if moe.router_bias else 0)) if lo.train_router else 0)
