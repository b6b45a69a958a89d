"""FSDP2 over a model's blocks: which units it wraps, on which mesh, when they reshard, in which dtype gradients
are reduced, and how all-gathers are prefetched.

    apply_fsdp(model, cfg, meshes)   # after EP, materialisation, CP, activation checkpointing and compile

- Units: every block over the dense (dp*cp) mesh, and under EP a block's experts as their own unit over the
  expert-FSDP mesh; the root (embedding, final norm, LM head) over the dense mesh. Under TP (parallel.tp > 1)
  the dense mesh is the dp*cp dimension of the 2-D (dp_cp, tp) mesh whose tp dimension holds TP's DTensor shards,
  and the MoE layers, which route each TP rank's sequence share like a data-parallel rank's, are their own units:
  experts over expert-FSDP (dp*cp*tp/ep ranks, also when ep = 1), router and shared experts over all dp*cp*tp
  ranks (moelab.parallel.tensor); column/row-parallel shared experts (parallel.tp_shared_experts=column_row)
  hold TP shards and are a unit of their own over the dense mesh.
- One-rank meshes: a unit whose mesh has one rank is left plain (a torch.Tensor, not a DTensor): there is
  nothing to shard or reduce, and fully_shard would only copy the weights into and out of its buffers every
  micro batch. Such layouts: EP = dp*cp (each rank's experts are its own: expert-FSDP has one rank) and
  pp = world (one rank per stage). The exception is bf16 compute on fp32 weights (train.dtype=bfloat16,
  train.param_dtype=float32), where FSDP2's MixedPrecisionPolicy IS the cast to bf16 and its reshard frees
  each bf16 copy after forward: there every unit stays wrapped. So the skip serves fp32 runs and bf16
  parameters (train.param_dtype=bfloat16, as the benchmarks run). The model then mixes DTensor and plain
  parameters; moelab.train.optim gives each kind its own optimizer group.
- reshard_after_forward (parallel.reshard_after_forward for the blocks and the root,
  parallel.expert_reshard_after_forward for the experts): torchtitan's default keeps the last block gathered
  (backward needs it at once) and, under pipeline parallelism, every block (the schedule runs many micro
  batches' forwards; resharding would all-gather again for each); the root (embedding, norm, LM head) stays
  gathered (FSDP2's own choice for a root) unless the policy is always.
- reduce_dtype (parallel.reduce_dtype): FSDP2 reduce-scatters gradients in fp32 (default) or bf16.
- Prefetching (parallel.fsdp_prefetch): explicit = each block's pre-forward gathers the next block and its
  experts, each block's pre-backward the previous one's (set_modules_to_forward/backward_prefetch); auto picks
  it when ep > 1, as torchtitan does (the dispatcher's device-to-host copy holds the CPU, so FSDP2's implicit
  gathers, issued when the CPU reaches a unit, start late).
- Gradient sync (parallel.fsdp_grad_sync, resolved by moelab.layout.dims.grad_sync): micro_batch leaves FSDP2
  at its default (reduce-scatter in every backward); step calls ``set_micro_batch`` before each micro batch's
  forward (the trainer, through Parallelized.start_micro_batch), so only the last one reduce-scatters and
  reshards after backward. Under pp > 1 torch's pipeline schedule does the same itself (step is all it does).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from moelab.config import Config
from moelab.layout.dims import fsdp_wraps, reshard_after_forward


def mixed_precision(cfg: Config) -> MixedPrecisionPolicy | None:
    """bf16 compute with fp32 master weights when train.dtype=bfloat16; gradients reduced in
    parallel.reduce_dtype. None: FSDP2's default (compute and reduce in the parameters' dtype)."""
    bf16_compute = cfg.train.dtype == "bfloat16"
    bf16_reduce = cfg.parallel.reduce_dtype == "bfloat16"
    if not bf16_compute and not bf16_reduce:
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16_compute else None,
                                reduce_dtype=torch.bfloat16 if bf16_reduce else torch.float32)


def wraps(mesh, cfg: Config) -> bool:
    """Whether FSDP2 wraps a unit on `mesh` (moelab.layout.dims.fsdp_wraps)."""
    return fsdp_wraps(mesh.size(), cfg)


def apply_fsdp(model: nn.Module, cfg: Config, meshes, ignored_params: set | None = None) -> None:
    """FSDP2: experts over the expert-FSDP mesh (when EP splits them), each block and the root over dp*cp;
    units on one-rank meshes stay plain (``wraps``). `ignored_params`: replicated experts
    (moelab.parallel.replicate), left to their own exchange."""
    p = cfg.parallel
    mp = mixed_precision(cfg) or MixedPrecisionPolicy()
    ignored = set(ignored_params or ())
    blocks = list(model.layers.values())
    experts: list[nn.Module | None] = []  # each block's experts when they are their own FSDP2 unit
    for i, block in enumerate(blocks):
        moe = getattr(block, "is_moe", False)
        unit = block.ffn.experts if (p.ep > 1 or p.tp > 1) and moe and not ignored_params else None
        if unit is not None and not wraps(meshes.efsdp, cfg):
            ignored |= set(unit.parameters())  # plain: the block's unit must not take them in
            unit = None
        if unit is not None:
            fully_shard(unit, mesh=meshes.efsdp, mp_policy=mp,
                        reshard_after_forward=reshard_after_forward(p.expert_reshard_after_forward, p.pp,
                                                                    i == len(blocks) - 1))
        if p.tp > 1 and moe:  # the router and shared experts, replicated over TP: reduced over every routing rank
            ignored |= _tp_shared_experts(block.ffn, cfg, meshes, mp, i == len(blocks) - 1)
            fully_shard(block.ffn, mesh=meshes.moe_dp, mp_policy=mp, ignored_params=ignored or None,
                        reshard_after_forward=reshard_after_forward(p.reshard_after_forward, p.pp,
                                                                    i == len(blocks) - 1))
        experts.append(unit)
    if not wraps(meshes.dense, cfg):  # one rank per stage, nothing to cast: the whole stage stays plain
        return
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=meshes.dense, mp_policy=mp, ignored_params=ignored or None,
                    reshard_after_forward=reshard_after_forward(p.reshard_after_forward, p.pp, i == len(blocks) - 1))
    # the root: None lets FSDP2 keep it gathered after forward (backward starts with its LM head)
    root_reshard = None if p.reshard_after_forward == "default" else p.reshard_after_forward == "always"
    fully_shard(model, mesh=meshes.dense, mp_policy=mp, ignored_params=ignored or None,
                reshard_after_forward=root_reshard)
    if p.fsdp_prefetch == "explicit" or (p.fsdp_prefetch == "auto" and p.ep > 1):
        set_prefetch(model, blocks, experts)


def _tp_shared_experts(moe: nn.Module, cfg: Config, meshes, mp, last: bool) -> set:
    """Column/row-parallel shared experts (parallel.tp_shared_experts=column_row) hold TP shards: their own unit
    over the dense mesh (dp*cp, as a dense MLP's), not the MoE layer's over every routing rank; with one dense rank
    they stay TP's DTensors alone (returned, for the MoE layer's unit to leave out)."""
    shared, p = moe.shared_experts, cfg.parallel
    if shared is None or p.tp_shared_experts != "column_row":
        return set()
    if not wraps(meshes.dense, cfg):
        return set(shared.parameters())
    fully_shard(shared, mesh=meshes.dense, mp_policy=mp,
                reshard_after_forward=reshard_after_forward(p.reshard_after_forward, p.pp, last))
    return set()


def set_prefetch(root: nn.Module, blocks: list[nn.Module], experts: list[nn.Module | None]) -> None:
    """Explicit prefetching: the root's and each block's pre-forward gather the next block (and its experts);
    in backward, each block's pre-backward gathers the one before it (torchtitan's chain)."""
    units = [[m for m in (block, e) if isinstance(m, FSDPModule)] for block, e in zip(blocks, experts)]
    chain = [root, *blocks]
    for here, nxt in zip(chain, units):
        if nxt:
            here.set_modules_to_forward_prefetch(nxt)
    backward = [root, *reversed(blocks)]
    for here, prev in zip(backward, reversed(units)):
        if prev:
            here.set_modules_to_backward_prefetch(prev)


def set_micro_batch(model: nn.Module, last: bool) -> None:
    """parallel.fsdp_grad_sync=step, before each micro batch's forward: every FSDP2 unit of `model` reduce-scatters
    its gradients and reshards its weights after backward only when `last` (the step's last micro batch). Before
    that, gradients accumulate unsharded in the reduce dtype and each unit stays gathered from its backward to
    the next micro batch's forward (FSDP2's set_requires_gradient_sync / set_reshard_after_backward, as torch's
    pipeline schedule sets them under pp > 1).

        for i in range(n): set_micro_batch(model, last=i == n - 1); model(x[i]).sum().backward()
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(last, recurse=False)
            module.set_reshard_after_backward(last, recurse=False)
