"""What the three HF families share: the family adapter's interface, and the config fields and weights every
family maps the same way (torchtitan's state_dict_adapter is the model: one class per family).

    adapter = adapter_for({"model_type": "qwen3_moe", ...})
    cfg_dict = adapter.config_from_hf(hf)                 # HF config.json -> moelab config dict
    hf = adapter.config_to_hf(model.cfg, base=hf)         # moelab ModelConfig -> HF config.json
    state = adapter.state_dict_from_hf(hf, cfg.model, tensors)    # HF tensor names -> moelab's
    out = adapter.state_dict_to_hf(hf, cfg.model, state)          # and back

Every field of the families' transformers configs is read (READ), has no effect on the math (INERT: caching,
initialisation, token ids), or is refused with a ConfigError when set to a value moelab does not compute
(tests/hf/test_fields.py holds the classification to transformers' own config classes).
"""
from __future__ import annotations

from typing import Any

import torch

from moelab.config import ConfigError
from moelab.config.score_functions import SCORE_FUNCTIONS
from moelab.config.bounds import safe_name
from moelab.hf.safetensors_folder import Rows
from moelab.model.layers import HIDDEN_ACTS

# Fields of transformers' PretrainedConfig and generation/bookkeeping fields: none changes the model's math.
BASE_INERT = frozenset({
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label", "label2id",
    "is_encoder_decoder", "model_type", "output_attentions", "output_hidden_states", "problem_type", "return_dict",
    "transformers_version", "use_cache", "initializer_range", "bos_token_id", "eos_token_id", "auto_map",
    "quantization_config"})  # quantization_config: read by the folder reader (dequantized, or refused)
COMMON_READ = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
    "tie_word_embeddings", "attention_bias", "rope_parameters", "rope_scaling", "rope_theta",
    "max_position_embeddings", "attention_dropout", "pad_token_id", "num_experts_per_tok"})


def rope_params(hf: dict) -> dict:
    rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rp.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rp["rope_type"] = rp.get("rope_type", rp.get("type", "default"))
    return rp


def rope_scaling_from_hf(hf: dict) -> dict:
    rp = rope_params(hf)
    if rp["rope_type"] == "default":
        return {"kind": "none"}
    if rp["rope_type"] != "yarn" or rp.get("attention_factor") is not None:
        raise ConfigError(f"config.json rope parameters {rp}: moelab supports rope types 'default' and 'yarn' "
                          f"(without an explicit attention_factor)")
    original = rp["original_max_position_embeddings"]
    factor = rp.get("factor") or hf["max_position_embeddings"] / original
    return {"kind": "yarn", "factor": factor, "original_max_len": original,
            "beta_fast": rp.get("beta_fast") or 32.0, "beta_slow": rp.get("beta_slow") or 1.0,
            "mscale": rp.get("mscale") or 0.0, "mscale_all_dim": rp.get("mscale_all_dim") or 0.0,
            "truncate": rp.get("truncate", True)}


def rope_to_hf(m) -> dict:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    rs = m.rope_scaling
    if rs.kind == "yarn":
        rope.update(rope_type="yarn", factor=rs.factor, original_max_position_embeddings=rs.original_max_len,
                    beta_fast=rs.beta_fast, beta_slow=rs.beta_slow, truncate=rs.truncate)
        if rs.mscale or rs.mscale_all_dim:
            rope.update(mscale=rs.mscale, mscale_all_dim=rs.mscale_all_dim)
    return rope


