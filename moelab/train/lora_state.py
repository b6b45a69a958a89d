"""The whole model state of a LoRA checkpoint: its checkpoints hold only what trains (moelab.train.checkpoint),
so the frozen base is re-created from the pointer in metadata.json (the random-init seed, or the Hugging Face
checkpoint of train.init_from) and the adapters are loaded beside it. One process, CPU, any layout's checkpoint.

    state = lora_model_state("runs/ft/checkpoints/step_000100", cfg)    # base weights + adapters, moelab names
    merged = merge_lora_state(state, cfg)                                # then moelab.hf.save_hf, or PEFT's layout
"""
from __future__ import annotations

from pathlib import Path

import torch

from moelab.config import Config, ConfigError
from moelab.model.assemble import assemble
from moelab.model.lora import is_adapter
from moelab.model.transformer import MoETransformer
from moelab.contract.checkpoints import read_metadata


def lora_model_state(path: "str | Path", cfg: Config) -> dict[str, torch.Tensor]:
    """Every tensor of the LoRA model saved in checkpoint folder `path` (full, unsharded, CPU, fp32 as trained):
    the base its metadata points to, the adapters (and a trained router, the routers' buffers) from the
    checkpoint. ConfigError for a checkpoint of a run without train.lora."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    path = Path(path)
    base = read_metadata(path).get("base")
    if not cfg.train.lora.rank or base is None:
        raise ConfigError(f"{path}: not a LoRA checkpoint (train.lora.rank=0, or no 'base' in metadata.json); its "
                          f"model state is complete as saved")
    options = StateDictOptions(ignore_frozen_params=True, strict=False)

    def load(model: MoETransformer) -> None:  # the base from its checkpoint, then what trained from this one
        if base.get("init_from"):
            load_base(model, base["init_from"])
        trained = get_model_state_dict(model, options=options)
        dcp.load({"model": trained}, checkpoint_id=path, no_dist=True)
        set_model_state_dict(model, trained, options=options)

    # the seed base, and the adapters' initial values, as the run's setup drew them
    model = assemble(cfg.replace(**{"train.seed": base.get("seed", cfg.train.seed)}), "lora", load=load)
    return {k: v.detach() for k, v in model.state_dict().items()}


def load_base(model: MoETransformer, init_from: str) -> None:
    """Copy the base weights of `init_from` ("hf:PATH") into the frozen (non-adapter) tensors of `model`."""
    if not init_from.startswith("hf:"):
        raise ConfigError(f"train.init_from={init_from!r}: a LoRA base is read from 'hf:PATH' checkpoints")
    from moelab.hf import load_hf

    source = load_hf(init_from[3:]).state_dict()
    missing, unexpected = model.load_state_dict(source, strict=False)
    missing = [k for k in missing if not is_adapter(k)]
    if missing or unexpected:
        raise ConfigError(f"train.init_from={init_from!r}: its weights do not match this model (missing "
                          f"{missing[:3]}, unexpected {unexpected[:3]})")
