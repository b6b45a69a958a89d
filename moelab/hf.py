"""Hugging Face checkpoints in and out: Qwen3-MoE, DeepSeek-V3 (and Kimi-K2) and GPT-OSS layouts.

    model = load_hf("path/to/Qwen3-30B-A3B")            # a local folder: config.json + *.safetensors
    logits_BLV = model(input_ids_BL)
    save_hf(model, "out/")                               # loadable by transformers' from_pretrained

Weights are renamed one to one, except:
- experts: HF stores one gate/up/down matrix per expert (the published checkpoints, and what transformers 5
  `save_pretrained` writes for Qwen3-MoE and DeepSeek-V3) or fused tensors (transformers' in-memory layout,
  [E, 2F, D] gate|up; GPT-OSS: [E, D, 2F] with gate and up interleaved column by column); moelab stacks them
  into w_gate_up_EDF2 = [gate | up] and w_down_EFD.
- DeepSeek's rotary dims come in interleaved pairs (config rope_interleave); moelab uses the rotate-half layout, so
  the rotary output rows of q_b_proj and kv_a_proj_with_mqa are permuted (q.k is unchanged by a shared permutation).
- block-FP8 checkpoints (the published DeepSeek-V3 and Kimi-K2 weights: `weight_scale_inv` per 128x128 block) are
  dequantized to fp32 as they are read; save_hf writes unquantized weights.
- MXFP4 experts (the published GPT-OSS weights: `*_blocks` + `*_scales`) are dequantized likewise.
Not supported (a ConfigError says so): other quantizations, Qwen3 sliding windows, dense layers other than the first k, rope types other than default and yarn.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from moelab.config import Config, ConfigError, flatten, load_config
from moelab.model.transformer import MoETransformer

FAMILIES = ("qwen3_moe", "deepseek_v3", "gpt_oss")
_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                  "gpt_oss": "GptOssForCausalLM"}


# ---------------------------------------------------------------------------------------------- public API
def load_hf(path: "str | Path", dtype: torch.dtype | None = None, device: "str | torch.device" = "cpu",
            **overrides: Any) -> MoETransformer:
    """A moelab model (in eval mode) with the weights of a local HF checkpoint folder; `model.moelab_config` is
    its Config. Tensors are read one at a time but held in fp32 on the CPU until loaded, so a checkpoint needs
    about 4 bytes per parameter of host memory.

    `overrides` are config sections or dotted keys: ``load_hf(p, backend={"attention": "eager"})`` or
    ``load_hf(p, **{"model.moe.capacity_factor": 1.25})``. `dtype` casts the parameters (default: float32).

        model = load_hf("Qwen3-30B-A3B", dtype=torch.bfloat16, device="cuda")
        logits_BLV = model(torch.tensor([[1, 2, 3]], device="cuda"))
    """
    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    family = _family(hf)
    cfg = load_config(config_from_hf(hf), flatten(overrides))
    with torch.device("meta"):
        model = MoETransformer(cfg.model, cfg.backend)
    model.to_empty(device=device)
    for moe in model.moe_layers():
        moe.router.reset_buffers()
    tensors = _SafetensorsFolder(path, _quantization(hf))
    state = _to_moelab(family, hf, cfg, tensors)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in model.state_dict().items():  # routing buffers start fresh unless the checkpoint has them
        if name not in params:
            state.setdefault(name, t)
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise ConfigError(f"{path}: the checkpoint lacks {len(missing)} tensors moelab needs, e.g. {missing[:3]}")
    unused = [k for k in tensors.names() if k not in tensors.used and not _ignorable(k, cfg.model.num_layers)]
    if unused:
        raise ConfigError(f"{path}: {len(unused)} checkpoint tensors have no place in the moelab model, e.g. "
                          f"{unused[:3]}; is config.json the one of these weights?")
    model.load_state_dict(state, strict=True)
    if dtype is not None:
        for p in model.parameters():
            p.data = p.data.to(dtype)
    model.moelab_config, model.hf_config = cfg, hf
    return model.eval()  # like transformers' from_pretrained; call .train() to fine-tune


def save_hf(model: MoETransformer, path: "str | Path", dtype: torch.dtype | None = None) -> Path:
    """Write `model` as an HF checkpoint folder (config.json + model.safetensors) that transformers loads.

        save_hf(load_hf("in/"), "out/")
        AutoModelForCausalLM.from_pretrained("out/")
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    base = getattr(model, "hf_config", None) or {}
    family = _family(base) if base else family_of(cfg)
    hf = hf_config_from(cfg, family, base)
    if family != "deepseek_v3" and any(moe.router.expert_bias.any() for moe in model.moe_layers()):
        raise ConfigError(f"save_hf as {family}: the routers' expert_bias (aux-loss-free balancing) is nonzero and "
                          f"that format has no place for it; only the DeepSeek-V3 layout keeps it")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    out = _to_hf(family, hf, cfg, state)
    if dtype is not None:
        out = {k: (v.to(dtype) if v.is_floating_point() and not k.endswith("e_score_correction_bias") else v)
               for k, v in out.items()}
    hf["dtype"] = str(next(iter(model.parameters())).dtype if dtype is None else dtype).removeprefix("torch.")
    save_file({k: v.contiguous().cpu() for k, v in out.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    return path


# ---------------------------------------------------------------------------------------------- configs
def _family(hf: dict) -> str:
    kind = hf.get("model_type", "")
    if kind in ("deepseek_v3", "kimi_k2"):
        return "deepseek_v3"
    if kind in ("qwen3_moe", "gpt_oss"):
        return kind
    raise ConfigError(f"config.json model_type={kind!r}: moelab reads {', '.join(FAMILIES)} (and kimi_k2)")


def family_of(m) -> str:
    """The HF layout that can express a moelab ModelConfig."""
    if m.attention == "mla":
        return "deepseek_v3"
    if m.attention_sinks or m.moe.activation == "gpt_oss":
        return "gpt_oss"
    return "qwen3_moe"


def _rope_params(hf: dict) -> dict:
    rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rp.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rp["rope_type"] = rp.get("rope_type", rp.get("type", "default"))
    return rp


def _rope_scaling(hf: dict) -> dict:
    rp = _rope_params(hf)
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


def config_from_hf(hf: dict) -> dict:
    """A moelab config dict (for `load_config`) from an HF config.json dict."""
    family = _family(hf)
    _quantization(hf)  # raises for quantizations moelab cannot read
    L, H = hf["num_hidden_layers"], hf["num_attention_heads"]
    model: dict[str, Any] = {
        "vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"], "num_layers": L, "num_heads": H,
        "num_kv_heads": hf.get("num_key_value_heads") or H, "rope_theta": float(_rope_params(hf)["rope_theta"]),
        "norm_eps": hf.get("rms_norm_eps", 1e-6), "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "attention_bias": bool(hf.get("attention_bias", False)), "rope_scaling": _rope_scaling(hf)}
    backend: dict[str, Any] = {}
    if family == "qwen3_moe":
        if hf.get("use_sliding_window"):
            raise ConfigError("config.json use_sliding_window=true: Qwen3 sliding windows are not supported")
        every = hf.get("decoder_sparse_step", 1)
        dense = [i for i in range(L) if i in (hf.get("mlp_only_layers") or []) or (i + 1) % every]
        model.update(head_dim=hf.get("head_dim") or hf["hidden_size"] // H, qk_norm=True,
                     num_dense_layers=_dense_prefix(dense, "mlp_only_layers/decoder_sparse_step"),
                     dense_ffn_size=hf.get("intermediate_size", 1))
        moe = {"num_experts": hf.get("num_experts") or hf["num_local_experts"], "score_func": "softmax",
               "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
               "expert_ffn_size": hf["moe_intermediate_size"],
               "aux_loss_coeff": hf.get("router_aux_loss_coef", 0.0)}
    elif family == "deepseek_v3":
        if hf.get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"config.json moe_layer_freq={hf['moe_layer_freq']}: only 1 is supported")
        if hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"config.json scoring_func={hf['scoring_func']!r}: DeepSeek-V3 routing is sigmoid")
        model.update(attention="mla", num_kv_heads=H, head_dim=hf.get("v_head_dim") or 128,
                     q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                     qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                     v_head_dim=hf["v_head_dim"], num_dense_layers=hf.get("first_k_dense_replace", 0),
                     dense_ffn_size=hf["intermediate_size"])
        moe = {"num_experts": hf["n_routed_experts"], "score_func": "sigmoid",
               "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
               "expert_ffn_size": hf["moe_intermediate_size"], "num_shared_experts": hf.get("n_shared_experts") or 0,
               "route_scale": hf.get("routed_scaling_factor", 1.0), "num_groups": hf.get("n_group") or 1,
               "topk_groups": hf.get("topk_group") or 1}
    else:
        from moelab.model.experts import GPT_OSS_ALPHA, GPT_OSS_LIMIT

        if (hf.get("swiglu_alpha", GPT_OSS_ALPHA), hf.get("swiglu_limit", GPT_OSS_LIMIT)) != (GPT_OSS_ALPHA,
                                                                                                GPT_OSS_LIMIT):
            raise ConfigError(f"config.json swiglu_alpha/limit={hf.get('swiglu_alpha')}/{hf.get('swiglu_limit')}: "
                              f"moelab's gpt_oss activation is fixed at {GPT_OSS_ALPHA}/{GPT_OSS_LIMIT}")
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
        moe = {"num_experts": hf["num_local_experts"], "score_func": "softmax_topk", "norm_topk_prob": False,
               "expert_ffn_size": hf["intermediate_size"], "router_bias": True, "expert_proj_bias": True,
               "activation": "gpt_oss", "aux_loss_coeff": hf.get("router_aux_loss_coef", 0.0)}
        backend["attention"] = "eager"  # sinks need eager or flex; flex has no CPU backward
    moe["top_k"] = hf["num_experts_per_tok"]
    model["moe"] = moe
    name = hf.get("_name_or_path") or hf.get("model_type")
    return {"name": str(name).rstrip("/").rsplit("/", 1)[-1] or "hf", "model": model, "backend": backend}


