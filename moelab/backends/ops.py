"""Tensor operations that the model and the experts kernels share. They live here, below the model, because the
kernels (moelab.backends.gmm, te) compute what the model's own experts path computes and must not import the model
(the model imports the switchboard, never the other way round).

    y_NI = scale_rows(x_NI, w_N)      # each routed row times its routing weight, rounded once to x_NI's dtype

Shapes: N routed rows, I their width.
"""
from __future__ import annotations

import torch


def scale_rows(x_NI: torch.Tensor, scale_N: torch.Tensor | None) -> torch.Tensor:
    """Each row of x_NI times its routing weight (the experts' activation before their down projection, on every
    experts path: moelab.model.experts); the product in the promoted dtype (fp32 for autocast's fp32 weights),
    rounded once to x_NI's dtype. `scale_N` None: x_NI unchanged."""
    return x_NI if scale_N is None else (x_NI * scale_N[:, None]).to(x_NI.dtype)
