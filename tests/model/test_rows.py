"""moelab.model.rows: the dispatch and unsort moves equal the indexing they replace, values and gradients."""
import torch

from moelab.model.rows import dispatch_rows, inverse_permutation, unsort_rows


def _routing(T=12, K=3, E=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    experts_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    order_N = torch.argsort(experts_TK.reshape(-1), stable=True)
    return order_N, inverse_permutation(order_N)


def test_inverse_permutation():
    order_N, inverse_N = _routing()
    assert torch.equal(order_N[inverse_N], torch.arange(order_N.shape[0]))
    assert torch.equal(inverse_N, torch.argsort(order_N))


def test_dispatch_and_unsort_equal_indexing_with_gradients():
    T, K, D = 12, 3, 8
    order_N, inverse_N = _routing(T, K)
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    w = torch.randn(T * K, D, dtype=torch.float64)
    rows = dispatch_rows(x, order_N, inverse_N, K)
    rows_ref = x_ref[order_N // K]
    assert torch.equal(rows, rows_ref)
    y = unsort_rows(rows * w, order_N, inverse_N)
    y_ref = torch.empty_like(rows_ref).index_copy(0, order_N, rows_ref * w)
    assert torch.equal(y, y_ref)
    g = torch.randn(T * K, D, dtype=torch.float64)
    (dx,) = torch.autograd.grad(y, (x,), g)
    (dx_ref,) = torch.autograd.grad(y_ref, (x_ref,), g)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-15, atol=1e-15)


def test_gradients_are_gathers_not_scatter_adds():
    T, K, D = 12, 3, 8
    order_N, inverse_N = _routing(T, K)
    x = torch.randn(T, D, requires_grad=True)
    y = unsort_rows(dispatch_rows(x, order_N, inverse_N, K), order_N, inverse_N)
    ops = []

    class Record(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        y.sum().backward()
    assert not [o for o in ops if "index_put" in o or "scatter" in o or "index_add" in o], ops
