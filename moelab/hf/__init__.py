"""Hugging Face checkpoints in and out: Qwen3-MoE, DeepSeek-V3 (and Kimi-K2) and GPT-OSS layouts.

    model = load_hf("path/to/Qwen3-30B-A3B")            # a local folder: config.json + *.safetensors
    logits_BLV = model(input_ids_BL)
    save_hf(model, "out/")                               # loadable by transformers' from_pretrained

One adapter per family (moelab.hf.qwen3_moe, .deepseek_v3, .gpt_oss; the shared parts in moelab.hf.adapter) maps
config.json fields and tensor names both ways: `config_from_hf` / `config_to_hf`, `state_dict_from_hf` /
`state_dict_to_hf`. Weights are renamed one to one, except:
- experts: HF stores one gate/up/down matrix per expert (the published checkpoints, and what transformers 5
  `save_pretrained` writes for Qwen3-MoE and DeepSeek-V3) or fused tensors (transformers' in-memory layout,
  [E, 2F, D] gate|up; GPT-OSS: [E, D, 2F] with gate and up interleaved column by column); moelab stacks them
  into w_gate_up_EDF2 = [gate | up] and w_down_EFD.
- DeepSeek's interleaved rotary pairs are permuted into the rotate-half layout (moelab.hf.deepseek_v3).
- block-FP8 checkpoints (the published DeepSeek-V3 and Kimi-K2 weights: `weight_scale_inv` per 128x128 block) are
  dequantized to fp32 as they are read; save_hf writes unquantized weights.
- MXFP4 experts (the published GPT-OSS weights: `*_blocks` + `*_scales`) are dequantized likewise.
Every config field that changes the math is mapped or refused with a ConfigError (docs/architectures-and-hf.md lists the refusals).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from moelab.config import ConfigError, flatten, load_config
from moelab.hf.adapter import FamilyAdapter
from moelab.hf.deepseek_v3 import DeepseekV3Adapter
from moelab.hf.gpt_oss import GptOssAdapter
from moelab.hf.qwen3_moe import Qwen3MoeAdapter
from moelab.hf.safetensors_folder import SafetensorsFolder, ignorable, mxfp4_dequantize, quantization
from moelab.hf.shards import parse_size, write_safetensors
from moelab.model.assemble import assemble
from moelab.model.transformer import MoETransformer

ADAPTERS: dict[str, FamilyAdapter] = {a.model_type: a for a in (Qwen3MoeAdapter(), DeepseekV3Adapter(),
                                                                 GptOssAdapter())}
FAMILIES = tuple(ADAPTERS)
__all__ = ["load_hf", "save_hf", "config_from_hf", "config_to_hf", "adapter_for", "family_of", "FAMILIES",
           "ADAPTERS", "mxfp4_dequantize"]


def adapter_for(hf: dict) -> FamilyAdapter:
    """The adapter of an HF config.json dict (Kimi-K2's model_type kimi_k2 is DeepSeek-V3's layout)."""
    kind = hf.get("model_type", "")
    kind = "deepseek_v3" if kind == "kimi_k2" else kind
    if kind not in ADAPTERS:
        raise ConfigError(f"config.json model_type={hf.get('model_type', '')!r}: moelab reads "
                          f"{', '.join(FAMILIES)} (and kimi_k2)")
    return ADAPTERS[kind]


def family_of(m) -> str:
    """The HF layout that can express a moelab ModelConfig."""
    if m.attention == "mla":
        return "deepseek_v3"
    if m.attention_sinks or m.moe.activation == "gpt_oss":
        return "gpt_oss"
    return "qwen3_moe"


def config_from_hf(hf: dict) -> dict:
    """A moelab config dict (for `load_config`) from an HF config.json dict."""
    adapter = adapter_for(hf)
    quantization(hf)  # raises for quantizations moelab cannot read
    return adapter.config_from_hf(hf)


def config_to_hf(m, family: str | None = None, base: dict | None = None) -> dict:
    """An HF config.json dict for a moelab ModelConfig (family: its family_of unless given); keys of `base` (a
    loaded config.json) are kept."""
    return ADAPTERS[family or family_of(m)].config_to_hf(m, base)


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
    adapter = adapter_for(hf)
    cfg = load_config(config_from_hf(hf), flatten(overrides))
    tensors = SafetensorsFolder(path, quantization(hf))

    def load(model: MoETransformer) -> None:
        state = adapter.state_dict_from_hf(hf, cfg.model, tensors)
        params = dict(model.named_parameters(remove_duplicate=False))
        for name, t in model.state_dict().items():  # routing buffers start fresh unless the checkpoint has them
            if name not in params:
                state.setdefault(name, t)
        missing = sorted(set(model.state_dict()) - set(state))
        if missing:
            raise ConfigError(f"{path}: the checkpoint lacks {len(missing)} tensors moelab needs, e.g. {missing[:3]}")
        unused = [k for k in tensors.names()
                  if k not in tensors.used and not ignorable(k, cfg.model.num_layers, tensors)]
        if unused:
            raise ConfigError(f"{path}: {len(unused)} checkpoint tensors have no place in the moelab model, e.g. "
                              f"{unused[:3]}; is config.json the one of these weights?")
        model.load_state_dict(state, strict=True)

    model = assemble(cfg, "load", device, load=load)
    if dtype is not None:
        for p in model.parameters():
            p.data = p.data.to(dtype)
    model.moelab_config, model.hf_config = cfg, hf
    return model.eval()  # like transformers' from_pretrained; call .train() to fine-tune


def save_hf(model: MoETransformer, path: "str | Path", dtype: torch.dtype | None = None,
            max_shard_size: "int | str" = "5GB") -> Path:
    """Write `model` as an HF checkpoint folder (config.json + model.safetensors) that transformers loads.
    Tied embeddings are written once (tie_word_embeddings=true), as transformers writes them. Past
    `max_shard_size` ("5GB" as transformers' default, "500MB", "2GiB" or bytes) the weights go to shards with a
    model.safetensors.index.json (moelab.hf.shards).

        save_hf(load_hf("in/"), "out/")
        AutoModelForCausalLM.from_pretrained("out/")
    """
    path = Path(path)
    parse_size(max_shard_size)  # bad input refused before anything is written
    cfg = model.cfg
    base = getattr(model, "hf_config", None) or {}
    adapter = adapter_for(base) if base else ADAPTERS[family_of(cfg)]
    hf = adapter.config_to_hf(cfg, base)
    family = adapter.model_type
    if family != "deepseek_v3" and any(moe.router.expert_bias.any() for moe in model.moe_layers()):
        raise ConfigError(f"save_hf as {family}: the routers' expert_bias (aux-loss-free balancing) is nonzero and "
                          f"that format has no place for it; only the DeepSeek-V3 layout keeps it")
    if cfg.tie_embeddings and model.output.weight is not model.tok_embeddings.weight:
        raise ConfigError("save_hf: model.tie_embeddings=true but the head and the embedding are separate "
                          "tensors (call model.tie_weights() after to_empty)")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    out = adapter.state_dict_to_hf(hf, cfg, state)
    if dtype is not None:
        out = {k: (v.to(dtype) if v.is_floating_point() and not k.endswith("e_score_correction_bias") else v)
               for k, v in out.items()}
    hf["dtype"] = str(next(iter(model.parameters())).dtype if dtype is None else dtype).removeprefix("torch.")
    path.mkdir(parents=True, exist_ok=True)
    write_safetensors(out, path, max_shard_size)
    (path / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    return path
