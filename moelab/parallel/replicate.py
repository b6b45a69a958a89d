"""Replicated data parallel: the branch of moelab.parallel.distributed.place_stage for parallel.data_parallel=ddp
or parallel.expert_dp=replicate (pp = cp = 1, checked by the config).

    exchange = apply_data_parallel(model, cfg, meshes, device, apply_fsdp)   # after EP, materialisation and checkpointing
    ...backward...; exchange.reduce()                             # replicated experts only (else None)

- data_parallel=ddp: torch's composable ``replicate`` (DistributedDataParallel without a wrapper, so parameter
  names and checkpoints stay those of FSDP2 runs) over the dense (dp*cp) mesh: gradients all-reduced in
  buckets while backward runs, once per optimizer step (``set_requires_gradient_sync`` off for all but the
  last micro batch: DistributedParallelized.start_micro_batch), gradients as views of the buckets (no second
  copy). Parameters stay fp32; bf16 compute is the trainer's autocast.
- expert_dp=fsdp: the experts are FSDP2 units on the expert-FSDP mesh (DDP leaves fully-sharded modules alone),
  resharded after forward by parallel.expert_reshard_after_forward; on a one-rank expert-FSDP mesh (ep = dp)
  they stay plain tensors, left out of DDP (moelab.parallel.fsdp).
- expert_dp=replicate: every rank of the expert-FSDP mesh holds its EP rank's experts whole; neither DDP nor
  FSDP2 touches them; moelab.parallel.compression.ExpertGradExchange averages their gradients (exactly, or 1-bit
  with error feedback: train.expert_grad_compression), each launched from its gradient hook in the last micro
  batch's backward (armed by DistributedParallelized.start_micro_batch; so it overlaps the backward of the
  layers below) and decoded after backward.
A replicated parameter's gradient sits on several ranks: ``REPLICAS`` on the parameter says on how many, so the
global gradient norm counts it once (moelab.parallel.distributed.DistributedParallelized.clip_grad_norm).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from moelab.config import Config
from moelab.layout.dims import reshard_after_forward
from moelab.parallel.compression import ExpertGradExchange

REPLICAS = "_moelab_replicas"  # attribute on a parameter: the ranks holding the same gradient (default 1)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    return [b.ffn.experts for b in model.layers.values() if getattr(b, "is_moe", False)]


def apply_data_parallel(model: nn.Module, cfg: Config, meshes, device: str, apply_fsdp) -> ExpertGradExchange | None:
    """Place the dense weights (DDP or FSDP2) and the experts (FSDP2 or replicated); returns the replicated
    experts' gradient exchange, or None. `apply_fsdp` is moelab.parallel.distributed's (FSDP2 over the blocks)."""
    p, experts = cfg.parallel, expert_modules(model)
    if p.data_parallel == "fsdp":  # FSDP2 for the dense weights, replicated experts left out of it
        apply_fsdp(model, cfg, meshes, ignored_params={q for e in experts for q in e.parameters()})
    else:
        # experts on a one-rank expert-FSDP mesh (ep = dp) stay plain: nothing to shard or reduce, and autocast
        # (not FSDP2) makes the bf16 compute under DDP
        sharded = p.expert_dp == "fsdp" and meshes.efsdp.size() > 1
        if sharded:  # each its own FSDP2 root: the policy is passed (a root's default keeps it gathered)
            blocks = [getattr(b, "_checkpoint_wrapped_module", b) for b in model.layers.values()]
            for i, block in enumerate(blocks):
                if getattr(block, "is_moe", False):
                    fully_shard(block.ffn.experts, mesh=meshes.efsdp, mp_policy=MixedPrecisionPolicy(),
                                reshard_after_forward=reshard_after_forward(p.expert_reshard_after_forward, p.pp,
                                                                            i == len(blocks) - 1))
        from torch.distributed._composable.replicate import replicate

        dense = meshes.dense.get_group()
        replicate(model, ignored_modules=None if sharded else experts, process_group=dense,
                  device_id=torch.device(device), gradient_as_bucket_view=True, broadcast_buffers=False)
    expert_params = {id(q) for e in experts for q in e.parameters()}  # after fully_shard replaced them
    if p.data_parallel == "ddp":
        for q in model.parameters():
            if id(q) not in expert_params:
                setattr(q, REPLICAS, meshes.dense.size())
    exchange = None
    if p.expert_dp == "replicate":
        named = [(n, q) for n, q in model.named_parameters() if id(q) in expert_params]
        for _, q in named:
            setattr(q, REPLICAS, meshes.efsdp.size())
        exchange = ExpertGradExchange(named, meshes.efsdp.get_group(), cfg.train.expert_grad_compression)
        exchange.overlap_with_backward()
    return exchange
