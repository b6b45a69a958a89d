"""moelab.backends.grad_norm under Triton's CPU interpreter (TRITON_INTERPRET=1, in a subprocess): each gradient's
sum of squares in fp32, whether the kernel or torch's foreach norm takes it (large dense ones in any dimension order,
the rest: small, strided); one process's clip_grad_norm then clips by that norm with torch's formula. Without the
interpreter a CPU run keeps torch's clip_grad_norm_ itself (the golden losses stay bit-identical)."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

CHECK = textwrap.dedent('''
    import torch
    from torch import nn
    import moelab.backends.grad_norm as G
    from moelab.parallel.place import Parallelized

    torch.manual_seed(0)
    G.MIN_NUMEL = 1000
    grads = [torch.randn(3000, dtype=torch.bfloat16) * 3, torch.randn(10), torch.randn(40, 50).t(),
             torch.randn(70000), torch.randn(60, 60)[:, :30], torch.randn(2, 33000, dtype=torch.bfloat16)]
    on = [G.on_kernel(g) for g in grads]
    assert on == [True, False, True, True, False, True], on
    got = G.squared_norms(grads)
    want = torch.stack([g.double().square().sum() for g in grads])
    assert got.dtype == torch.float32 and got.shape == (len(grads),)
    assert torch.allclose(got.double(), want, rtol=1e-5), (got, want)

    # one process's clip_grad_norm: the norm above, and torch's clipping formula applied with it
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 3))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 10
    before = [p.grad.clone() for p in model.parameters()]
    total = Parallelized.clip_grad_norm(None, model, 1.0)
    norm = torch.stack([g.double().square().sum() for g in before]).sum().sqrt()
    assert abs(float(total) - float(norm)) <= 1e-5 * float(norm)
    coef = 1.0 / (float(total) + 1e-6)
    assert all(torch.allclose(p.grad, b * coef, rtol=1e-6) for p, b in zip(model.parameters(), before))
    print("ok")
''')


def test_squared_norms_and_clipping_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_a_cpu_run_clips_as_torchs_clip_grad_norm(monkeypatch, max_norm, dtype):
    """The norm is torch's get_total_norm off the kernel devices, and the multiply (grad_norm.scale_grads) leaves
    every gradient bitwise as torch's clip_grad_norm_ does, in each dtype."""
    from moelab.backends import grad_norm
    from moelab.parallel.place import Parallelized

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(grad_norm, "MIN_NUMEL", 1)  # every gradient large enough: still not on a kernel device
    torch.manual_seed(0)
    model, ref = nn.Linear(32, 16).to(dtype), nn.Linear(32, 16).to(dtype)
    for p, q in zip(model.parameters(), ref.parameters()):
        p.grad = torch.randn_like(p) * 5
        q.grad = p.grad.clone()
    total = Parallelized.clip_grad_norm(None, model, max_norm)
    grads = [q.grad for q in ref.parameters()]
    want = (torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm, foreach=True) if max_norm
            else torch.nn.utils.get_total_norm(grads, foreach=True))
    assert torch.equal(total, want)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    if max_norm:
        assert float(total) > max_norm, "the case clips: the factor is below one"


def test_scale_grads_multiplies_each_dtype_as_clip_grads_with_norm_():
    """Gradients of several dtypes in one call (one foreach multiply each), a factor whose fp16 rounding changes
    the products: bitwise torch's clip_grads_with_norm_ on the CPU, which multiplies by the fp32 factor itself (on
    CUDA torch rounds it to the gradient's dtype first: gallery/scripts/gpu_check_clip.py checks that branch)."""
    from moelab.backends.grad_norm import scale_grads

    torch.manual_seed(0)
    grads = [torch.randn(300, 7).to(d) for d in (torch.bfloat16, torch.float32, torch.float16, torch.bfloat16)]
    grads[1] = grads[1].t()
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    total = torch.tensor(3.14159274)
    coef = torch.clamp(1.0 / (total + 1e-6), max=1.0)
    rounded_first = (grads[2].float() * coef.to(torch.float16).float()).to(torch.float16)
    torch.nn.utils.clip_grads_with_norm_(params, 1.0, total, foreach=True)
    scale_grads(grads, coef)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    assert not torch.equal(grads[2], rounded_first), "the CPU's products are with the fp32 factor"


def test_the_norm_takes_the_sums_the_backward_recorded_and_reads_the_rest():
    """A backward that wrote a parameter's gradient whole inside squares_in_backward may record its sum of squares
    (SonicMoE's weight-gradient GEMMs do, on the GPU); the norm takes that sum for it, computes the others, and the
    records are used once."""
    import moelab.backends.grad_norm as G

    a, b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(3))
    assert not G.wants_squares(a), "outside squares_in_backward"
    with G.squares_in_backward(True):
        assert G.wants_squares(a)
        with G.squares_in_backward(False):  # nested: the inner setting holds inside it
            assert not G.wants_squares(a)
        assert G.wants_squares(a)
        G.record_squares(a, torch.tensor(100.0))  # not a's gradient's: the norm must read the record
    assert not G.wants_squares(a), "restored on exit"
    a.grad, b.grad = torch.full((4,), 2.0), torch.full((3,), 3.0)
    assert not G.wants_squares(a) and not G.wants_squares(torch.ones(2)), "a gradient to add to; not a parameter"
    with G.squares_in_backward(True):
        assert not G.wants_squares(a), "autograd adds to the gradient after the backward made its part"
        assert G.wants_squares(a, adds_in_epilogue=True), "the kernel adds .grad and stores the sum: the final one"
    assert G.param_squared_norms([b, a]).tolist() == pytest.approx([27.0, 100.0])
    assert G.param_squared_norms([b, a]).tolist() == pytest.approx([27.0, 16.0]), "a record counts for one step only"
    G.record_squares(torch.nn.Parameter(torch.ones(4)), torch.tensor(5.0))  # another parameter's: not a's
    assert G.param_squared_norms([a]).tolist() == pytest.approx([16.0])
    hooked = nn.Parameter(torch.ones(2))
    hooked.register_post_accumulate_grad_hook(lambda p: None)
    with G.squares_in_backward(True):
        assert not G.wants_squares(hooked), "a hook may change the gradient after it is written"