class FamilyAdapter:
    """One HF family's mapping, both ways, of config.json fields and state-dict keys (subclasses per family).

        QWEN3_MOE.config_from_hf(json.load(open("Qwen3-30B-A3B/config.json")))["model"]["moe"]["top_k"]   # 8
    """
    model_type = ""
    architecture = ""
    READ: frozenset = frozenset()   # family fields beyond COMMON_READ
    INERT: frozenset = frozenset()  # family fields beyond BASE_INERT that change nothing moelab computes
    router_name = "gate"            # HF's name of the router module under mlp.
    score_func = "softmax"          # the registered score function (moelab.config.score_functions) HF computes

    # ------------------------------------------------------------------ configs
    def config_from_hf(self, hf: dict) -> dict:
        """A moelab config dict (for `load_config`) from an HF config.json dict."""
        if hf.get("attention_dropout", 0.0):
            raise ConfigError(f"config.json attention_dropout={hf['attention_dropout']}: moelab has no attention "
                              f"dropout; set it to 0.0")
        H = hf["num_attention_heads"]
        model: dict[str, Any] = {
            "vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"], "num_layers": hf["num_hidden_layers"],
            "num_heads": H, "num_kv_heads": hf.get("num_key_value_heads") or H,
            "rope_theta": float(rope_params(hf)["rope_theta"]), "norm_eps": hf.get("rms_norm_eps", 1e-6),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "attention_bias": bool(hf.get("attention_bias", False)), "rope_scaling": rope_scaling_from_hf(hf),
            "pad_token_id": -1 if hf.get("pad_token_id") is None else int(hf["pad_token_id"])}
        backend: dict[str, Any] = {}
        moe = {"top_k": hf["num_experts_per_tok"], "score_func": SCORE_FUNCTIONS[self.score_func].name}
        self.family_from_hf(hf, model, moe, backend)
        model["moe"] = moe
        name = hf.get("_name_or_path") or hf.get("model_type")
        return {"name": safe_name(str(name).rstrip("/").rsplit("/", 1)[-1] or "hf"), "model": model,
                "backend": backend}

    def family_from_hf(self, hf: dict, model: dict, moe: dict, backend: dict) -> None:
        """Fill the family's model, moe and backend fields (subclasses)."""
        raise NotImplementedError

    @staticmethod
    def hidden_act_from_hf(hf: dict) -> str:
        act = hf.get("hidden_act", "silu")
        if act not in HIDDEN_ACTS:
            raise ConfigError(f"config.json hidden_act={act!r}: moelab computes {', '.join(HIDDEN_ACTS)} "
                              f"(prelu and xielu learn parameters moelab does not hold)")
        return act

    @staticmethod
    def aux_coeff_from_hf(hf: dict, top_k: int) -> float:
        """transformers' aux loss is K times moelab's for one MoE layer (it divides expert counts by T, moelab
        by T*K as Megatron does): moelab's coefficient is K * router_aux_loss_coef (docs/architectures-and-hf.md: the conventions)."""
        return top_k * float(hf.get("router_aux_loss_coef") or 0.0)

    def config_to_hf(self, m, base: dict | None = None) -> dict:
        """An HF config.json dict for a moelab ModelConfig `m`; keys of `base` (a loaded config.json) are kept."""
        hf = dict(base or {})
        for stale in ("rope_scaling", "rope_theta", "quantization_config", "_name_or_path", "auto_map"):
            hf.pop(stale, None)  # auto_map: e.g. Kimi-K2's remote code; the written folder is plain transformers
        hf.update(architectures=[self.architecture], model_type=self.model_type,
                  vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                  num_attention_heads=m.num_heads, rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings,
                  attention_bias=m.attention_bias, rope_parameters=rope_to_hf(m), num_experts_per_tok=m.moe.top_k,
                  pad_token_id=m.pad_token_id if m.pad_token_id >= 0 else None, attention_dropout=0.0)
        if m.rope_scaling.kind == "yarn":
            hf.setdefault("max_position_embeddings", int(m.rope_scaling.original_max_len * m.rope_scaling.factor))
        error = self.family_to_hf(m, hf)
        if m.moe.score_func != self.score_func:
            error = (f"its format routes with score_func={self.score_func!r} (transformers computes no other); this "
                     f"model has model.moe.score_func={m.moe.score_func!r}") + (f"; and {error}" if error else "")
        if error:
            raise ConfigError(f"save_hf as {self.model_type}: {error}")
        return hf

    def family_to_hf(self, m, hf: dict) -> str | None:
        """Write the family's fields into `hf`; returns why `m` has no place in this format, or None."""
        raise NotImplementedError

    # ------------------------------------------------------------------ weights
    def renames(self, m) -> dict[str, str]:
        """moelab name -> HF name for every tensor copied one to one."""
        names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
        if not m.tie_embeddings:
            names["output.weight"] = "lm_head.weight"
        for i in range(m.num_layers):
            ours, theirs = f"layers.{i}.", f"model.layers.{i}."
            names[ours + "attention_norm.weight"] = theirs + "input_layernorm.weight"
            names[ours + "ffn_norm.weight"] = theirs + "post_attention_layernorm.weight"
            names.update(self.attention_renames(m, ours + "attention.", theirs + "self_attn."))
            f, h = ours + "ffn.", theirs + "mlp."
            if i < m.num_dense_layers:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    names[f"{f}{proj}.weight"] = f"{h}{proj}.weight"
                continue
            names[f + "router.weight"] = f"{h}{self.router_name}.weight"
            if m.moe.router_bias:
                names[f + "router.bias"] = f"{h}{self.router_name}.bias"
            names.update(self.router_renames(f, h))
            if m.moe.num_shared_experts:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    names[f"{f}shared_experts.{proj}.weight"] = f"{h}shared_experts.{proj}.weight"
        return names

    def attention_renames(self, m, a: str, t: str) -> dict[str, str]:
        """Grouped-query attention (Qwen3-MoE, GPT-OSS); DeepSeek-V3 overrides it for MLA."""
        names = {}
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[f"{a}{proj}.weight"] = f"{t}{proj}.weight"
            if m.attention_bias:
                names[f"{a}{proj}.bias"] = f"{t}{proj}.bias"
        if m.qk_norm:
            names[a + "q_norm.weight"], names[a + "k_norm.weight"] = t + "q_norm.weight", t + "k_norm.weight"
        if m.attention_sinks:
            names[a + "sinks"] = t + "sinks"
        return names

    def router_renames(self, f: str, h: str) -> dict[str, str]:
        return {}

    def state_dict_from_hf(self, hf: dict, m, tensors) -> dict[str, torch.Tensor]:
        """moelab's state dict (parameters, and routing buffers the checkpoint holds) from `tensors` (a
        SafetensorsFolder), read whole."""
        return {name: rows.read() for name, rows in self.sources(hf, m, tensors).items()}

    def sources(self, hf: dict, m, tensors) -> dict:
        """moelab name -> Rows (moelab.hf.safetensors_folder): each tensor of moelab's state dict, not yet read,
        readable by row ranges of its dim 0 (an expert range for stacked experts), so that a rank reads only
        what it owns. A tensor the checkpoint lacks is a ConfigError naming it."""
        src = {ours: tensors.rows(theirs) for ours, theirs in self.renames(m).items()}
        if m.tie_embeddings:
            src["output.weight"] = src["tok_embeddings.weight"]
        src = self.permute_from_hf(hf, m, src)
        for i in range(m.num_dense_layers, m.num_layers):
            src.update(self.experts_from_hf(m, f"model.layers.{i}.mlp.experts.", f"layers.{i}.ffn.experts.",
                                            tensors))
        return src

    def state_dict_to_hf(self, hf: dict, m, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The HF tensors (by HF name) of moelab's `state`."""
        out = {theirs: state[ours] for ours, theirs in self.renames(m).items()}
        out = self.permute_to_hf(hf, m, out)
        for i in range(m.num_dense_layers, m.num_layers):
            out.update(self.experts_to_hf(m, state, f"layers.{i}.ffn.experts.", f"model.layers.{i}.mlp.experts."))
        return out

    def permute_from_hf(self, hf: dict, m, state: dict) -> dict:
        return state

    def permute_to_hf(self, hf: dict, m, out: dict) -> dict:
        return out

    def experts_from_hf(self, m, theirs: str, ours: str, tensors) -> dict:
        """Stacked w_gate_up_EDF2 = [gate | up] and w_down_EFD (as Rows over the experts) from transformers'
        fused in-memory layout ([E, 2F, D] gate|up and [E, D, F]) or one nn.Linear per expert and projection
        (published checkpoints, save_pretrained of Qwen3-MoE and DeepSeek-V3)."""
        if theirs + "gate_up_proj" in tensors:
            gu, down = tensors.rows(theirs + "gate_up_proj"), tensors.rows(theirs + "down_proj")
            return {ours + "w_gate_up_EDF2": gu.map(lambda t: t.transpose(1, 2), _swap12(gu.shape)),
                    ours + "w_down_EFD": down.map(lambda t: t.transpose(1, 2), _swap12(down.shape))}
        E = m.moe.num_experts
        proj = {p: [tensors.rows(f"{theirs}{e}.{p}_proj.weight") for e in range(E)] for p in ("gate", "up", "down")}
        for p, per_expert in proj.items():
            shapes = {r.shape for r in per_expert}
            if len(shapes) > 1:
                raise ConfigError(f"{tensors.path}: {theirs}*.{p}_proj.weight: the experts' tensors differ in "
                                  f"shape {sorted(shapes)}; every expert must have the same shape")
        (F, D), (D2, F2) = proj["gate"][0].shape, proj["down"][0].shape

        def gate_up(a: int, b: int) -> torch.Tensor:
            g = [proj["gate"][e].read() for e in range(a, b)]
            u = [proj["up"][e].read() for e in range(a, b)]
            if not g:
                return torch.zeros(0, D, 2 * F)
            return torch.cat([torch.stack(g), torch.stack(u)], dim=1).transpose(1, 2)

        def down(a: int, b: int) -> torch.Tensor:
            d = [proj["down"][e].read() for e in range(a, b)]
            return torch.stack(d).transpose(1, 2) if d else torch.zeros(0, F2, D2)

        return {ours + "w_gate_up_EDF2": Rows((E, D, 2 * F), gate_up), ours + "w_down_EFD": Rows((E, F2, D2), down)}

    def experts_to_hf(self, m, state: dict, ours: str, theirs: str) -> dict:
        """One nn.Linear per expert and projection, as save_pretrained writes these families."""
        gate_EFD, up_EFD = state[ours + "w_gate_up_EDF2"].transpose(1, 2).chunk(2, dim=1)
        w2 = state[ours + "w_down_EFD"]
        out = {}
        for e in range(m.moe.num_experts):
            out[f"{theirs}{e}.gate_proj.weight"] = gate_EFD[e]
            out[f"{theirs}{e}.up_proj.weight"] = up_EFD[e]
            out[f"{theirs}{e}.down_proj.weight"] = w2[e].t()
        return out

    @staticmethod
    def dense_prefix(dense: list[int], what: str) -> int:
        if dense != list(range(len(dense))):
            raise ConfigError(f"config.json {what}: dense layers {dense} are not the first k layers, which is the "
                              f"only mix of dense and MoE layers moelab builds")
        return len(dense)


def _swap12(shape: tuple) -> tuple:
    return (shape[0], shape[2], shape[1])
