"""moelab.backends.into_grad: the embedding and the LM head whose backward adds the weight's gradient into .grad on a
later micro batch give autograd's gradients (the first micro batch exactly, the sums within one rounding), the
padding row none, a tied weight both terms; on CPU the modules run as they are."""
import pytest
import torch
from torch import nn

import moelab.backends.into_grad as G


def micro_batches(step, n=3):
    for i in range(n):
        step(i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_adds_later_micro_batches_into_grad(dtype, monkeypatch):
    torch.manual_seed(0)
    ref, head = nn.Linear(16, 40, bias=False).to(dtype), nn.Linear(16, 40, bias=False).to(dtype)
    head.weight.data.copy_(ref.weight.data)
    xs = [torch.randn(2, 5, 16, dtype=dtype) for _ in range(3)]
    gs = [torch.randn(2, 5, 40, dtype=dtype) for _ in range(3)]
    added, real = [], G.add_weight_grad

    def spy(*args):
        added.append(1)
        real(*args)
    monkeypatch.setattr(G, "add_weight_grad", spy)
    dx_ref, dx = [], []

    def step(i):
        x_r, x = xs[i].clone().requires_grad_(), xs[i].clone().requires_grad_()
        ref(x_r).backward(gs[i])
        y = G._Linear.apply(x, head.weight)
        assert torch.equal(y, ref(xs[i]))
        y.backward(gs[i])
        dx_ref.append(x_r.grad)
        dx.append(x.grad)
        if i == 0:  # autograd's own first gradient, written
            assert torch.equal(head.weight.grad, ref.weight.grad)
    micro_batches(step)
    assert len(added) == 2  # the later micro batches added in place
    assert all(torch.equal(a, b) for a, b in zip(dx, dx_ref))
    if dtype == torch.float32:
        torch.testing.assert_close(head.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-6)
    exact = sum((g.reshape(-1, 40).t().double() @ x.reshape(-1, 16).double()) for g, x in zip(gs, xs))
    # one rounding of the sum (bf16: ulps apart from autograd's): no further from the exact sum than autograd's
    err, err_ref = ((w.grad.double() - exact).abs().mean() for w in (head.weight, ref.weight))
    assert err <= err_ref * 1.001 + 1e-9


def test_linear_under_autocast_computes_in_the_autocast_dtype():
    head = nn.Linear(8, 12, bias=False)
    x = torch.randn(3, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = G._Linear.apply(x, head.weight)
        y_ref = head(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_ref)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and head.weight.grad.dtype == torch.float32


def test_embedding_adds_rows_into_grad_and_leaves_the_padding_row():
    torch.manual_seed(1)
    ref, emb = nn.Embedding(30, 8, padding_idx=3), nn.Embedding(30, 8, padding_idx=3)
    emb.weight.data.copy_(ref.weight.data)
    ids = [torch.tensor([[1, 3, 1, 7], [3, 29, 1, 0]]), torch.tensor([[5, 5, 5, 3], [0, 1, 2, 3]]),
           torch.tensor([[29, 29, 7, 7], [3, 3, 3, 3]])]
    gs = [torch.randn(2, 4, 8) for _ in range(3)]

    def step(i):
        ref(ids[i]).backward(gs[i])
        h = G._Embedding.apply(ids[i], emb.weight, 3)
        assert torch.equal(h, ref(ids[i]))
        h.backward(gs[i])
        if i == 0:
            assert torch.equal(emb.weight.grad, ref.weight.grad)
    micro_batches(step)
    torch.testing.assert_close(emb.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-6)
    assert not emb.weight.grad[3].any()


def test_a_tied_weight_gets_both_terms():
    torch.manual_seed(2)
    w_ref, w = nn.Parameter(torch.randn(20, 6)), nn.Parameter(torch.randn(20, 6))
    w.data.copy_(w_ref.data)
    for i in range(3):
        ids = torch.randint(0, 20, (2, 5))
        g = torch.randn(2, 5, 20)
        (torch.nn.functional.linear(torch.nn.functional.embedding(ids, w_ref).tanh(), w_ref) * g).sum().backward()
        (G._Linear.apply(G._Embedding.apply(ids, w, None).tanh(), w) * g).sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-5)


def test_on_cpu_the_modules_run_as_they_are():
    head, emb = nn.Linear(4, 9, bias=False), nn.Embedding(9, 4)
    ids = torch.tensor([[1, 2, 3]])
    h = G.embedding(emb, ids)
    y = G.linear(head, h)
    assert type(h.grad_fn).__name__ == "EmbeddingBackward0"
    assert type(y.grad_fn).__name__ != "_LinearBackward" and torch.equal(y, head(emb(ids)))
    assert not G.applies(head, h)


def test_linear_skips_the_input_gradient_nobody_asks_for():
    head = nn.Linear(8, 12, bias=False)
    x = torch.randn(3, 8)  # no grad: only the weight's
    G._Linear.apply(x, head.weight).sum().backward()
    torch.testing.assert_close(head.weight.grad, torch.ones(3, 12).t() @ x)


def test_a_frozen_head_gets_no_weight_gradient_computed(monkeypatch):
    # LoRA elsewhere leaves the head frozen: its backward gives the input's gradient and computes no g^T x
    head = nn.Linear(8, 12, bias=False).requires_grad_(False)
    x = torch.randn(3, 8, requires_grad=True)
    transposes, real = [], torch.Tensor.t
    monkeypatch.setattr(torch.Tensor, "t", lambda self: (transposes.append(1), real(self))[1])
    G._Linear.apply(x, head.weight).sum().backward()
    assert not transposes and head.weight.grad is None
    torch.testing.assert_close(x.grad, torch.ones(3, 12) @ head.weight)
