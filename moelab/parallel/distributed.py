"""Many ranks: the device meshes, expert parallelism and FSDP2 applied to a model built on the meta device.

    par = parallelize_distributed(model_on_meta, cfg, env, layout)   # called by moelab.parallel.parallelize

Order (torchtitan's): (1) keep only this rank's experts and install the EP dispatcher, (2) materialise and
initialise what is left (moelab.model seeds every parameter by name, and stacked experts per expert, so the
weights equal the single-process ones), (3) activation checkpointing, (4) FSDP2: experts over the expert-FSDP
mesh, then every block and the root over the dense (dp*cp) mesh. On a GPU with train.dtype=bfloat16 FSDP2 keeps
fp32 master weights and computes in bf16 (MixedPrecisionPolicy, fp32 gradient reduction).

The weights of the trainer's statistics sum (``DistributedParallelized``) follow from who holds what: every rank
of a pipeline stage routes its own tokens (so routing counts add up to global counts), the loss lives on the last
stage, and no gradient is replicated (tp = 1), so squared gradient norms add up over all ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from moelab.config import Config, ConfigError, ParallelConfig
from moelab.launch.env import DistEnv
from moelab.parallel import Parallelized, apply_activation_checkpointing, materialize
from moelab.parallel.expert_parallel import AllToAllDispatcher, shard_experts
from moelab.parallel.mesh import Meshes, build_meshes


class DistributedParallelized(Parallelized):
    """The trainer's view of a multi-rank layout (see moelab.parallel.Parallelized)."""

    def __init__(self, model: nn.Module, cfg: Config, env: DistEnv, layout: ParallelConfig, meshes: Meshes):
        super().__init__(model, cfg, env, layout)
        self.meshes = meshes
        self.dp_rank, self.dp_size = meshes.coords.dp, layout.fsdp
        self.casts_params = mixed_precision(cfg) is not None

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """The global gradient norm (and clipping by it), equal to one process's clip_grad_norm_.

        Dense and expert gradients are DTensors on different meshes, so torch's clip_grad_norm_ cannot combine
        them; instead each rank adds the squares of its local shards and one all-reduce over the world sums
        them (every gradient element lives on exactly one rank)."""
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                 for p in model.parameters() if p.grad is not None]
        norms = torch._foreach_norm(local) if local else []
        sq = torch.stack([n.float() for n in norms]).square().sum() if norms else torch.zeros((), device=self.env.device)
        dist.all_reduce(sq)
        total = sq.sqrt()
        if max_norm > 0 and local:
            coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # the same formula as clip_grad_norm_
            torch._foreach_mul_(local, coef.to(local[0].dtype))
        return total

    def loss_contribution(self, loss_sum: torch.Tensor) -> torch.Tensor:
        return loss_sum.reshape(1)

    def grad_norm_weight(self) -> float:
        return 1.0 / self.env.world_size  # every rank holds the same global norm

    def stat_weight(self) -> float:
        return 1.0 / (self.layout.fsdp * self.layout.cp)  # mean over the ranks of a stage

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x


def mixed_precision(cfg: Config) -> MixedPrecisionPolicy | None:
    """bf16 compute with fp32 master weights and fp32 gradient reduction, when train.dtype=bfloat16."""
    if cfg.train.dtype != "bfloat16":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def build_dispatcher(kind: str, group):
    """The EP token dispatcher named by backend.dispatcher (the switchboard has checked its package)."""
    if kind == "all_to_all":
        return AllToAllDispatcher(group)
    if kind == "deepep":
        try:
            from moelab.backends.deepep import DeepEPDispatcher
        except ImportError as e:
            raise ConfigError(f"backend.dispatcher='deepep': moelab.backends.deepep is not available ({e}); "
                              f"set backend.dispatcher=all_to_all") from e
        return DeepEPDispatcher(group)
    raise ConfigError(f"backend.dispatcher={kind!r}: choose all_to_all or deepep")


def apply_expert_parallel(model: nn.Module, cfg: Config, meshes: Meshes) -> None:
    """Keep this rank's num_experts/ep experts of every MoE layer and route tokens to the others' by all-to-all."""
    ep = meshes.layout.ep
    if ep == 1:
        return
    kind = getattr(model, "backends", {}).get("dispatcher", cfg.backend.dispatcher)
    for moe in model.moe_layers():
        shard_experts(moe.experts, meshes.coords.ep, ep)
        moe.dispatcher = build_dispatcher(kind, meshes.ep_group)


def apply_fsdp(model: nn.Module, cfg: Config, meshes: Meshes) -> None:
    """FSDP2: experts over the expert-FSDP mesh (when EP splits them), each block and the root over dp*cp."""
    mp = mixed_precision(cfg) or MixedPrecisionPolicy()
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        if meshes.layout.ep > 1 and getattr(inner, "is_moe", False):
            fully_shard(inner.ffn.experts, mesh=meshes.efsdp, mp_policy=mp)
        # the last block's parameters are needed again at once by backward: keep them gathered
        fully_shard(block, mesh=meshes.dense, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=meshes.dense, mp_policy=mp)


def parallelize_distributed(model: nn.Module, cfg: Config, env: DistEnv, layout: ParallelConfig) -> Parallelized:
    meshes = build_meshes(layout, env.world_size, env.rank, "cuda" if env.is_cuda else "cpu")
    apply_expert_parallel(model, cfg, meshes)
    materialize(model, cfg, env.device)
    apply_activation_checkpointing(model, cfg)
    apply_fsdp(model, cfg, meshes)
    return DistributedParallelized(model, cfg, env, layout, meshes)


@torch.no_grad()
def full_state_dict(par: DistributedParallelized) -> dict[str, torch.Tensor]:
    """Every parameter as a full (unsharded, all experts) CPU tensor, on every rank (collective; for tests and
    small exports: it holds the whole model in host memory)."""
    ep_group = par.meshes.ep_group
    out = {}
    for name, p in par.model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        name = name.replace("_checkpoint_wrapped_module.", "")
        if ep_group is not None and ".experts." in name:
            parts = [torch.empty_like(t) for _ in range(par.layout.ep)]
            dist.all_gather(parts, t.contiguous(), group=ep_group)
            t = torch.cat(parts)
        out[name] = t.float().cpu()
    return out
