"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): GQA with learned sinks and alternating sliding windows, top-k by logit
with a softmax over the chosen k, biased experts with a clamped SwiGLU, stored fused ([E, D, 2F] with gate and up
interleaved column by column).

    cfg_dict = GptOssAdapter().config_from_hf(hf)
"""
from __future__ import annotations

import torch

from moelab.config import ConfigError
from moelab.hf.adapter import FamilyAdapter


class GptOssAdapter(FamilyAdapter):
    """GPT-OSS <-> moelab (attention biases optional, as attention_bias says).

        GptOssAdapter().config_from_hf(hf)["model"]["attention_sinks"]   # True
    """
    model_type, architecture = "gpt_oss", "GptOssForCausalLM"
    router_name = "router"
    score_func = "softmax_topk"
    READ = frozenset({"num_local_experts", "intermediate_size", "head_dim", "sliding_window", "layer_types",
                      "swiglu_alpha", "swiglu_limit", "router_aux_loss_coef", "output_router_logits"})
    INERT = frozenset({"hidden_act",  # transformers' GPT-OSS experts use their clamped SwiGLU, whatever it says
                       "experts_per_token", "initial_context_length"})  # published keys transformers ignores

    def family_from_hf(self, hf, model, moe, backend):
        from moelab.model.experts import GPT_OSS_ALPHA, GPT_OSS_LIMIT

        if (hf.get("swiglu_alpha", GPT_OSS_ALPHA), hf.get("swiglu_limit", GPT_OSS_LIMIT)) != (GPT_OSS_ALPHA,
                                                                                                GPT_OSS_LIMIT):
            raise ConfigError(f"config.json swiglu_alpha/limit={hf.get('swiglu_alpha')}/{hf.get('swiglu_limit')}: "
                              f"moelab's gpt_oss activation is fixed at {GPT_OSS_ALPHA}/{GPT_OSS_LIMIT}")
        L, H = hf["num_hidden_layers"], hf["num_attention_heads"]
        kinds = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)]
        alternate = [("sliding_attention" if i % 2 == 0 else "full_attention") for i in range(L)]
        if all(k == "full_attention" for k in kinds):
            window, pattern = 0, "alternate"
        elif all(k == "sliding_attention" for k in kinds):
            window, pattern = hf["sliding_window"], "all"
        elif list(kinds) == alternate:
            window, pattern = hf["sliding_window"], "alternate"
        else:
            raise ConfigError(f"config.json layer_types={kinds}: moelab supports all full, all sliding, or "
                              f"alternating starting with a sliding layer")
        model.update(head_dim=hf.get("head_dim") or hf["hidden_size"] // H, num_dense_layers=0,
                     sliding_window=window, sliding_pattern=pattern, attention_sinks=True)
        moe.update(num_experts=hf["num_local_experts"], norm_topk_prob=False,
                   expert_ffn_size=hf["intermediate_size"], router_bias=True, expert_proj_bias=True,
                   activation="gpt_oss", aux_loss_coeff=self.aux_coeff_from_hf(hf, hf["num_experts_per_tok"]))
        backend["attention"] = "eager"  # sinks need eager or flex; flex has no CPU backward

    def family_to_hf(self, m, hf):
        moe = m.moe
        if not (m.attention_sinks and moe.router_bias and moe.expert_proj_bias and moe.activation == "gpt_oss"
                ) or m.num_dense_layers or m.attention == "mla":
            return "GPT-OSS needs GQA with sinks, router and expert biases, the gpt_oss activation and no dense layers"
        from moelab.layout.shapes import layer_windows

        hf.update(num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim, num_local_experts=moe.num_experts,
                  intermediate_size=moe.expert_ffn_size, sliding_window=m.sliding_window or 128,
                  layer_types=["sliding_attention" if w else "full_attention" for w in layer_windows(m)],
                  swiglu_limit=7.0, swiglu_alpha=1.702, router_aux_loss_coef=moe.aux_loss_coeff / moe.top_k)
        return None

    # ------------------------------------------------------------------ weights
    def experts_from_hf(self, m, theirs, ours, tensors):
        w, b = tensors.rows(theirs + "gate_up_proj"), tensors.rows(theirs + "gate_up_proj_bias")
        return {ours + "w_gate_up_EDF2": w.map(lambda t: torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)),
                ours + "b_gate_up_EF2": b.map(lambda t: torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)),
                ours + "w_down_EFD": tensors.rows(theirs + "down_proj"),
                ours + "b_down_ED": tensors.rows(theirs + "down_proj_bias")}

    def experts_to_hf(self, m, state, ours, theirs):
        gate, up = state[ours + "w_gate_up_EDF2"].chunk(2, dim=-1)
        bg, bu = state[ours + "b_gate_up_EF2"].chunk(2, dim=-1)
        return {theirs + "gate_up_proj": torch.stack([gate, up], dim=-1).flatten(-2),
                theirs + "gate_up_proj_bias": torch.stack([bg, bu], dim=-1).flatten(-2),
                theirs + "down_proj": state[ours + "w_down_EFD"], theirs + "down_proj_bias": state[ours + "b_down_ED"]}
