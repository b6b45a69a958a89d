"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): GQA with per-head q/k RMSNorm, softmax top-k routing.

    cfg_dict = Qwen3MoeAdapter().config_from_hf(hf)
"""
from __future__ import annotations

from moelab.hf.adapter import FamilyAdapter


class Qwen3MoeAdapter(FamilyAdapter):
    """Qwen3-MoE <-> moelab: dense layers must be the first k (mlp_only_layers / decoder_sparse_step), a sliding
    window (use_sliding_window) applies to every layer, as in transformers.

        Qwen3MoeAdapter().config_from_hf(hf)["model"]["qk_norm"]   # True
    """
    model_type, architecture = "qwen3_moe", "Qwen3MoeForCausalLM"
    READ = frozenset({"intermediate_size", "head_dim", "hidden_act", "use_sliding_window", "sliding_window",
                      "decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size", "num_experts",
                      "num_local_experts", "norm_topk_prob", "router_aux_loss_coef", "output_router_logits"})
    # output_router_logits: transformers adds the aux loss only when it is true (a config field or a call
    # argument); moelab trains with it whenever router_aux_loss_coef > 0 (docs/architectures-and-hf.md: the aux-loss conventions).
    INERT = frozenset({"max_window_layers"})  # Qwen3-MoE's modeling code never reads it

    def family_from_hf(self, hf, model, moe, backend):
        L, H = hf["num_hidden_layers"], hf["num_attention_heads"]
        every = hf.get("decoder_sparse_step", 1) or 1
        E = hf.get("num_experts") or hf["num_local_experts"]
        dense = [i for i in range(L) if i in (hf.get("mlp_only_layers") or []) or (i + 1) % every or E == 0]
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        model.update(head_dim=hf.get("head_dim") or hf["hidden_size"] // H, qk_norm=True,
                     num_dense_layers=self.dense_prefix(dense, "mlp_only_layers/decoder_sparse_step"),
                     dense_ffn_size=hf.get("intermediate_size", 1), hidden_act=self.hidden_act_from_hf(hf),
                     sliding_window=window or 0, sliding_pattern="all")
        moe.update(num_experts=E, norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                   expert_ffn_size=hf["moe_intermediate_size"],
                   aux_loss_coeff=self.aux_coeff_from_hf(hf, hf["num_experts_per_tok"]))

    def family_to_hf(self, m, hf):
        moe = m.moe
        if m.sliding_window and m.sliding_pattern != "all":
            return "Qwen3-MoE's sliding window applies to every layer (model.sliding_pattern='all')"
        if not m.qk_norm or moe.num_shared_experts or m.attention_sinks:
            return "Qwen3-MoE needs qk_norm, no shared experts and no attention sinks"
        hf.update(num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim, num_experts=moe.num_experts,
                  moe_intermediate_size=moe.expert_ffn_size, norm_topk_prob=moe.norm_topk_prob,
                  intermediate_size=m.dense_ffn_size, mlp_only_layers=list(range(m.num_dense_layers)),
                  decoder_sparse_step=1, use_sliding_window=bool(m.sliding_window),
                  sliding_window=m.sliding_window or None, hidden_act=m.hidden_act,
                  router_aux_loss_coef=moe.aux_loss_coeff / moe.top_k)
        hf.pop("num_local_experts", None)
        return None
