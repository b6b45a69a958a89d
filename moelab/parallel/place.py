"""A model placed on one process, and the interface the trainer sees for every layout (``Parallelized``); the
placement steps every layout shares (materialise, activation checkpointing, compile).

The trainer talks to parallelism only through the returned ``Parallelized``: which share of the batch this rank
trains, how the sequence is split, how statistics are summed over ranks, how gradients are clipped. One process
is the trivial case of the same interface, so the trainer has a single code path.
"""
from __future__ import annotations

import torch
from torch import nn

from moelab.backends.grad_norm import on_kernel, param_squared_norms, scale_grads
from moelab.config import Config, ParallelConfig
from moelab.model.assemble import materialize as materialize_model
from moelab.parallel.env import DistEnv


class Parallelized:
    """A model placed on this rank, and the facts the trainer needs about the layout (one process here;
    moelab.parallel.distributed overrides what differs on many).

        par = parallelize(model_on_meta, cfg, DistEnv(), ParallelDims.build(cfg, 1))
        par.dp_rank, par.dp_size, par.all_reduce_sum(stats)
    """

    def __init__(self, model: nn.Module, cfg: Config, env: DistEnv, layout: ParallelConfig):
        self.model, self.cfg, self.env, self.layout = model, cfg, env, layout
        self.dp_rank, self.dp_size = 0, 1
        # Parameters already in the compute dtype (FSDP2 mixed precision, or a bf16 model): no autocast needed.
        self.casts_params = False
        # Pipeline parallel: a moelab.parallel.pipeline.PipelineRunner that runs the step's micro batches
        # through its schedule (the trainer hands it the batch instead of looping itself).
        self.pipeline = None

    # which MoE layers exist here: `moe_layers` are this rank's; `moe_layers_all` has one entry per MoE layer
    # of the whole model, None where another pipeline stage holds it
    @property
    def moe_layers(self) -> list:
        return [m for m in self.moe_layers_all if m is not None]

    @property
    def moe_layers_all(self) -> list:
        return self.model.moe_layers()

    def shard_sequence(self, tokens_BL: torch.Tensor) -> torch.Tensor:
        return tokens_BL

    def positions(self, seq_len: int, device) -> torch.Tensor | None:
        return None

    def clip_grad_norm(self, model: nn.Module, max_norm: float, multiply_later=None) -> torch.Tensor:
        """The gradient norm (and clipping by it, torch's clip_grad_norm_ split in its two halves): on CUDA the
        large gradients' squares summed by one Triton pass each (moelab.backends.grad_norm), elsewhere torch's
        get_total_norm. `multiply_later(coef)` (TritonAdamW.clip_in_step): clipping's multiply is handed over
        as its 0-d factor, the gradients left as they are; without it the gradients are multiplied in place
        (grad_norm.scale_grads: clip_grads_with_norm_'s values on torch's fast foreach path)."""
        params = [p for p in model.parameters() if p.grad is not None]
        if not any(on_kernel(p.grad) for p in params):
            total = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        else:
            total = param_squared_norms(params).sum().sqrt()  # with the sums the backward made (grad_norm)
        if max_norm > 0 and params:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # clip_grads_with_norm_'s factor
            if multiply_later is not None:
                multiply_later(coef)
            else:
                scale_grads([p.grad for p in params], coef)
        return total

    # Statistics are summed over all ranks; these weights make that sum the right global value.
    def loss_contribution(self, loss_sum: torch.Tensor) -> torch.Tensor:
        return loss_sum.reshape(1)

    def grad_norm_weight(self) -> float:
        return 1.0

    def stat_weight(self) -> float:
        return 1.0

    def rank_slot(self) -> int:
        return self.env.rank

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def start_micro_batch(self, index: int, count: int) -> None:
        """Called by the trainer before micro batch `index` of the step's `count`: which backward reduces the
        gradients over ranks (moelab.parallel.distributed; nothing to reduce on one process)."""

    # Replicated experts (moelab.parallel.replicate): their gradient exchange after backward, and its per-rank
    # state (error feedback) for checkpoints.
    def finish_gradients(self) -> None:
        pass

    def rank_state(self) -> dict:
        return {}

    def load_rank_state(self, state: dict) -> None:
        pass

    # Communication counters (host numbers, no synchronisation), summed over ranks by the step's all-reduce.
    def pop_comm_counts(self) -> dict[str, list[float]]:
        """This rank's counts since the last call, name -> values: the EP dispatcher's
        (moelab.parallel.expert_parallel.DispatchCounts) and those of ``comm_counters`` (gradient exchanges)."""
        counters = {id(m.dispatcher.counts): m.dispatcher.counts for m in self.moe_layers
                    if getattr(m.dispatcher, "counts", None) is not None}
        out: dict[str, list[float]] = {}
        for counter in [*counters.values(), *getattr(self, "comm_counters", [])]:
            out.update(counter.pop())
        return out


def materialize(model: nn.Module, cfg: Config, device) -> None:
    """Allocate a meta-device model on `device` and draw its weights as the run's setup does
    (moelab.model.assemble.materialize); its parameters may already be FSDP2 shards (moelab.parallel.distributed
    wraps on the meta device): each rank then allocates and fills only its rows (`write_rows`)."""
    materialize_model(model, cfg, device, draw="run", write=write_rows)


def write_rows(p: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a drawn single-process tensor into parameter `p`: whole, or the part of it `p` holds when `p` is a
    DTensor: the block its placements give (FSDP2: rows, Shard(0); TP: columns or rows)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        p.copy_(value.to(p.device, p.dtype))
        return
    local = p.to_local()
    block = value[tuple(slice(o, o + n) for o, n in zip(shard_offsets(p), local.shape))]
    local.copy_(block.to(local.device, local.dtype))


def shard_offsets(t) -> tuple[int, ...]:
    """Where a DTensor's local block starts in the full tensor, per dimension (FSDP2's rows, TP's columns)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(int(o) for o in offset)


def apply_activation_checkpointing(model: nn.Module, cfg: Config) -> None:
    """Recompute each block in backward ("full"), or its cheap parts, keeping matmul outputs and the router's
    choices ("selective"); either way the routing statistics are counted once (moelab.model.recompute)."""
    mode = cfg.train.activation_checkpointing
    if mode == "none":
        return
    for block in model.layers.values():
        block.recompute = mode


def apply_compile(model: nn.Module, cfg: Config) -> None:
    """torch.compile each block in place (train.compile): fuses norms, rotary, SwiGLU and the router's
    elementwise work; blocks share one compiled graph (parameters are graph inputs)."""
    if cfg.train.compile:
        for block in model.layers.values():
            block.compile()
        model.loss_compiled = True  # the fused loss compiles its per-chunk work (moelab.backends.loss)
