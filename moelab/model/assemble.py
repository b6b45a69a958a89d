"""The model's life, in one place: ``assemble(cfg, purpose, device, place=None, load=None)``.

Every model moelab makes (the trainer's, a checkpoint reader's, load_hf's, build_model's) is built here, by the
same ordered transforms; which of them run depends on what the model is for (``PURPOSES``):

    meta build -> FP8 -> LoRA -> [place: backends -> parallelize -> materialise -> init] -> load -> tie
                                 [or, on one process: materialise -> init]

The order is the point: FP8 and LoRA change the modules, so they come before parallelism (FSDP2, EP and
compile see the FP8 modules; FSDP2 and EP shard the adapters like their base weights); nothing is allocated
until the model is placed (a rank allocates only what it owns); the weights are drawn after placement
(moelab.model's seeded init gives every layout the single-process values) and a checkpoint fills them after
that; `to_empty` and a load by assignment give the embedding and the head separate tensors, so tying comes last.

    model = assemble(cfg, "random")                                     # every weight drawn from cfg.train.seed
    model = assemble(cfg, "load", load=lambda m: m.load_state_dict(sd))  # weights from a state dict
    par = assemble(cfg, "train", env.device, place=lambda m: parallelize(m, cfg, env, dims))
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from moelab.config import Config, ConfigError
from moelab.model.lora import apply_lora, is_adapter
from moelab.model.transformer import MoETransformer

# purpose -> what it is for. The transforms each purpose runs are decided in `assemble`, nowhere else.
PURPOSES = {
    "train": "the run's model: FP8 and LoRA as cfg.train says, placed by `place` (moelab.parallel), the base "
             "weights drawn from cfg.train.seed unless train.init_from fills them (through `load`)",
    "lora": "a LoRA run's model on one process, as its setup made it (checkpoint readers): adapters added, "
            "weights drawn from cfg.train.seed unless train.init_from fills them, then `load`",
    "random": "the plain model, every weight drawn from cfg.train.seed",
    "load": "the plain model, every weight from `load` (routing buffers start fresh unless it fills them)",
    "shapes": "the plain model on the meta device, nothing allocated (names and shapes only)",
}


def assemble(cfg: Config, purpose: str, device: "str | torch.device" = "cpu",
             place: Callable | None = None, load: Callable[[nn.Module], object] | None = None):
    """The model of `cfg` for `purpose` (one of PURPOSES) on `device`; `load(model)` fills its weights after
    they are allocated. Purpose "train" needs `place(model_on_meta)` (moelab.parallel.parallelize: swaps in the
    backends, places, materialises and draws the weights for this rank's layout) and returns what `place`
    returns, its `.model` loaded; every other purpose returns the MoETransformer.

        model = assemble(load_config("tiny"), "random")
        logits_BLV = model(tokens_BL)
    """
    if purpose not in PURPOSES:
        raise ValueError(f"assemble: purpose={purpose!r}; choose one of {', '.join(PURPOSES)}")
    if (purpose == "train") != (place is not None):
        raise ValueError(f"assemble: purpose={purpose!r} {'needs' if purpose == 'train' else 'takes no'} `place`")
    with torch.device("meta"):
        model = MoETransformer(cfg.model, cfg.backend)
    if purpose == "shapes":
        return model
    if purpose == "train" and cfg.train.fp8 != "off":  # FP8 modules first: FSDP2, EP and compile see them
        from moelab.model.fp8_convert import check_fp8, enable_fp8

        check_fp8(cfg, device)
        enable_fp8(model, lm_head=cfg.train.fp8 == "rowwise_lm_head")
    if purpose in ("train", "lora"):
        if not cfg.train.lora.rank and purpose == "lora":
            raise ConfigError("train.lora.rank=0: a 'lora' model needs train.lora.rank >= 1")
        if cfg.train.lora.rank:  # adapters before placement: FSDP2 and EP shard them like their base weights
            apply_lora(model, cfg)
    if place is not None:
        placed = place(model)  # backends, parallelism, materialise, init: the layout's order (moelab.parallel)
        if load is not None:
            load(placed.model)
        return placed
    materialize(model, cfg, device, draw={"lora": "run", "random": "all", "load": "none"}[purpose])
    if load is not None:
        load(model)
    model.tie_weights()  # a load by assignment (load_state_dict(assign=True)) unties them
    return model


def cast_params(model: nn.Module, cfg: Config) -> None:
    """bf16 parameters (train.param_dtype) cast on the meta device, before FSDP2 wraps them: the device never
    holds an fp32 copy of the model. Router and norm buffers stay fp32."""
    if cfg.train.param_dtype == "bfloat16":
        for p in model.parameters():
            if p.dtype != torch.bfloat16:
                p.data = p.data.to(torch.bfloat16)


def materialize(model: nn.Module, cfg: Config, device, draw: str = "run", write=None) -> None:
    """Allocate a meta-device model on `device` and give it its initial values. Its parameters may already be
    FSDP2 shards (moelab.parallel wraps on the meta device and passes a `write` that fills a shard's rows): each
    rank then allocates and fills only its rows, never the whole tensor.

    draw: "run" as a run's setup draws them (train.param_dtype, and with train.init_from only LoRA's adapters:
    the checkpoint fills the rest); "all" every weight in fp32; "none" no weight (a load fills them all), the
    routing buffers reset."""
    if draw == "run":
        cast_params(model, cfg)  # init_weights draws in fp32 and rounds into bf16: the values of an fp32 init, cast
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gave the embedding and the head separate tensors
    if draw == "none":
        for moe in model.moe_layers():
            moe.router.reset_buffers()
        return
    # A start from a checkpoint (train.init_from) fills every base weight after placement: only what the
    # checkpoint lacks, LoRA's adapters, is drawn here (a random init of billions of weights takes minutes).
    select = is_adapter if draw == "run" and cfg.train.init_from else None
    model.init_weights(cfg.train.seed, select=select, write=write)
