"""Parallelism, applied to a model that has none: ``parallelize(model, cfg, env, dims) -> Parallelized``.

    par = parallelize(model_on_meta, cfg, DistEnv(), ParallelDims.build(cfg, 1))   # one process

One process: moelab.parallel.place; several: moelab.parallel.distributed (meshes, EP, FSDP2, PP, CP).
"""
from __future__ import annotations

from torch import nn

from moelab.config import Config
from moelab.layout.dims import ParallelDims
from moelab.parallel.env import DistEnv
from moelab.parallel.place import Parallelized, apply_activation_checkpointing, apply_compile, materialize


def parallelize(model: nn.Module, cfg: Config, env: DistEnv, dims: ParallelDims) -> Parallelized:
    """Place `model` (built on the meta device) for this rank, initialise it, and return the Parallelized.
    `dims`: the validated layout (moelab.layout.dims). The model computes its own loss (moelab.backends.loss),
    on a pipeline's last stage too."""
    from moelab.backends import apply_backends

    apply_backends(model, cfg, env.device, env.world_size)  # the switchboard's packages, checked and swapped in
    if env.world_size > 1:
        from moelab.parallel.distributed import parallelize_distributed

        return parallelize_distributed(model, cfg, env, dims)
    materialize(model, cfg, env.device)
    apply_activation_checkpointing(model, cfg)
    apply_compile(model, cfg)
    par = Parallelized(model, cfg, env, dims.layout)
    par.casts_params = cfg.train.param_dtype == "bfloat16"  # bf16 parameters: no autocast needed
    return par
