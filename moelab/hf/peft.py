"""LoRA adapters in PEFT's layout (adapter_config.json + adapter_model.safetensors), loadable with
``peft.PeftModel.from_pretrained`` onto the transformers model that moelab.hf.save_hf writes of the base.

PEFT adapts nn.Linear modules by name: moelab's attention projections (GQA's q/k/v/o, MLA's q_a/q_b/kv_a/kv_b
and o) map one to one onto transformers' modules. Refused, naming them (export those runs merged:
moelab.model.lora.merge_lora_state, then save_hf): routed experts (one stacked tensor per projection in moelab
and in transformers' in-memory layout, no per-expert nn.Linear for PEFT's LoRA to wrap); dense MLP and shared
experts (PEFT 0.18+ maps every gate_proj / up_proj / down_proj target of Qwen3-MoE and DeepSeek-V3 onto the
fused routed experts, so it would put them elsewhere); a trained router (a full weight, not an adapter).

    write_peft_adapters(full_state, cfg, "out/adapters")
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("out/base"), "out/adapters")
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from moelab.config import Config, ConfigError
from moelab.config.lora import resolve_lora_targets
from moelab.hf import ADAPTERS, family_of
from moelab.model.lora import is_adapter

_PEFT_MOE = ("PEFT (0.18 and later, with transformers 5) reads every target named gate_proj, up_proj or down_proj "
             "of a Qwen3-MoE or DeepSeek-V3 model as the routed experts' fused weights, so it would not load these "
             "adapters where they belong")
PEFT_UNSUPPORTED = {"experts": "the routed experts' stacked weights (grouped LoRA) have no nn.Linear per expert "
                               "in transformers for PEFT's LoRA to adapt",
                    "dense_mlp": _PEFT_MOE, "shared_experts": _PEFT_MOE}


def peft_adapter_state(state: dict[str, torch.Tensor], cfg: Config, hf: dict | None = None) -> tuple[dict, list]:
    """(PEFT-named adapter tensors, the transformers module names they adapt) from a full moelab state dict."""
    m = cfg.model
    adapter = ADAPTERS[(hf or {}).get("model_type") or family_of(m)]
    hf = hf or adapter.config_to_hf(m)
    renames = adapter.renames(m)
    tensors, modules = {}, []
    for key in sorted(state):
        if not key.endswith(".lora_A"):
            continue
        ours = key[: -len("lora_A")] + "weight"
        if ours not in renames:
            raise ConfigError(f"PEFT export: {key} adapts {ours}, which has no one-to-one transformers name")
        theirs = renames[ours]
        module = theirs[: -len(".weight")]
        # output rows follow the base weight's row order (DeepSeek's rotary rows are permuted to HF's layout)
        b_OR = adapter.permute_to_hf(hf, m, {theirs: state[key[: -len("lora_A")] + "lora_B"]})[theirs]
        tensors[f"base_model.model.{module}.lora_A.weight"] = state[key]
        tensors[f"base_model.model.{module}.lora_B.weight"] = b_OR
        modules.append(module)
    return tensors, modules


def write_peft_adapters(state: dict[str, torch.Tensor], cfg: Config, out: "str | Path",
                        base_model_name_or_path: str | None = None, hf: dict | None = None) -> Path:
    """Write the adapters of `state` (a full, unsharded moelab state dict of a train.lora run: adapters beside
    base weights, or adapters alone) in PEFT's layout under `out`. `hf`: the base's config.json dict, when the
    run started from one (for its family and rotary layout). Refused (ConfigError) for targets PEFT cannot
    hold, naming them.

        write_peft_adapters(merge_ready_state, cfg, "out/adapters", base_model_name_or_path="out/base")
    """
    from safetensors.torch import save_file

    lo = cfg.train.lora
    if not lo.rank:
        raise ConfigError("train.lora.rank=0: this run has no LoRA adapters to write; export its full weights")
    targets = resolve_lora_targets(cfg.model, lo.targets)
    refused = [t for t in targets if t in PEFT_UNSUPPORTED]
    if refused:
        raise ConfigError(f"train.lora.targets={lo.targets!r}: PEFT's layout cannot hold adapters on "
                          f"{', '.join(refused)} ({'; '.join(PEFT_UNSUPPORTED[t] for t in refused)}); export this "
                          f"run with the adapters merged (--lora merged)")
    if lo.train_router:
        raise ConfigError("train.lora.train_router=true: the trained router is a full weight, not an adapter, and "
                          "the PEFT adapters alone would lose it; export this run with the adapters merged "
                          "(--lora merged)")
    if not any(is_adapter(k) for k in state):
        raise ConfigError("write_peft_adapters: the state dict holds no LoRA adapters (lora_A / lora_B keys)")
    tensors, modules = peft_adapter_state(state, cfg, hf)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lo.rank, "lora_alpha": lo.alpha,
              "lora_dropout": lo.dropout, "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
              "base_model_name_or_path": base_model_name_or_path}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out
