"""Context parallelism: each of `cp` ranks holds a load-balanced share of every sequence.

Shapes: B batch, L sequence (this rank's share), S whole sequence, H query heads, G kv heads, Dh head dim,
E experts, n = S / (2 cp) tokens per chunk.

    cp = ContextParallel(group)                 # one per rank; every CP rank of a data-parallel rank
    tokens_BL = cp.shard(tokens_BS)             # chunks c and 2cp-1-c of the sequence (c = this CP rank)
    positions_L = cp.positions(S, device)       # their positions, for the rotary embedding
    cp.apply(model, S)                          # attention over the whole sequence; router losses over it

Load balance: the sequence is cut into 2*cp chunks and rank c takes chunks c and 2cp-1-c, so every rank has
the same amount of causal attention work (an early chunk with few keys, a late one with many).

Attention: keys and values of all CP ranks are all-gathered (autograd-aware: the backward pass all-reduces their
gradients and keeps this rank's chunks) and put back in sequence order; each of this rank's two query chunks then
attends causally to the keys up to its own end, which is exactly the model's causal attention with the queries
being the last keys (moelab.model.attention.causal_attention). All-gather CP (as in Llama 3) keeps the whole
sequence's K/V per rank, which the memory of a GQA model affords; a ring would overlap the exchange instead.

Router losses: the Switch and sequence auxiliary losses multiply means over the tokens of a batch (or sequence);
``Router.token_mean`` is set to an autograd-aware mean over the CP ranks so the loss equals the one-process
loss. Means that enter linearly (z-loss, the routing statistics) are reduced by the trainer's statistics sum.
Capacity dropping stays per rank (each rank ranks its own tokens).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moelab.model.attention import causal_attention


def balanced_shard(x_BS: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Chunks `rank` and 2cp-1-rank of 2*cp equal chunks of dim 1 (load-balanced causal sharding)."""
    chunks = x_BS.chunk(2 * cp, dim=1)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=1)


class _GatherSequence(torch.autograd.Function):
    """[B, G, L, Dh] shares of the CP ranks -> [B, G, S, Dh] in sequence order; backward: the summed gradient of
    this rank's chunks."""

    @staticmethod
    def forward(ctx, x_BGLD, group, cp: int, rank: int):
        ctx.group, ctx.cp, ctx.rank = group, cp, rank
        parts = [torch.empty_like(x_BGLD) for _ in range(cp)]
        dist.all_gather(parts, x_BGLD.contiguous(), group=group)
        chunks = [None] * (2 * cp)
        for r, part in enumerate(parts):
            chunks[r], chunks[2 * cp - 1 - r] = part.chunk(2, dim=2)
        return torch.cat(chunks, dim=2)

    @staticmethod
    def backward(ctx, grad_BGSD):
        grad_BGSD = grad_BGSD.contiguous()
        dist.all_reduce(grad_BGSD, group=ctx.group)
        chunks = grad_BGSD.chunk(2 * ctx.cp, dim=2)
        return torch.cat([chunks[ctx.rank], chunks[2 * ctx.cp - 1 - ctx.rank]], dim=2), None, None, None


class _MeanOverRanks(torch.autograd.Function):
    """The mean of a tensor over a group, on every rank; backward: the mean of the gradients (each rank's
    loss uses the same mean, see the module docstring)."""

    @staticmethod
    def forward(ctx, x, group, size: int):
        ctx.group, ctx.size = group, size
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out / size

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad / ctx.size, None, None


def mean_over_ranks(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """The mean of `x` over the `size` ranks of `group`, on every rank (its gradient: see _MeanOverRanks)."""
    return _MeanOverRanks.apply(x, group, size)


class ContextParallel:
    """Context parallelism over one process group: shard sequences, give positions, attend over all chunks.

        cp = ContextParallel(meshes.cp_group)
        tokens_BL = cp.shard(tokens_BS)         # this rank's two chunks of every sequence
    """
    def __init__(self, group):
        self.group = group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def shard(self, x_BS: torch.Tensor) -> torch.Tensor:
        return balanced_shard(x_BS, self.cp, self.rank)

    def positions(self, seq_len: int, device) -> torch.Tensor:
        return self.shard(torch.arange(seq_len, device=device)[None])[0]

    def gather(self, x_BGLD: torch.Tensor) -> torch.Tensor:
        return _GatherSequence.apply(x_BGLD, self.group, self.cp, self.rank)

    def token_mean(self, x: torch.Tensor) -> torch.Tensor:
        return mean_over_ranks(x, self.group, self.cp)

    def apply(self, model: nn.Module, seq_len: int) -> None:
        """Replace every attention's core by the CP one and make the routers' loss means global."""
        n = seq_len // (2 * self.cp)
        ends = ((self.rank + 1) * n, (2 * self.cp - self.rank) * n)  # keys each query chunk sees
        for block in model.layers.values():
            block.attention.attend = _CPAttend(block.attention, self, ends)
        for moe in model.moe_layers():
            moe.router.token_mean = self.token_mean


class _CPAttend:
    """attend(q, k, v) of one attention module under context parallelism (see the module docstring)."""

    def __init__(self, attention: nn.Module, cp: ContextParallel, ends: tuple[int, int]):
        self.cp, self.ends, self.attention = cp, ends, attention
        self.backend = attention.backend
        self.window = attention.window
        self.scale = getattr(attention, "softmax_scale", None)

    @property
    def sinks(self):  # read at each call: FSDP2 replaces the module's parameters after this is built
        return self.attention.sinks

    def __call__(self, q_BHLD, k_BGLD, v_BGLD, documents_BL=None):
        if documents_BL is not None:  # moelab.config refuses data.kind='sft' with context parallelism
            raise NotImplementedError("context parallelism does not attend within packed documents")
        k_BGSD, v_BGSD = self.cp.gather(k_BGLD), self.cp.gather(v_BGLD)
        outs = [self.core(q_part, k_BGSD[:, :, :end], v_BGSD[:, :, :end])
                for q_part, end in zip(q_BHLD.chunk(2, dim=2), self.ends)]
        return torch.cat(outs, dim=2)

    def core(self, q_BHnD, k_BGED, v_BGED):
        """Causal attention of n queries that are the last n of the E keys."""
        if self.backend == "sdpa" and not self.window and self.sinks is None:
            from torch.nn.attention.bias import causal_lower_right

            H, G = q_BHnD.shape[1], k_BGED.shape[1]
            k, v = k_BGED.repeat_interleave(H // G, dim=1), v_BGED.repeat_interleave(H // G, dim=1)
            mask = causal_lower_right(q_BHnD.shape[2], k.shape[2])
            return F.scaled_dot_product_attention(q_BHnD, k, v, attn_mask=mask, scale=self.scale)
        # the model's reference path handles queries that are the last keys, windows and sinks
        return causal_attention(q_BHnD, k_BGED, v_BGED, "eager", self.window, self.sinks, scale=self.scale)