def _dense_prefix(dense: list[int], what: str) -> int:
    if dense != list(range(len(dense))):
        raise ConfigError(f"config.json {what}: dense layers {dense} are not the first k layers, which is the "
                          f"only mix of dense and MoE layers moelab builds")
    return len(dense)


def hf_config_from(m, family: str, base: dict | None = None) -> dict:
    """An HF config.json dict for a moelab ModelConfig; keys of `base` (a loaded config.json) are kept."""
    hf = dict(base or {})
    for stale in ("rope_scaling", "rope_theta", "quantization_config", "_name_or_path"):
        hf.pop(stale, None)
    moe = m.moe
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    rs = m.rope_scaling
    if rs.kind == "yarn":
        rope.update(rope_type="yarn", factor=rs.factor, original_max_position_embeddings=rs.original_max_len,
                    beta_fast=rs.beta_fast, beta_slow=rs.beta_slow, truncate=rs.truncate)
        if rs.mscale or rs.mscale_all_dim:
            rope.update(mscale=rs.mscale, mscale_all_dim=rs.mscale_all_dim)
    hf.pop("auto_map", None)  # e.g. Kimi-K2's remote code: the written folder is plain transformers
    hf.update(architectures=[_ARCHITECTURES[family]], model_type=family,
              vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
              num_attention_heads=m.num_heads, rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings,
              attention_bias=m.attention_bias, rope_parameters=rope, num_experts_per_tok=moe.top_k)
    if rs.kind == "yarn":
        hf.setdefault("max_position_embeddings", int(rs.original_max_len * rs.factor))
    layer_shape_error = None
    if family == "qwen3_moe":
        if not m.qk_norm or moe.num_shared_experts or moe.score_func != "softmax" or m.sliding_window:
            layer_shape_error = "Qwen3-MoE needs qk_norm, softmax routing, no shared experts and no sliding window"
        hf.update(num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim, num_experts=moe.num_experts,
                  moe_intermediate_size=moe.expert_ffn_size, norm_topk_prob=moe.norm_topk_prob,
                  intermediate_size=m.dense_ffn_size, mlp_only_layers=list(range(m.num_dense_layers)),
                  decoder_sparse_step=1, use_sliding_window=False)
        hf.pop("num_local_experts", None)
    elif family == "deepseek_v3":
        if moe.score_func != "sigmoid":
            layer_shape_error = "DeepSeek-V3 needs sigmoid routing"
        hf.update(num_key_value_heads=m.num_heads, q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank,
                  qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                  first_k_dense_replace=m.num_dense_layers, intermediate_size=m.dense_ffn_size,
                  n_routed_experts=moe.num_experts, moe_intermediate_size=moe.expert_ffn_size,
                  n_shared_experts=moe.num_shared_experts, routed_scaling_factor=moe.route_scale,
                  n_group=moe.num_groups, topk_group=moe.topk_groups, norm_topk_prob=moe.norm_topk_prob)
        hf.setdefault("rope_interleave", True)
        hf.pop("head_dim", None)
        hf.pop("qk_head_dim", None)
    else:
        if not (m.attention_sinks and m.attention_bias and moe.router_bias and moe.expert_proj_bias
                and moe.score_func == "softmax_topk" and moe.activation == "gpt_oss") or m.num_dense_layers:
            layer_shape_error = ("GPT-OSS needs sinks, attention/router/expert biases, softmax_topk routing, the "
                                 "gpt_oss activation and no dense layers")
        from moelab.model_shapes import layer_windows

        hf.update(num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim, num_local_experts=moe.num_experts,
                  intermediate_size=moe.expert_ffn_size, sliding_window=m.sliding_window or 128,
                  layer_types=["sliding_attention" if w else "full_attention" for w in layer_windows(m)],
                  swiglu_limit=7.0, swiglu_alpha=1.702)
    if layer_shape_error:
        raise ConfigError(f"save_hf as {family}: {layer_shape_error}")
    return hf


