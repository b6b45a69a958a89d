"""moelab.model.fp8_kernel's tiled kernel under Triton's CPU interpreter: the same e4m3 bytes and scales as
moelab.model.fp8's forward and dgrad operands, for bf16 weights, fp32 weights rounded to bf16 first, and fp32 weights as they
are; shapes off the kernel's blocks; written into the FP8 expert weight cache's buffers by its refresh.

The interpreter has to be on before triton is imported (triton.language's own jit helpers, e.g. tl.max's, are
decorated at import), so test_under_the_interpreter runs this file's other tests in a subprocess with
TRITON_INTERPRET=1; in this process they are skipped."""
import os

import pytest
import torch

from moelab.model.fp8 import dgrad_operand, forward_operand, quantize_expert_weight
from support import pytest_under_interpreter

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
inner = pytest.mark.skipif(not INTERPRETED, reason="run by test_under_the_interpreter (TRITON_INTERPRET=1)")


def test_under_the_interpreter():
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("this is the subprocess")
    n_run = 18 + 2 + 1 + 1  # the inner tests and test_kernel_does_not_apply_on_cpu_without_the_interpreter
    pytest_under_interpreter(__file__, n_run, timeout=600)


def test_kernel_does_not_apply_on_cpu_without_the_interpreter(monkeypatch):
    from moelab.model.fp8_kernel import kernel_applies

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not kernel_applies(torch.zeros(2, 4, 4))
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernel_applies(torch.zeros(2, 4, 4), torch.bfloat16)  # fp32 weights, bf16 compute: rounded in the kernel
    assert not kernel_applies(torch.zeros(2, 4, 4, dtype=torch.float16), torch.bfloat16)  # fp16 -> bf16: torch's
    assert not kernel_applies(torch.zeros(4, 4))


def weights(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, K, N = shape
    # columns over six decades, one all-zero column, values that land on e4m3 ties and on bf16 ties
    w = torch.randn(E, K, N, generator=g) * torch.logspace(-3, 3, N)[None, None, :]
    w[0, :, 1] = 0.0
    w[-1, 0, :] = 448.0 * w[-1, 1:, :].abs().amax(0) / 300.0  # the column's amax: scale 2^0 after /448
    w[-1, 1, :] = w[-1, 0, :] * (108.0 / 448.0)  # halfway between e4m3 104 and 112
    w[-1, 2, :] = -w[-1, 0, :] * 1e-6  # negative values that round to -0 (a different byte from +0)
    return w.to(dtype)


def same_bytes(a, b) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


OPERAND = {-2: forward_operand, -1: dgrad_operand}


@inner
@pytest.mark.parametrize("dim", [-2, -1], ids=["forward", "dgrad"])
@pytest.mark.parametrize("shape", [(3, 130, 70), (2, 64, 64), (1, 7, 129)])
@pytest.mark.parametrize("dtype,compute", [(torch.bfloat16, None), (torch.float32, torch.bfloat16),
                                           (torch.float32, None)])
def test_kernel_equals_the_operand(dim, shape, dtype, compute):
    from moelab.model.fp8_kernel import kernel_applies, quantize_weight_kernel

    w = weights(shape, dtype)
    if dim == -1:  # the dgrad operand reduces along N: make N carry the ties, the zeros and the decades
        w = weights((shape[0], shape[2], shape[1]), dtype).transpose(-2, -1).contiguous()
    assert kernel_applies(w)
    q, s = quantize_weight_kernel(w, dim, compute)
    ref_q, ref_s = OPERAND[dim](w.to(compute or dtype))
    assert same_bytes(q, ref_q)
    assert torch.equal(s, ref_s)


@inner
@pytest.mark.parametrize("dim", [-2, -1], ids=["forward", "dgrad"])
def test_kernel_writes_into_the_operands_buffers(dim):
    from moelab.model.fp8_kernel import quantize_weight_kernel

    w = weights((2, 96, 80), torch.bfloat16, seed=1)
    q0, s0 = OPERAND[dim](torch.zeros_like(w))
    q, s = quantize_weight_kernel(w, dim, None, out=(q0, s0))
    assert q is q0 and s is s0
    ref_q, ref_s = OPERAND[dim](w)
    assert same_bytes(q0, ref_q) and torch.equal(s0, ref_s)
    with pytest.raises(ValueError, match="not the e4m3 operand"):
        quantize_weight_kernel(w, dim, None, out=(q0.contiguous().transpose(-2, -1).contiguous(), s0))
    with pytest.raises(ValueError, match="dim=0"):
        quantize_weight_kernel(w, 0)


@inner
def test_weight_cache_refresh_uses_the_kernel(monkeypatch):
    """ExpertWeightCache's refresh writes both operands by the kernel (as on CUDA), the first time into new
    buffers and then in place: the buffers equal quantize_expert_weight's operands of the new weights, for fp32
    weights computed in bf16."""
    from torch import nn

    from moelab.model import fp8_cache
    from moelab.model.experts import GroupedExperts
    from moelab.model.fp8_cache import ExpertWeightCache

    calls = []
    real = fp8_cache.quantize_weight_kernel
    monkeypatch.setattr(fp8_cache, "quantize_weight_kernel", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    experts = GroupedExperts(4, 48, 40)
    nn.init.normal_(experts.w_gate_up_EDF2)
    nn.init.normal_(experts.w_down_EFD)
    cache = ExpertWeightCache(experts)
    cache.refresh(torch.bfloat16)
    first = [t for ops in cache.buffers for t in ops]
    with torch.no_grad():
        experts.w_gate_up_EDF2.mul_(-3.0)
        experts.w_down_EFD.add_(0.5)
    cache.refresh(torch.bfloat16)
    assert cache.valid and calls == [-2, -1] * 4 and ExpertWeightCache.error is None
    assert all(a is b for a, b in zip(first, [t for ops in cache.buffers for t in ops]))  # in place
    for w, bufs in zip((experts.w_gate_up_EDF2, experts.w_down_EFD), cache.buffers):
        ref = quantize_expert_weight(w.detach().to(torch.bfloat16))
        assert same_bytes(bufs[0], ref[0]) and same_bytes(bufs[2], ref[2])
        assert torch.equal(bufs[1], ref[1]) and torch.equal(bufs[3], ref[3])
