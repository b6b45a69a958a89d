"""Moving a MoE layer's rows into expert order and back, with gathers in both directions.

Shapes: T tokens, K experts per token, N = T*K routed rows, D hidden. `order_N`: the flat assignments (t*K + k)
sorted by expert (the dispatch order); `inverse_N`: its inverse permutation (where each assignment went).

Indexing with a tensor differentiates into a scatter-add (index_put with accumulate): on a GPU an atomic add per
element, and for the dispatch's gather of each token K times, K atomic adds into one row. Both moves here are
gathers in forward AND backward, since each is a permutation (or a permutation of K copies) whose inverse is known:

    x_ND = dispatch_rows(x_TD, order_N, inverse_N, K)   # x_TD[order_N // K]; grad: the K rows' sum, gathered
    y_NkD = unsort_rows(y_ND, order_N, inverse_N)       # y_ND[inverse_N]: back in assignment order; grad: gathered

Compiled, the forward gather fuses with what reads it (the combine's sum over K), and the backward's gather with
the sum over K, so neither the [N, D] scatter result nor its zeros are written.
"""
from __future__ import annotations

import torch


def inverse_permutation(order_N: torch.Tensor) -> torch.Tensor:
    """inverse_N with order_N[inverse_N[j]] == j (one scatter of positions; no second sort)."""
    positions = torch.arange(order_N.shape[0], device=order_N.device, dtype=order_N.dtype)
    return torch.empty_like(order_N).scatter_(0, order_N, positions)


class _DispatchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, order_N, inverse_N, K: int):
        ctx.save_for_backward(inverse_N)
        ctx.K = K
        return x_TD[order_N // K]

    @staticmethod
    def backward(ctx, g_ND):
        (inverse_N,) = ctx.saved_tensors
        T = inverse_N.shape[0] // ctx.K
        return g_ND[inverse_N].view(T, ctx.K, -1).sum(1), None, None, None


class _UnsortRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND, order_N, inverse_N):
        ctx.save_for_backward(order_N)
        return y_ND[inverse_N]

    @staticmethod
    def backward(ctx, g_ND):
        (order_N,) = ctx.saved_tensors
        return g_ND[order_N], None, None


def dispatch_rows(x_TD: torch.Tensor, order_N: torch.Tensor, inverse_N: torch.Tensor, K: int) -> torch.Tensor:
    """x_TD[order_N // K] (each token once per chosen expert, in expert order); its gradient sums each token's K
    rows by gathering them (inverse_N), not by a scatter-add."""
    return _DispatchRows.apply(x_TD, order_N, inverse_N, K)


def unsort_rows(y_ND: torch.Tensor, order_N: torch.Tensor, inverse_N: torch.Tensor) -> torch.Tensor:
    """The rows back in assignment order (t*K + k): y_ND[inverse_N], the index_copy(0, order_N, y_ND) of a
    permutation; its gradient is a gather by order_N."""
    return _UnsortRows.apply(y_ND, order_N, inverse_N)
