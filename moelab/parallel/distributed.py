"""Many ranks: device meshes, expert, context and pipeline parallelism and FSDP2, applied to a model built on the
meta device.

    par = parallelize_distributed(model_on_meta, cfg, env, dims)   # called by moelab.parallel.apply.parallelize

Order per pipeline stage (the whole model when pp = 1; torchtitan's order): (0) tensor parallelism on the meta
device (moelab.parallel.tensor), (1) keep only this rank's experts and
install the EP dispatcher, (2) materialise and initialise what is left (moelab.model seeds every parameter by
name, and stacked experts per expert, so the weights equal the single-process ones), (3) context parallelism
(moelab.parallel.context), (4) activation checkpointing, (5) FSDP2 (moelab.parallel.fsdp): experts over the
expert-FSDP mesh, then every block and the root over the dense (dp*cp) mesh, one-rank meshes left plain. With
train.dtype=bfloat16 FSDP2 keeps fp32 master weights and computes in bf16 (MixedPrecisionPolicy; gradients
reduced in parallel.reduce_dtype). Pipeline stages: moelab.parallel.pipeline.

The weights of the trainer's statistics sum (``DistributedParallelized``) follow from who holds what: every rank
of a pipeline stage routes its own tokens (so routing counts add up to global counts), the loss lives on the last
stage (CP ranks each hold an equal share of it, TP ranks the same value), and a gradient replicated over TP (the
norms' weights) counts once in the squared gradient norm summed over all ranks.
"""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moelab.backends.grad_norm import scale_grads, squared_norms
from moelab.config import Config, ConfigError, ParallelConfig
from moelab.parallel.env import DistEnv
from moelab.model.assemble import cast_params
from moelab.parallel.place import Parallelized, apply_activation_checkpointing, apply_compile, materialize
from moelab.parallel.context import ContextParallel
from moelab.parallel.expert_parallel import (AllToAllDispatcher, OverlappedAllToAllDispatcher,
                                             scale_expert_gradients, shard_experts)
from moelab.parallel.fsdp import apply_fsdp, set_micro_batch
from moelab.layout.dims import ParallelDims, grad_sync, hierarchical_dispatch, resolve_ranks_per_node
from moelab.parallel.mesh import Meshes, build_meshes
from moelab.parallel.replicate import REPLICAS


class DistributedParallelized(Parallelized):
    """The trainer's view of a multi-rank layout (see moelab.parallel.Parallelized).

        par = parallelize(model_on_meta, cfg, env, ParallelDims.build(cfg, env.world_size))
    """

    def __init__(self, model: nn.Module, cfg: Config, env: DistEnv, layout: ParallelConfig, meshes: Meshes,
                 cp: ContextParallel | None = None):
        super().__init__(model, cfg, env, layout)
        self.meshes, self.cp = meshes, cp
        self.dp_rank, self.dp_size = meshes.coords.dp, layout.fsdp
        # bf16 compute without autocast: FSDP2's mixed precision, or weights stored in bf16
        self.casts_params = cfg.train.dtype == "bfloat16" and layout.data_parallel == "fsdp"
        self.grad_exchange = None  # replicated experts' gradient exchange (moelab.parallel.replicate)
        self.grad_sync = grad_sync(layout)  # FSDP2's reduce-scatter: every micro batch, or the step's last

    def start_micro_batch(self, index: int, count: int) -> None:
        """Gradients are reduced over ranks in the step's last micro batch only by DDP (no_sync before) and by the
        replicated experts' exchange, and by FSDP2 under parallel.fsdp_grad_sync=step (moelab.parallel.fsdp);
        FSDP2 reduce-scatters in every micro batch under micro_batch (nothing to set). Pipeline schedules run
        their micro batches themselves (moelab.parallel.pipeline)."""
        last = index == count - 1
        if self.layout.data_parallel == "ddp":
            self.model.set_requires_gradient_sync(last)
        if self.grad_exchange is not None:
            self.grad_exchange.armed = last
        if self.grad_sync == "step" and count > 1:
            set_micro_batch(self.model, last)

    def shard_sequence(self, tokens_BL: torch.Tensor) -> torch.Tensor:
        return self.cp.shard(tokens_BL) if self.cp is not None else tokens_BL

    def positions(self, seq_len: int, device) -> torch.Tensor | None:
        return self.cp.positions(seq_len, device) if self.cp is not None else None

    @property
    def moe_layers_all(self) -> list:
        """One entry per MoE layer of the whole model; None where another pipeline stage holds it."""
        held = {int(key): block.ffn for key, block in self.model.layers.items() if block.is_moe}
        return [held.get(i) for i in range(self.cfg.model.num_dense_layers, self.cfg.model.num_layers)]

    def clip_grad_norm(self, model: nn.Module, max_norm: float, multiply_later=None) -> torch.Tensor:
        """The global gradient norm (and clipping by it), equal to one process's clip_grad_norm_;
        `multiply_later` as moelab.parallel.place's (the factor handed over, the local shards left as they are).

        Dense and expert gradients are DTensors on different meshes, so torch's clip_grad_norm_ cannot combine
        them; instead each rank adds the squares of its local shards and one all-reduce over the world sums
        them (every gradient element lives on exactly one rank)."""
        params = [p for p in model.parameters() if p.grad is not None]
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        sq = torch.zeros((), device=self.env.device)
        if local:  # a replicated gradient (DDP, replicated experts, TP's norms) counts once: 1/replicas each
            share = torch.tensor([1.0 / (getattr(p, REPLICAS, 1) * _replicas(p)) for p in params],
                                 device=self.env.device)
            sq = (squared_norms(local) * share).sum()  # moelab.backends.grad_norm: Triton on large CUDA shards
        dist.all_reduce(sq)
        total = sq.sqrt()
        if max_norm > 0 and local:
            coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # the same formula as clip_grad_norm_
            if multiply_later is not None:
                multiply_later(coef.to(local[0].dtype))
            else:
                scale_grads(local, coef)
        return total

    def finish_gradients(self) -> None:
        if self.grad_exchange is not None:
            self.grad_exchange.reduce()

    def rank_state(self) -> dict:
        ex = self.grad_exchange
        return {"expert_grad_residuals": ex.state_dict()} if ex is not None and ex.mode == "sign" else {}

    def load_rank_state(self, state: dict) -> None:
        if self.grad_exchange is not None and "expert_grad_residuals" in state:
            self.grad_exchange.load_state_dict(state["expert_grad_residuals"])

    def loss_contribution(self, loss_sum: torch.Tensor) -> torch.Tensor:
        # CP ranks hold equal shares of the same sequences; TP ranks the same loss (computed on sharded logits)
        return loss_sum.reshape(1) / (self.layout.cp * self.layout.tp)

    def grad_norm_weight(self) -> float:
        return 1.0 / self.env.world_size  # every rank holds the same global norm

    def stat_weight(self) -> float:
        return 1.0 / (self.layout.fsdp * self.layout.cp * self.layout.tp)  # mean over the ranks of a stage

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x


