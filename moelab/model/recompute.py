"""Activation checkpointing of a block (train.activation_checkpointing): full and selective recompute.

Full: the whole block runs again in backward from its input. The recomputed forward is side-effect free: the
router puts its statistics into a record that the checkpointed function returns, and the block adds the real
forward's record to the router's step statistics once (the recompute's copy is dropped), so routed tokens,
balance, dead experts and the aux-loss-free bias update see each token once, as without recompute.

    block.recompute = "full"                 # moelab.parallel.place.apply_activation_checkpointing sets it
    y_BLD = block(x_BLD, cos_LD, sin_LD, ctx)   # same values, gradients and routing statistics as without

Selective: recompute a block's cheap parts in backward, keep its matmul outputs, and never re-run the router.

A block runs as three checkpointed pieces and the router between them:

    h = x + attention(attention_norm(x))     checkpointed: norms, rotary, casts, reshapes recomputed
    xn = ffn_norm(h)                         checkpointed: the norm recomputed from h
    route = router(xn)                       run once: its top-k indices and weights are kept, so the
                                             recompute cannot route differently (NeMo's ignore_router_for_ac)
    y = moe.routed(xn, *route)               checkpointed: dispatch, SwiGLU, combine recomputed (one process)
    y = moe.routed(xn, *route, run=_piece)   under expert parallelism: only the routed experts and the shared
                                             experts are checkpointed pieces; the dispatch and the combine run
                                             once, so their all-to-alls never run again in backward

Inside each piece, torch's selective checkpoint policy keeps the outputs of the matmuls and of the attention
kernel (SAVED_OPS) and recomputes everything else. Under expert parallelism (a dispatcher that ``exchanges``) a
MoE layer therefore does its 4 row exchanges per micro batch (dispatch and combine, forward and backward) as
without recompute; the price is what the dispatch and combine keep for backward: the rows the experts received
([W, D], the experts piece's input) and the returned rows the combine weights ([T*K, D] at most, for the
weights' gradient). Without EP the whole routed part stays one piece (nothing to exchange, less kept).
moelab.planner.recompute counts what it keeps.

    block.recompute = "selective"            # moelab.parallel.place.apply_activation_checkpointing sets it
    y_BLD = block(x_BLD, cos_LD, sin_LD, ctx)   # same values and gradients as without recompute
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_aten = torch.ops.aten
# the ops whose outputs are kept (the projections, the experts, the fused attention kernels); every other op of
# a checkpointed piece is recomputed, the eager attention path's scores and probabilities (bmm, softmax) too
_SAVED_NAMES = ("mm", "addmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm",
                "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
SAVED_OPS = frozenset(getattr(_aten, n).default for n in _SAVED_NAMES if hasattr(_aten, n))


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _piece(fn, *args):
    """fn(*args) checkpointed under the keep-the-matmuls policy."""
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, _policy))


def selective_forward(block, x_BLD, cos_LD, sin_LD, ctx):
    """moelab.model.transformer.Block.forward with selective recompute (module docstring); `ctx` the batch's
    moelab.model.batch_context.BatchContext."""
    h_BLD = _piece(lambda x: x + block.attention(block.attention_norm(x), cos_LD, sin_LD, ctx.documents_BL), x_BLD)
    if not block.is_moe:
        return h_BLD + _piece(lambda h: block.ffn(block.ffn_norm(h)), h_BLD)
    xn_BLD = _piece(block.ffn_norm, h_BLD)
    return h_BLD + block.ffn(xn_BLD, ctx, routed=_selective_routed)


def _selective_routed(moe, xn_BLD, route, loss_scale: float):
    """The MoE layer after its router (MoE.forward's `routed`): the router ran outside any checkpoint, so its
    choices are kept and never recomputed; the rest is checkpointed as the module docstring says. Called inside
    the layer's own call, so what wraps that call (tensor parallelism's sequence-shard boundary,
    moelab.parallel.tensor) wraps the recompute too."""
    if moe.dispatcher.exchanges:  # keep what the dispatch delivered; recompute inside the experts only
        return moe.routed(xn_BLD, *route, loss_scale=loss_scale, run=_piece)
    return _piece(functools.partial(moe.routed, loss_scale=loss_scale), xn_BLD, *route)


def full_forward(block, x_BLD, cos_LD, sin_LD, ctx):
    """moelab.model.transformer.Block.forward with full recompute (module docstring)."""
    def body(x_BLD):
        record = {}  # made inside: the recompute fills a fresh one, which nobody adds
        return block.compute(x_BLD, cos_LD, sin_LD, ctx, record), record

    y_BLD, record = checkpoint(body, x_BLD, use_reentrant=False, preserve_rng_state=False)
    if record:  # a dense block records nothing
        block.ffn.router.add_record(record)
    return y_BLD
