"""The token embedding and the LM head with their weight gradients added into .grad by the backward itself, on a
later micro batch (moelab.backends.ops.accumulates_into): the head's GEMM adds d^T h into .grad (addmm, beta 1) and
the embedding adds each token's gradient row into its row of .grad (index_put_ with accumulate, sorted by row). Without
them autograd writes each micro batch's gradient in full and adds it with a separate `.grad +=` pass: at the
Qwen3-30B-A3B proxy's vocabulary (151,936 x 2,048, two 622 MB bf16 weights) about 1.9 GB read and written per weight
and micro batch, and a zero fill of the embedding's whole gradient (issue 41's profiles: 13.2 ms a step of `.grad +=`
and 1.5 ms of fill at global batch 16 on an H100).

The sum is rounded once into .grad (autograd rounds the micro batch's gradient, then the sum). Used on CUDA for a
plain weight (no DTensor, no process group, no module hooks: `applies`); elsewhere the modules run as they are, so
CPU runs keep autograd's exact numbers.

    h_BLD = embedding(model.tok_embeddings, tokens_BL)
    logits_BLV = linear(model.output, h_BLD)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moelab.backends.head_grad import add_weight_grad
from moelab.backends.ops import accumulates_into


def applies(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether the module's call may be replaced by this file's autograd Functions: on CUDA, a plain weight, no
    process group (FSDP, DDP and tensor parallelism hook or shard the weight) and no hooks on the module."""
    w = module.weight
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return (x.is_cuda and type(w) is nn.Parameter and not distributed and not module._forward_hooks
            and not module._forward_pre_hooks and not module._backward_hooks)


class _Linear(torch.autograd.Function):
    """y = x @ w^T (no bias), in the autocast dtype when autocast is on."""

    @staticmethod
    def forward(ctx, x_TD, w_VD):
        dtype = torch.get_autocast_dtype(x_TD.device.type) if torch.is_autocast_enabled(x_TD.device.type) \
            else x_TD.dtype
        x_c, w_c = x_TD.to(dtype), w_VD.to(dtype)
        ctx.save_for_backward(x_c, w_c, w_VD)
        with torch.autocast(x_TD.device.type, enabled=False):
            return F.linear(x_c, w_c)

    @staticmethod
    def backward(ctx, g_TV):
        x_c, w_c, w_VD = ctx.saved_tensors
        g_TV = g_TV.to(x_c.dtype)
        dx_TD = g_TV @ w_c if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:  # a frozen head (LoRA elsewhere): no weight gradient to compute
            return dx_TD, None
        g_2, x_2 = g_TV.reshape(-1, g_TV.shape[-1]), x_c.reshape(-1, x_c.shape[-1])
        if accumulates_into(w_VD):
            add_weight_grad(w_VD.grad, g_2, x_2)  # one rounding into .grad's dtype
            return dx_TD, None
        return dx_TD, (g_2.t() @ x_2).to(w_VD.dtype)


class _Embedding(torch.autograd.Function):
    """h = w[ids]; the padding row (padding_idx) gets no gradient."""

    @staticmethod
    def forward(ctx, ids_BL, w_VD, padding_idx):
        ctx.save_for_backward(ids_BL, w_VD)
        ctx.padding_idx = -1 if padding_idx is None else padding_idx
        return F.embedding(ids_BL, w_VD)

    @staticmethod
    def backward(ctx, g_BLD):
        ids_BL, w_VD = ctx.saved_tensors
        ids_T, g_TD = ids_BL.reshape(-1), g_BLD.reshape(-1, g_BLD.shape[-1]).to(w_VD.dtype)
        if not accumulates_into(w_VD):
            return None, torch.ops.aten.embedding_dense_backward(g_TD, ids_T, w_VD.shape[0], ctx.padding_idx,
                                                                 False), None
        if ctx.padding_idx >= 0:
            g_TD = g_TD.masked_fill((ids_T == ctx.padding_idx)[:, None], 0)
        w_VD.grad.index_put_((ids_T,), g_TD, accumulate=True)
        return None, None, None


def linear(head: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """head(x), its weight's gradient added into .grad by the GEMM on a later micro batch (where `applies`)."""
    if type(head) is nn.Linear and head.bias is None and applies(head, x) and torch.is_grad_enabled():
        return _Linear.apply(x, head.weight)
    return head(x)


def embedding(emb: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """emb(ids), its weight's gradient added row by row into .grad on a later micro batch (where `applies`)."""
    plain = type(emb) is nn.Embedding and emb.max_norm is None and not emb.scale_grad_by_freq and not emb.sparse
    if plain and applies(emb, ids) and torch.is_grad_enabled():
        return _Embedding.apply(ids, emb.weight, emb.padding_idx)
    return emb(ids)