def _replicas(p: torch.Tensor) -> int:
    """How many ranks hold the same local values of DTensor `p` (its Replicate mesh dimensions: TP's norm
    weights); 1 for a plain tensor."""
    if not isinstance(p, DTensor):
        return 1
    mesh = p.device_mesh
    return math.prod(mesh.size(i) for i, pl in enumerate(p.placements) if pl.is_replicate())


def build_dispatcher(kind: str, group, hidden: int, overlap: bool = False):
    """The EP token dispatcher named by backend.dispatcher (the switchboard has checked its package);
    `overlap` (parallel.ep_overlap) splits the all-to-all's exchanges to overlap them with the experts."""
    if kind == "all_to_all":
        return OverlappedAllToAllDispatcher(group) if overlap else AllToAllDispatcher(group)
    if kind == "deepep":
        try:
            from moelab.parallel.deepep import DeepEPDispatcher
        except ImportError as e:
            raise ConfigError(f"backend.dispatcher='deepep': moelab.parallel.deepep is not available ({e}); "
                              f"set backend.dispatcher=all_to_all") from e
        return DeepEPDispatcher(group, hidden=hidden)
    raise ConfigError(f"backend.dispatcher={kind!r}: choose all_to_all or deepep")


def apply_expert_parallel(model: nn.Module, cfg: Config, meshes: Meshes) -> None:
    """Keep this rank's num_experts/ep experts of every MoE layer and route tokens to the others' by all-to-all."""
    ep = meshes.layout.ep
    if ep == 1:
        return
    kind = getattr(model, "backends", {}).get("dispatcher", cfg.backend.dispatcher)
    # One dispatcher for every layer: it keeps no state between calls, and DeepEP's communication buffer
    # (about a gigabyte) is needed once per process, not once per layer.
    dispatcher = build_dispatcher(kind, meshes.ep_group, cfg.model.hidden_size, cfg.parallel.ep_overlap)
    ranks_per_node = resolve_ranks_per_node(meshes.layout, dist.get_world_size(), os.environ)
    if hierarchical_dispatch(meshes.layout, ranks_per_node):  # parallel.ep_dispatch (moelab.parallel.ep_hierarchical)
        from moelab.parallel.ep_hierarchical import HierarchicalDispatcher, NodeGroups

        nodes = NodeGroups.build(meshes.ep_group, ranks_per_node)
        dispatcher = HierarchicalDispatcher(meshes.ep_group, nodes, cfg.parallel.ep_overlap)
    for moe in model.moe_layers():
        shard_experts(moe.experts, meshes.coords.ep, ep)
        scale_expert_gradients(moe.experts, ep)
        moe.dispatcher = dispatcher


