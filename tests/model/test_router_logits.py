"""The router's logits (moelab.model.router.router_logits): bf16 operands give the fp32 matmul's values and
gradients, keep x in bf16 (not an fp32 copy), and a frozen router keeps no input."""
import torch
import torch.nn.functional as F

from moelab.model.router import _grad_mm, _split_bf16, router_logits


def _operands(T=64, D=96, E=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16).requires_grad_()
    w = (0.1 * torch.randn(E, D, generator=g)).to(torch.bfloat16).requires_grad_()
    b = torch.randn(E, generator=g).to(torch.bfloat16).requires_grad_()
    return x, w, b


def test_bf16_logits_and_gradients_equal_the_fp32_matmul_of_the_same_values():
    x, w, b = _operands()
    g_TE = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    out = router_logits(x, w, b)
    assert out.dtype == torch.float32
    dx, dw, db = torch.autograd.grad(out, (x, w, b), g_TE)
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    ref = F.linear(x2.float(), w2.float(), b2.float())
    rdx, rdw, rdb = torch.autograd.grad(ref, (x2, w2, b2), g_TE)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for got, want in ((dx, rdx), (dw, rdw), (db, rdb)):
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_split_gradient_matmul_keeps_about_fp32_accuracy():
    # the CUDA path: the fp32 gradient as two bf16 terms through bf16 GEMMs (emulated on CPU by their exact values)
    g = torch.Generator().manual_seed(2)
    grad_TE = torch.randn(256, 16, generator=g) * torch.logspace(-3, 1, 16)
    w_ED = torch.randn(16, 64, generator=g).to(torch.bfloat16)
    exact = grad_TE.double() @ w_ED.double()
    split = _grad_mm(grad_TE, w_ED, split=True)
    one_term = grad_TE.to(torch.bfloat16).float() @ w_ED.float()
    err = lambda t: ((t.double() - exact).norm() / exact.norm()).item()
    assert err(split) < 1e-5
    assert err(one_term) > 10 * err(split)  # one bf16 term would not do


def test_the_split_keeps_its_second_term_when_compiled():
    # inductor keeps a bf16 round trip in fp32: a split written as lo = g - float(bf16(g)) had lo = 0 compiled, and
    # the router's compiled gradients were bf16-accurate only (gpu_check_router_loss.py, 2026-12-02)
    g = torch.randn(128, 32, generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    for split in (_split_bf16, torch.compile(_split_bf16, dynamic=False)):
        hi, lo = split(g)
        assert hi.dtype == lo.dtype == torch.bfloat16 and lo.abs().max() > 0
        assert ((hi.float() + lo.float() - g).norm() / g.norm()).item() < 2e-5


def test_router_keeps_x_in_bf16_and_a_frozen_router_keeps_no_input():
    x, w, _ = _operands()
    out = router_logits(x, w)
    kept = [t for t in out.grad_fn.saved_tensors if t is not None]
    assert {t.dtype for t in kept} == {torch.bfloat16}
    assert any(t.data_ptr() == x.data_ptr() for t in kept)
    w.requires_grad_(False)
    frozen = router_logits(x, w)
    kept = [t for t in frozen.grad_fn.saved_tensors if t is not None]
    assert all(t.data_ptr() != x.data_ptr() for t in kept)
    (dx,) = torch.autograd.grad(frozen.sum(), (x,))
    torch.testing.assert_close(dx, (torch.ones(64, 8) @ w.float()).to(torch.bfloat16), rtol=0, atol=0)


def test_fp32_operands_take_the_fp32_path():
    x, w, _ = _operands()
    out = router_logits(x.detach().float(), w.detach().float())
    torch.testing.assert_close(out, x.detach().float() @ w.detach().float().t(), rtol=0, atol=0)