# ---------------------------------------------------------------------------------------------- weights
def _quantization(hf: dict) -> dict | None:
    """The checkpoint's quantization if moelab can dequantize it: block FP8 (the published DeepSeek-V3 / Kimi-K2
    weights) or MXFP4 experts (the published GPT-OSS weights); None for bf16/fp32."""
    q = hf.get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") == "fp8" and q.get("weight_block_size"):
        return {"method": "fp8", "block": tuple(q["weight_block_size"])}
    if q.get("quant_method") == "mxfp4":
        return {"method": "mxfp4"}
    raise ConfigError(f"config.json quantization_config quant_method={q.get('quant_method')!r}: moelab reads "
                      f"bf16/fp32 checkpoints, block FP8 ('fp8' with weight_block_size) and MXFP4 ('mxfp4'); "
                      f"dequantize the weights first")


# MXFP4 (OCP microscaling): 4-bit e2m1 values, two per byte (low nibble first), one e8m0 scale per 32 values.
_FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantize(blocks_ERGB: torch.Tensor, scales_ERG: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's packed experts -> fp32 [E, C, R]: blocks [E, R, G, B] (uint8, 2B values each) and scales
    [E, R, G] (uint8 exponents biased by 127) hold an [E, R, C=G*2B] matrix that HF stores transposed."""
    lut = torch.tensor(_FP4_E2M1, dtype=torch.float32, device=blocks_ERGB.device)
    b = blocks_ERGB.to(torch.uint8).long()
    vals = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).flatten(-2)  # [E, R, G, 2B]
    vals = torch.ldexp(vals, (scales_ERG.to(torch.int32) - 127)[..., None].float())
    return vals.flatten(-2).transpose(1, 2).contiguous()


class _SafetensorsFolder:
    """Lazy access to the tensors of a checkpoint folder (one file, or shards with an index json); FP8 weights
    with a `<name>_scale_inv` block scale are dequantized to fp32 as they are read."""

    def __init__(self, path: Path, quantization: dict | None = None):
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            from safetensors import safe_open

            weight_map = {}
            for f in sorted(path.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as st:
                    weight_map.update({k: f.name for k in st.keys()})
        if not weight_map:
            raise ConfigError(f"{path}: no *.safetensors files")
        self.path, self.weight_map, self.used, self.quantization = path, weight_map, set(), quantization

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map or (self._method() == "mxfp4" and name + "_blocks" in self.weight_map)

    def _method(self) -> str | None:
        return self.quantization["method"] if self.quantization else None

    def _read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        self.used.add(name)
        with safe_open(str(self.path / self.weight_map[name]), framework="pt") as st:
            return st.get_tensor(name)

    def get(self, name: str) -> torch.Tensor:
        if self._method() == "mxfp4" and name not in self.weight_map and name + "_blocks" in self.weight_map:
            return mxfp4_dequantize(self._read(name + "_blocks"), self._read(name + "_scales"))
        if name not in self.weight_map:
            raise ConfigError(f"{self.path}: checkpoint tensor {name!r} is missing")
        t = self._read(name)
        if self._method() == "fp8" and name + "_scale_inv" in self.weight_map:
            scale = self._read(name + "_scale_inv").float()
            (bo, bi), (rows, cols) = self.quantization["block"], t.shape
            scale = scale.repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]
            return t.float() * scale
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8):
            raise ConfigError(f"{name} is stored as {t.dtype}: quantized checkpoints are not supported; "
                              f"dequantize to bf16 first")
        return t.float()


def _ignorable(name: str, num_layers: int) -> bool:
    """Checkpoint tensors moelab does not model: rotary caches, and DeepSeek's multi-token-prediction layers."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    parts = name.split(".")
    return len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= num_layers


def _renames(family: str, m) -> dict[str, str]:
    """moelab name -> HF name for every tensor copied one to one (m: a ModelConfig)."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not m.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(m.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        names[ours + "attention_norm.weight"] = theirs + "input_layernorm.weight"
        names[ours + "ffn_norm.weight"] = theirs + "post_attention_layernorm.weight"
        a, t = ours + "attention.", theirs + "self_attn."
        if m.attention == "mla":
            pairs = [("q_a_proj", "q_a_proj"), ("q_a_norm", "q_a_layernorm"), ("q_b_proj", "q_b_proj")] \
                if m.q_lora_rank else [("q_proj", "q_proj")]
            pairs += [("kv_a_proj", "kv_a_proj_with_mqa"), ("kv_a_norm", "kv_a_layernorm"), ("kv_b_proj", "kv_b_proj"),
                      ("o_proj", "o_proj")]
            for o, h in pairs:
                names[f"{a}{o}.weight"] = f"{t}{h}.weight"
            if m.attention_bias:
                for o, h in (("q_a_proj", "q_a_proj"), ("kv_a_proj", "kv_a_proj_with_mqa"), ("o_proj", "o_proj")):
                    if o != "q_a_proj" or m.q_lora_rank:
                        names[f"{a}{o}.bias"] = f"{t}{h}.bias"
        else:
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                names[f"{a}{proj}.weight"] = f"{t}{proj}.weight"
                if m.attention_bias:
                    names[f"{a}{proj}.bias"] = f"{t}{proj}.bias"
            if m.qk_norm:
                names[a + "q_norm.weight"], names[a + "k_norm.weight"] = t + "q_norm.weight", t + "k_norm.weight"
            if m.attention_sinks:
                names[a + "sinks"] = t + "sinks"
        f, h = ours + "ffn.", theirs + "mlp."
        if i < m.num_dense_layers:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names[f"{f}{proj}.weight"] = f"{h}{proj}.weight"
            continue
        router = "router" if family == "gpt_oss" else "gate"
        names[f + "router.weight"] = f"{h}{router}.weight"
        if m.moe.router_bias:
            names[f + "router.bias"] = f"{h}{router}.bias"
        if family == "deepseek_v3":
            names[f + "router.expert_bias"] = h + "gate.e_score_correction_bias"
        if m.moe.num_shared_experts:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names[f"{f}shared_experts.{proj}.weight"] = f"{h}shared_experts.{proj}.weight"
    return names


def _rope_perm(family: str, hf: dict, m) -> torch.Tensor | None:
    """DeepSeek's interleaved rotary pairs (x0, x1), (x2, x3), ... -> rotate-half order (x0, x2, ..., x1, x3, ...)."""
    if family != "deepseek_v3" or not hf.get("rope_interleave", True):
        return None
    R = m.qk_rope_head_dim
    return torch.cat([torch.arange(0, R, 2), torch.arange(1, R, 2)])


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


def _to_moelab(family: str, hf: dict, cfg: Config, tensors: _SafetensorsFolder) -> dict[str, torch.Tensor]:
    m = cfg.model
    state = {ours: tensors.get(theirs) for ours, theirs in _renames(family, m).items()}
    if m.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    perm = _rope_perm(family, hf, m)
    if perm is not None:
        for name in list(state):
            rows = _rope_rows(m, name, perm) if name.startswith("layers.") else None
            if rows is not None:
                state[name] = state[name][rows]
    for i in range(m.num_dense_layers, m.num_layers):
        state.update(_experts_to_moelab(family, m, f"model.layers.{i}.mlp.experts.", f"layers.{i}.ffn.experts.",
                                        tensors.get, tensors.__contains__))
    return state


def _experts_to_moelab(family, m, theirs: str, ours: str, get: Callable, has: Callable) -> dict:
    E, F = m.moe.num_experts, m.moe.expert_ffn_size
    out = {}
    if family == "gpt_oss":  # fused, [E, D, 2F] with gate/up interleaved by column
        w = get(theirs + "gate_up_proj")
        out[ours + "w_gate_up_EDF2"] = torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1)
        b = get(theirs + "gate_up_proj_bias")
        out[ours + "b_gate_up_EF2"] = torch.cat([b[..., 0::2], b[..., 1::2]], dim=-1)
        out[ours + "w_down_EFD"] = get(theirs + "down_proj")
        out[ours + "b_down_ED"] = get(theirs + "down_proj_bias")
    elif has(theirs + "gate_up_proj"):  # transformers' fused layout: [E, 2F, D] gate|up and [E, D, F]
        out[ours + "w_gate_up_EDF2"] = get(theirs + "gate_up_proj").transpose(1, 2)
        out[ours + "w_down_EFD"] = get(theirs + "down_proj").transpose(1, 2)
    else:  # one nn.Linear per expert and projection (published checkpoints, save_pretrained)
        gate = [get(f"{theirs}{e}.gate_proj.weight") for e in range(E)]
        up = [get(f"{theirs}{e}.up_proj.weight") for e in range(E)]
        out[ours + "w_gate_up_EDF2"] = torch.cat([torch.stack(gate), torch.stack(up)], dim=1).transpose(1, 2)
        out[ours + "w_down_EFD"] = torch.stack([get(f"{theirs}{e}.down_proj.weight") for e in range(E)]).transpose(1, 2)
    assert out[ours + "w_gate_up_EDF2"].shape[-1] == 2 * F, (ours, out[ours + "w_gate_up_EDF2"].shape)
    return out


