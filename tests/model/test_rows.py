"""moelab.model.rows: the dispatch and combine moves equal the indexing they replace, values and gradients, in
both of sum_rows' forms (eager's gather-and-sum, compiled's K gathers added)."""
import pytest
import torch

from moelab.model import rows as rows_module
from moelab.model.rows import combine_rows, dispatch_rows, inverse_permutation, sum_rows


def _routing(T=12, K=3, E=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    experts_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    order_N = torch.argsort(experts_TK.reshape(-1), stable=True)
    return order_N, inverse_permutation(order_N)


def test_inverse_permutation():
    order_N, inverse_N = _routing()
    assert torch.equal(order_N[inverse_N], torch.arange(order_N.shape[0]))
    assert torch.equal(inverse_N, torch.argsort(order_N))


@pytest.fixture(params=["eager", "compiled-form"])
def form(request, monkeypatch):
    """sum_rows' two forms: compiled-form runs the K-gathers branch eagerly (torch.compiler.is_compiling -> True)."""
    if request.param == "compiled-form":
        monkeypatch.setattr(rows_module.torch.compiler, "is_compiling", lambda: True)
    return request.param


def test_dispatch_and_combine_equal_indexing_with_gradients(form):
    T, K, D = 12, 3, 8
    order_N, inverse_N = _routing(T, K)
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    w = torch.randn(T * K, D, dtype=torch.float64)
    rows = dispatch_rows(x, order_N, inverse_N, K)
    rows_ref = x_ref[order_N // K]
    assert torch.equal(rows, rows_ref)
    y = combine_rows(rows * w, order_N, inverse_N, K)
    y_ref = torch.empty_like(rows_ref).index_copy(0, order_N, rows_ref * w).view(T, K, D).sum(1)
    torch.testing.assert_close(y, y_ref, rtol=1e-15, atol=1e-15)
    g = torch.randn(T, D, dtype=torch.float64)
    (dx,) = torch.autograd.grad(y, (x,), g)
    (dx_ref,) = torch.autograd.grad(y_ref, (x_ref,), g)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-15, atol=1e-15)


def test_sum_rows_accumulates_in_fp32_and_returns_the_dtype_asked(form):
    T, K, D = 16, 8, 32
    order_N, inverse_N = _routing(T, K, E=9, seed=1)
    rows_ND = torch.randn(T * K, D).to(torch.bfloat16)
    index_TK = inverse_N.view(T, K)
    exact = rows_ND.double()[index_TK.reshape(-1)].view(T, K, D).sum(1)
    for dtype in (torch.bfloat16, torch.float32):
        out = sum_rows(rows_ND, index_TK, dtype)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), exact, rtol=2 ** -8 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
    # fp32 accumulation: the bf16 result is the fp32 sum rounded once (not K roundings)
    assert torch.equal(sum_rows(rows_ND, index_TK, torch.bfloat16), sum_rows(rows_ND, index_TK, torch.float32).bfloat16())


def test_gradients_are_gathers_not_scatter_adds(form):
    T, K, D = 12, 3, 8
    order_N, inverse_N = _routing(T, K)
    x = torch.randn(T, D, requires_grad=True)
    y = combine_rows(dispatch_rows(x, order_N, inverse_N, K), order_N, inverse_N, K)
    ops = []

    class Record(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        y.sum().backward()
    assert not [o for o in ops if "index_put" in o or "scatter" in o or "index_add" in o], ops
