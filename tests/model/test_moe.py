"""The local dispatcher hands each routed row's weight to the experts, which apply it before their down
projection (moelab.model.moe.LocalDispatcher.row_weights); combine only unsorts and sums. Against the weighted
sum of the unweighted experts' outputs (the combine that expert parallelism keeps), capacity drops included."""
import pytest
import torch

from moelab.model.experts import GroupedExperts
from moelab.model.moe import LocalDispatcher

T, K, D, F, E = 12, 2, 16, 8, 4


def _routing(seed: int, drop: bool):
    g = torch.Generator().manual_seed(seed)
    x_TD = torch.randn(T, D, generator=g, requires_grad=True)
    experts_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    keep_TK = torch.rand(T, K, generator=g) < 0.7 if drop else None
    weights_TK = torch.softmax(torch.randn(T, K, generator=g), -1)
    if drop:
        weights_TK = weights_TK * keep_TK  # as MoE.routed does
    return x_TD, experts_TK, keep_TK, weights_TK.requires_grad_()


@pytest.mark.parametrize("drop", [False, True])
def test_weighting_in_the_experts_equals_weighting_at_combine(drop):
    experts = GroupedExperts(E, D, F, bias=True)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    x_TD, experts_TK, keep_TK, weights_TK = _routing(0, drop)
    d = LocalDispatcher()
    y_TD = d.route(experts, x_TD, weights_TK, experts_TK, keep_TK, E)
    x_ND, counts_E, (order_N, _) = d.dispatch(x_TD, experts_TK, keep_TK, E)
    y_ND = experts(x_ND, counts_E)
    y_ND = torch.where((torch.arange(T * K) < counts_E.sum())[:, None], y_ND, 0.0)
    y_TKD = torch.empty_like(y_ND).index_copy(0, order_N, y_ND).view(T, K, D)
    reference = (y_TKD * weights_TK[..., None]).sum(1)
    torch.testing.assert_close(y_TD, reference)
    grad = torch.randn(T, D)
    inputs = [x_TD, weights_TK, *experts.parameters()]
    for a, b in zip(torch.autograd.grad(y_TD, inputs, grad), torch.autograd.grad(reference, inputs, grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_undefined_rows_past_the_kept_ones_reach_no_gradient():
    """The grouped GEMM leaves rows past the kept ones undefined (on the GPU: any value, NaN included); a stand-in
    that puts NaN there must leave the output and every gradient finite."""

    def poisoned_experts(x_ND, counts_E, scale_N):
        computed = torch.arange(x_ND.shape[0]) < counts_E.sum()
        return torch.where(computed[:, None], x_ND, float("nan")) * scale_N[:, None]

    x_TD, experts_TK, keep_TK, weights_TK = _routing(2, drop=True)
    assert not keep_TK.all()
    y_TD = LocalDispatcher().route(poisoned_experts, x_TD, weights_TK, experts_TK, keep_TK, E)
    y_TD.sum().backward()
    assert y_TD.isfinite().all() and x_TD.grad.isfinite().all() and weights_TK.grad.isfinite().all()
    assert (weights_TK.grad[~keep_TK] == 0).all()