def _to_hf(family: str, hf: dict, cfg_model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    m = cfg_model
    renames = _renames(family, m)
    out = {theirs: state[ours] for ours, theirs in renames.items()}
    perm = _rope_perm(family, hf, m)
    if perm is not None:
        inverse = torch.argsort(perm)
        for ours, theirs in renames.items():
            rows = _rope_rows(m, ours, inverse) if ours.startswith("layers.") else None
            if rows is not None:
                out[theirs] = out[theirs][rows]
    for i in range(m.num_dense_layers, m.num_layers):
        ours, theirs = f"layers.{i}.ffn.experts.", f"model.layers.{i}.mlp.experts."
        w1, w2 = state[ours + "w_gate_up_EDF2"], state[ours + "w_down_EFD"]
        if family == "gpt_oss":
            gate, up = w1.chunk(2, dim=-1)
            out[theirs + "gate_up_proj"] = torch.stack([gate, up], dim=-1).flatten(-2)
            bg, bu = state[ours + "b_gate_up_EF2"].chunk(2, dim=-1)
            out[theirs + "gate_up_proj_bias"] = torch.stack([bg, bu], dim=-1).flatten(-2)
            out[theirs + "down_proj"] = w2
            out[theirs + "down_proj_bias"] = state[ours + "b_down_ED"]
            continue
        gate_EFD, up_EFD = w1.transpose(1, 2).chunk(2, dim=1)
        for e in range(m.moe.num_experts):
            out[f"{theirs}{e}.gate_proj.weight"] = gate_EFD[e]
            out[f"{theirs}{e}.up_proj.weight"] = up_EFD[e]
            out[f"{theirs}{e}.down_proj.weight"] = w2[e].t()
    return out
