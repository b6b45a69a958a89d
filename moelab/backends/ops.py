"""Tensor operations that the model and the experts kernels share. They live here, below the model, because the
kernels (moelab.backends.gmm, te) compute what the model's own experts path computes and must not import the model
(the model imports the switchboard, never the other way round).

    y_NI = scale_rows(x_NI, w_N)      # each routed row times its routing weight, rounded once to x_NI's dtype
    if accumulates_into(w): ...       # a backward may add w's gradient into w.grad itself

Shapes: N routed rows, I their width.
"""
from __future__ import annotations

import torch


def scale_rows(x_NI: torch.Tensor, scale_N: torch.Tensor | None) -> torch.Tensor:
    """Each row of x_NI times its routing weight (the experts' activation before their down projection, on every
    experts path: moelab.model.experts); the product in the promoted dtype (fp32 for autocast's fp32 weights),
    rounded once to x_NI's dtype. `scale_N` None: x_NI unchanged."""
    return x_NI if scale_N is None else (x_NI * scale_N[:, None]).to(x_NI.dtype)


def accumulates_into(w: torch.Tensor) -> bool:
    """Whether an experts backward (moelab.model.fused_experts, moelab.backends.sonic) may add w's gradient into
    w.grad itself, in its GEMMs (eager only): w is a leaf that requires grad, already holds a gradient of its own
    dtype, shape, strides and device (a later micro batch), has no hooks that autograd's accumulation would have run
    (a post-accumulate hook: tensor parallelism's, compression's, a user's), and no process group is up (DDP's
    reducer hooks the gradient accumulator itself, where they cannot be seen from here). The backward then returns
    None for w, so nothing is added twice."""
    g = w.grad if w.is_leaf and w.requires_grad else None
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return (g is not None and not distributed and not torch.compiler.is_compiling() and not torch.is_grad_enabled()
            and type(g) is torch.Tensor and g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride()
            and g.device == w.device and not w._backward_hooks and not getattr(w, "_post_accumulate_grad_hooks", None))
