"""Moving a MoE layer's rows into expert order and back, with gathers in both directions.

Shapes: T tokens, K experts per token, N = T*K routed rows, D hidden. `order_N`: the flat assignments (t*K + k)
sorted by expert (the dispatch order); `inverse_N`: its inverse permutation (where each assignment went).

Indexing with a tensor differentiates into a scatter-add (index_put with accumulate): on a GPU an atomic add per
element, and for the dispatch's gather of each token K times, K atomic adds into one row. Both moves here are
gathers in forward AND backward, since each is a permutation (or a permutation of K copies) whose inverse is known:

    x_ND = dispatch_rows(x_TD, order_N, inverse_N, K)      # x_TD[order_N // K]; grad: the K rows' sum, gathered
    y_TD = combine_rows(y_ND, order_N, inverse_N, K, dtype)  # each token's K rows summed; grad: gathered

The dispatch's backward sums each token's K rows with sum_rows: compiled, K gathers added in one pointwise kernel
whose loads run along D, with no [N, D] intermediate.
"""
from __future__ import annotations

import torch


def inverse_permutation(order_N: torch.Tensor) -> torch.Tensor:
    """inverse_N with order_N[inverse_N[j]] == j (one scatter of positions; no second sort)."""
    positions = torch.arange(order_N.shape[0], device=order_N.device, dtype=order_N.dtype)
    return torch.empty_like(order_N).scatter_(0, order_N, positions)


def sum_rows(rows_ND: torch.Tensor, index_TK: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """out_TD[t] = sum over k of rows_ND[index_TK[t, k]], accumulated in fp32 (or dtype's precision if higher) and
    returned in dtype (default: the rows').

    Compiled, it is K gathers added in order, which inductor fuses into one pointwise kernel over [T, D] whose loads
    run along D; written as the [T*K, D] gather viewed [T, K, D] and summed over K, inductor made a persistent
    reduction over K whose loads ran across rows (issue 31: 0.33 ms per layer and micro batch at the Qwen3 proxy, a
    quarter of HBM speed; the dispatch's forward + backward 1.76 -> 1.03 ms in call 9's `...check-rows.json`).
    Eager, that gather-and-sum is the fewer kernels."""
    T, K = index_TK.shape
    dtype = dtype or rows_ND.dtype
    if torch.compiler.is_compiling():
        acc = torch.promote_types(dtype, torch.float32)
        out_TD = rows_ND[index_TK[:, 0]].to(acc)
        for k in range(1, K):
            out_TD = out_TD + rows_ND[index_TK[:, k]].to(acc)
        return out_TD.to(dtype)
    return rows_ND[index_TK.reshape(-1)].view(T, K, -1).sum(1, dtype=dtype)


class _DispatchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, order_N, inverse_N, K: int):
        ctx.save_for_backward(inverse_N)
        ctx.K = K
        return x_TD[order_N // K]

    @staticmethod
    def backward(ctx, g_ND):
        (inverse_N,) = ctx.saved_tensors
        return sum_rows(g_ND, inverse_N.view(-1, ctx.K)), None, None, None


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


def combine_rows(y_ND: torch.Tensor, order_N: torch.Tensor, inverse_N: torch.Tensor, K: int,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """Each token's K expert rows back from dispatch order and summed: y_ND[inverse_N].view(T, K, D).sum(1) in
    dtype (default y's); its gradient is a gather by order_N (every row takes its token's gradient).

    Not sum_rows: with the sum inside one autograd.Function whose backward was g_TD.to(y's dtype)[order_N // K],
    inductor's compiled backward returned zeros on an H200 (torch 2.11; correct on CPU and eager: issue 31 call 9,
    `...check-rows.json`), so the combine keeps this form, whose compiled gradient that check verified."""
    T = inverse_N.shape[0] // K
    return _UnsortRows.apply(y_ND, order_N, inverse_N).view(T, K, -1).sum(1, dtype=dtype or y_ND.dtype)