def parallelize_distributed(model: nn.Module, cfg: Config, env: DistEnv, dims: ParallelDims) -> Parallelized:
    layout = dims.layout
    meshes = build_meshes(dims, env.rank, "cuda" if env.is_cuda else "cpu")
    if layout.pp > 1:
        return parallelize_pipeline(model, cfg, env, dims, meshes)
    cp = ContextParallel(meshes.cp_group) if layout.cp > 1 else None
    exchange = place_stage(model, cfg, env, meshes, cp)
    par = DistributedParallelized(model, cfg, env, layout, meshes, cp)
    if exchange is not None:
        par.grad_exchange, par.comm_counters = exchange, [exchange]
    return par


def place_stage(model: nn.Module, cfg: Config, env: DistEnv, meshes: Meshes, cp: ContextParallel | None = None):
    """EP, CP, activation checkpointing, FSDP2 and materialisation with the single-process weights, in order.
    FSDP2 wraps the meta-device model, so each rank allocates only its shards (torchtitan's order); DDP and
    replicated experts need their weights before wrapping, so those layouts materialise first. Tensor
    parallelism comes first, on the meta device (moelab.parallel.tensor; with FSDP2 for the dense weights, the
    experts FSDP2-sharded or replicated). Returns the replicated experts' gradient exchange, or None."""
    if meshes.tp is not None:
        from moelab.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, cfg, meshes)
    apply_expert_parallel(model, cfg, meshes)
    replicated = (cfg.parallel.data_parallel, cfg.parallel.expert_dp) != ("fsdp", "fsdp")
    if replicated:
        materialize(model, cfg, env.device)
    else:
        cast_params(model, cfg)  # FSDP2 shards the parameters in their final dtype
    if cp is not None:
        cp.apply(model, cfg.train.seq_len)
    apply_activation_checkpointing(model, cfg)
    apply_compile(model, cfg)  # per block, inside FSDP's wrapping, as on one process
    exchange = None
    if replicated:
        from moelab.parallel.replicate import apply_data_parallel

        exchange = apply_data_parallel(model, cfg, meshes, env.device, apply_fsdp)  # DDP and/or replicated experts
    else:
        apply_fsdp(model, cfg, meshes)
        materialize(model, cfg, env.device)
    if meshes.tp is not None:
        from moelab.parallel.tensor import place_tp_gradients, set_token_means

        place_tp_gradients(model, meshes.tp)
        set_token_means(model, meshes.tokens)  # after CP's (cp.apply above)
    return exchange


def parallelize_pipeline(model: nn.Module, cfg: Config, env: DistEnv, dims: ParallelDims,
                         meshes: Meshes) -> Parallelized:
    """Cut the model into pp * vp stages; place this rank's stages (r, r + pp, ...) like a whole model."""
    from moelab.planner.stages import stage_layers
    from moelab.parallel.pipeline import PipelineModel, PipelineRunner, build_stage_modules

    layout, num_stages = dims.layout, dims.num_stages
    stage_ids = [meshes.coords.pp + k * layout.pp for k in range(layout.vp)]
    stages = build_stage_modules(model, stage_layers(cfg.model, num_stages), stage_ids)
    for stage in stages:
        place_stage(stage, cfg, env, meshes)
        if meshes.tp is not None:  # activations cross stages as this rank's plain sequence shard
            from moelab.parallel.tensor import sequence_shard_boundaries

            sequence_shard_boundaries(stage, meshes.tp)
    t = cfg.train
    n_micro = dims.n_microbatches
    par = DistributedParallelized(PipelineModel(stages, cfg.model.num_layers), cfg, env, layout, meshes)
    par.pipeline = PipelineRunner(stages, stage_ids, num_stages, meshes.pp_group, env.device, cfg, n_micro)
    par.pipeline.infer_shapes(par.model, n_micro * t.micro_batch_size, t.seq_len, env.device)
    return par


@torch.no_grad()
def full_state_dict(par: DistributedParallelized) -> dict[str, torch.Tensor]:
    """Every parameter as a full (unsharded, all experts, all pipeline stages) CPU tensor, on every rank
    (collective; for tests and small exports: it holds the whole model in host memory)."""
    ep_group = par.meshes.ep_group
    out = {}
    for name, p in par.model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if ep_group is not None and ".experts." in name:
            parts = [torch.empty_like(t) for _ in range(par.layout.ep)]
            dist.all_gather(parts, t.contiguous(), group=ep_group)
            t = torch.cat(parts)
        out[name] = t.float().cpu()
    if par.layout.pp > 1:  # every stage contributes its layers
        parts = [None] * par.layout.pp
        dist.all_gather_object(parts, out, group=par.meshes.pp_group)
        out = {k: v for part in parts for k, v in part.items()}
    return out
