"""Grouped-GEMM experts agree with the reference loop, forward and backward."""
import pytest
import torch

from moelab.model.experts import GroupedExperts, grouped_mm_swiglu, loop_swiglu


def _inputs(E=4, D=16, F=8, N=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, requires_grad=True)
    w1 = torch.randn(E, D, 2 * F, generator=g, requires_grad=True)
    w2 = torch.randn(E, F, D, generator=g, requires_grad=True)
    counts = torch.bincount(torch.randint(E, (N,), generator=g), minlength=E)
    return x, w1, w2, counts


@pytest.mark.parametrize("empty_expert", [False, True])
def test_grouped_mm_matches_loop_forward_and_backward(empty_expert):
    x, w1, w2, counts = _inputs()
    if empty_expert:  # an expert that receives no token must not break the offsets
        counts = torch.tensor([10, 0, 20, 7])
    grad_out = torch.randn(x.shape[0], x.shape[1])
    outs, grads = [], []
    for fn in (grouped_mm_swiglu, loop_swiglu):
        for t in (x, w1, w2):
            t.grad = None
        y = fn(x, w1, w2, counts)
        y.backward(grad_out)
        outs.append(y.detach())
        grads.append([t.grad.clone() for t in (x, w1, w2)])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_auto_picks_loop_when_grouped_mm_cannot_run():
    # 2F = 6 floats = 24 bytes: not 16-byte aligned, so "auto" must take the loop and still be right
    experts = GroupedExperts(3, 8, 3, impl="auto")
    torch.nn.init.normal_(experts.w_gate_up_EDF2)
    torch.nn.init.normal_(experts.w_down_EFD)
    x = torch.randn(9, 8)
    counts = torch.tensor([2, 3, 4])
    ref = loop_swiglu(x, experts.w_gate_up_EDF2, experts.w_down_EFD, counts)
    torch.testing.assert_close(experts(x, counts), ref)


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
def test_routing_weights_scale_the_expert_output_linearly(impl):
    """Each row weighted before the down projection, its down bias and the LoRA down adapter (which reads the same
    weighted activation) included: the output and every gradient, the weights' own included, are those of
    w * experts(x)."""
    from moelab.model.lora import add_expert_adapters

    E, D, F, N = 4, 16, 8, 37
    experts = GroupedExperts(E, D, F, impl=impl, bias=True, activation="gpt_oss")
    add_expert_adapters(experts, rank=4, alpha=8.0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(N, D, generator=g, requires_grad=True)
    w = torch.rand(N, generator=g, requires_grad=True)
    counts, grad = torch.tensor([10, 0, 20, 7]), torch.randn(N, D, generator=g)
    inputs = [x, w, *experts.parameters()]
    weighted = experts(x, counts, w)
    reference = experts(x, counts) * w[:, None]
    torch.testing.assert_close(weighted, reference)
    for a, b in zip(torch.autograd.grad(weighted, inputs, grad), torch.autograd.grad(reference, inputs, grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
