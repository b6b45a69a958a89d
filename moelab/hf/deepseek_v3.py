"""DeepSeek-V3 and Kimi-K2: MLA, sigmoid routing with group limits and a score-correction bias, shared experts,
the first k layers dense.

DeepSeek's rotary dims come in interleaved pairs (config rope_interleave); moelab uses the rotate-half layout, so
the rotary output rows of q_b_proj (q_proj) and kv_a_proj_with_mqa are permuted (q.k is unchanged by a shared
permutation).

    cfg_dict = DeepseekV3Adapter().config_from_hf(hf)
"""
from __future__ import annotations

import torch

from moelab.config import ConfigError
from moelab.hf.adapter import FamilyAdapter


class DeepseekV3Adapter(FamilyAdapter):
    """DeepSeek-V3 / Kimi-K2 <-> moelab. transformers trains these without an aux loss and keeps the
    correction bias fixed, so moelab's defaults (aux_loss_coeff 0, bias_update_rate 0) match it.

        DeepseekV3Adapter().config_from_hf(hf)["model"]["attention"]   # "mla"
    """
    model_type, architecture = "deepseek_v3", "DeepseekV3ForCausalLM"
    score_func = "sigmoid"
    READ = frozenset({"intermediate_size", "moe_intermediate_size", "n_shared_experts", "n_routed_experts",
                      "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
                      "qk_nope_head_dim", "n_group", "topk_group", "first_k_dense_replace", "norm_topk_prob",
                      "hidden_act", "rope_interleave",
                      # keys of the published (remote-code) configs, refused unless at DeepSeek-V3's values
                      "moe_layer_freq", "scoring_func", "topk_method"})
    INERT = frozenset({
        "output_router_logits",  # transformers' DeepSeek-V3 computes no aux loss from them
        "num_nextn_predict_layers",  # multi-token prediction: transformers builds no such layers (tensors skipped)
        "qk_head_dim", "head_dim",  # derived: qk_nope + qk_rope, and qk_rope
        "pretraining_tp",  # not read by transformers' DeepSeek-V3
        "aux_loss_alpha", "seq_aux", "ep_size"})  # remote-code training/placement knobs transformers ignores

    def family_from_hf(self, hf, model, moe, backend):
        if hf.get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"config.json moe_layer_freq={hf['moe_layer_freq']}: only 1 is supported")
        if hf.get("scoring_func", self.score_func) != self.score_func:
            raise ConfigError(f"config.json scoring_func={hf['scoring_func']!r}: DeepSeek-V3 routing is "
                              f"{self.score_func}")
        if hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ConfigError(f"config.json topk_method={hf['topk_method']!r}: moelab routes as DeepSeek-V3's "
                              f"'noaux_tc' (group-limited, with the score-correction bias)")
        H = hf["num_attention_heads"]
        model.update(attention="mla", num_kv_heads=H, head_dim=hf.get("v_head_dim") or 128,
                     q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                     qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                     v_head_dim=hf["v_head_dim"], num_dense_layers=hf.get("first_k_dense_replace", 0),
                     dense_ffn_size=hf["intermediate_size"], hidden_act=self.hidden_act_from_hf(hf))
        moe.update(num_experts=hf["n_routed_experts"], norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                   expert_ffn_size=hf["moe_intermediate_size"],
                   num_shared_experts=hf.get("n_shared_experts") or 0,
                   route_scale=hf.get("routed_scaling_factor", 1.0), num_groups=hf.get("n_group") or 1,
                   topk_groups=hf.get("topk_group") or 1)

    def family_to_hf(self, m, hf):
        moe = m.moe
        if m.attention != "mla":
            return "DeepSeek-V3 needs MLA attention"
        hf.update(num_key_value_heads=m.num_heads, q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank,
                  qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                  first_k_dense_replace=m.num_dense_layers, intermediate_size=m.dense_ffn_size,
                  n_routed_experts=moe.num_experts, moe_intermediate_size=moe.expert_ffn_size,
                  n_shared_experts=moe.num_shared_experts, routed_scaling_factor=moe.route_scale,
                  n_group=moe.num_groups, topk_group=moe.topk_groups, norm_topk_prob=moe.norm_topk_prob,
                  hidden_act=m.hidden_act)
        hf.setdefault("rope_interleave", True)
        hf.pop("head_dim", None)
        hf.pop("qk_head_dim", None)
        return None

    # ------------------------------------------------------------------ weights
    def attention_renames(self, m, a, t):
        pairs = [("q_a_proj", "q_a_proj"), ("q_a_norm", "q_a_layernorm"), ("q_b_proj", "q_b_proj")] \
            if m.q_lora_rank else [("q_proj", "q_proj")]
        pairs += [("kv_a_proj", "kv_a_proj_with_mqa"), ("kv_a_norm", "kv_a_layernorm"), ("kv_b_proj", "kv_b_proj"),
                  ("o_proj", "o_proj")]
        names = {f"{a}{o}.weight": f"{t}{h}.weight" for o, h in pairs}
        if m.attention_bias:
            for o, h in (("q_a_proj", "q_a_proj"), ("kv_a_proj", "kv_a_proj_with_mqa"), ("o_proj", "o_proj")):
                if o != "q_a_proj" or m.q_lora_rank:
                    names[f"{a}{o}.bias"] = f"{t}{h}.bias"
        return names

    def router_renames(self, f, h):
        return {f + "router.expert_bias": h + "gate.e_score_correction_bias"}

    def permute_from_hf(self, hf, m, state):
        """`state` holds Rows (moelab.hf.safetensors_folder): the permuted rows are read where they lie."""
        return self._permute(hf, m, state, {k: k for k in state}, inverse=False,
                             take=lambda rows, order: rows.permuted(order))

    def permute_to_hf(self, hf, m, out):
        return self._permute(hf, m, out, {theirs: ours for ours, theirs in self.renames(m).items()}, inverse=True,
                             take=lambda t, order: t[order])

    @staticmethod
    def _permute(hf, m, tensors: dict, moelab_name: dict, inverse: bool, take) -> dict:
        """Interleaved rotary pairs (x0, x1), (x2, x3), ... <-> rotate-half order (x0, x2, ..., x1, x3, ...)."""
        if not hf.get("rope_interleave", True):
            return tensors
        R = m.qk_rope_head_dim
        perm_R = torch.cat([torch.arange(0, R, 2), torch.arange(1, R, 2)])
        if inverse:
            perm_R = torch.argsort(perm_R)
        out = dict(tensors)
        for name, t in tensors.items():
            ours = moelab_name.get(name, "")
            rows = _rope_rows(m, ours, perm_R) if ours.startswith("layers.") else None
            if rows is not None:
                out[name] = take(t, rows)
        return out


def _rope_rows(m, name: str, perm_R: torch.Tensor) -> torch.Tensor | None:
    """Row order of a projection's output that applies `perm_R` to its rotary rows (None: not a rotary output)."""
    leaf = name.rsplit(".", 2)[-2]
    if leaf in ("q_b_proj", "q_proj"):
        dqk = m.qk_nope_head_dim + m.qk_rope_head_dim
        head = torch.cat([torch.arange(m.qk_nope_head_dim), m.qk_nope_head_dim + perm_R])
        return (torch.arange(m.num_heads)[:, None] * dqk + head[None, :]).reshape(-1)
    if leaf == "kv_a_proj":
        return torch.cat([torch.arange(m.kv_lora_rank), m.kv_lora_rank + perm_R])
    return None
