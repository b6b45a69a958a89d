"""moelab.model.fused_experts (backend.experts=triton_fused) under Triton's CPU interpreter: the forward and every
gradient (tokens, routing weights, both expert weights) against the reference experts (moelab.model.experts'
per-expert loop between dispatch_rows and combine_rows), at shapes off the kernels' 16-row blocks, with experts that
get no rows, through the MoE layer's LocalDispatcher, and traced by torch.compile (aot_eager: the custom ops' fake
and autograd registrations; inductor keeps the ops whole).

fp32 throughout: the interpreter's tl.dot is a numpy fp32 matmul, so the kernels and the reference differ only in
summation order (sums of at most 2F = 80 terms, fp32: a few ulp of the largest partial sum), hence rtol/atol 1e-5
on values of order 1. bf16 is checked on the GPU (gallery/scripts/gpu_moe_layer.py).

The interpreter has to be on before triton is imported, so test_under_the_interpreter runs this file's other
tests in a subprocess with TRITON_INTERPRET=1 (as tests/model/test_fp8_kernel.py does)."""
import os

import pytest
import torch

from moelab.config.schema import BackendConfig, MoEConfig
from moelab.model.experts import loop_swiglu, swiglu
from moelab.model.moe import MoE
from moelab.model.rows import combine_rows, dispatch_rows, inverse_permutation
from support import pytest_under_interpreter

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
inner = pytest.mark.skipif(not INTERPRETED, reason="run by test_under_the_interpreter (TRITON_INTERPRET=1)")
TOL = dict(rtol=1e-5, atol=1e-5)


def test_under_the_interpreter():
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("this is the subprocess")
    n_run = 3 + 1 + 1 + 2 + 1 + 1  # the inner tests, test_not_applied_on_cpu_without_the_interpreter, the lean ones
    pytest_under_interpreter(__file__, n_run)


def test_not_applied_on_cpu_without_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    from moelab.model.fused_experts import fused_applies

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not fused_applies(torch.zeros(2, 4))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused_applies(torch.zeros(2, 4))


def problem(T, K, E, D, F, used, seed=0):
    """Tokens, routing weights, experts drawn from the first `used` of E (the rest get no rows), weights."""
    g = torch.Generator().manual_seed(seed)
    x_TD = torch.randn(T, D, generator=g)
    weights_TK = torch.softmax(torch.randn(T, K, generator=g), -1)
    experts_TK = torch.rand(T, used, generator=g).topk(K, dim=1).indices
    w1 = torch.randn(E, D, 2 * F, generator=g) / D ** 0.5
    w2 = torch.randn(E, F, D, generator=g) / F ** 0.5
    return x_TD, weights_TK, experts_TK, w1, w2


def reference(x_TD, weights_TK, experts_TK, w1, w2):
    E, K = w1.shape[0], experts_TK.shape[1]
    order_N = torch.argsort(experts_TK.reshape(-1), stable=True)
    inverse_N = inverse_permutation(order_N)
    counts_E = torch.bincount(experts_TK.reshape(-1), minlength=E)
    y_ND = loop_swiglu(dispatch_rows(x_TD, order_N, inverse_N, K), w1, w2, counts_E, act=swiglu,
                       scale_N=weights_TK.reshape(-1)[order_N])
    return combine_rows(y_ND, order_N, inverse_N, K)


def value_and_grads(fn, *inputs, seed=1):
    leaves = [t.clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)))
    return [y.detach()] + [t.grad for t in leaves]


@inner
@pytest.mark.parametrize("shape", [(37, 2, 6, 48, 40, 3), (16, 4, 4, 32, 16, 4), (50, 1, 5, 16, 24, 5)],
                         ids=["off-blocks-empty-experts", "one-block", "top1"])
def test_matches_the_reference_experts(shape):
    from moelab.model.fused_experts import fused_experts

    T, K, E, D, F, used = shape
    x_TD, weights_TK, experts_TK, w1, w2 = problem(T, K, E, D, F, used)
    order_N = torch.argsort(experts_TK.reshape(-1), stable=True)
    counts_E = torch.bincount(experts_TK.reshape(-1), minlength=E)
    got = value_and_grads(lambda x, w, a, b: fused_experts(x, w, a, b, order_N, counts_E), x_TD, weights_TK, w1, w2)
    want = value_and_grads(lambda x, w, a, b: reference(x, w, experts_TK, a, b), x_TD, weights_TK, w1, w2)
    for name, a, b in zip(["y", "dx", "dweights", "dw_gate_up", "dw_down"], got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    assert not got[3][used:].any() and not got[4][used:].any()  # experts without rows: zero gradients


def route(impl):
    """The MoE layer's experts step as the model runs it (MoE.routed: LocalDispatcher.route between the router
    and the shared experts) with GroupedExperts.impl = impl, as moelab.backends.apply_backends sets it."""
    E, D, F = 6, 32, 24

    def fn(x_TD, weights_TK, w1, w2, experts_TK):
        moe = MoE(D, MoEConfig(num_experts=E, top_k=experts_TK.shape[1], expert_ffn_size=F), BackendConfig())
        moe.experts.impl = impl
        moe.experts.w_gate_up_EDF2, moe.experts.w_down_EFD = torch.nn.Parameter(w1), torch.nn.Parameter(w2)
        y_BLD = moe.routed(x_TD[None], weights_TK, experts_TK, None, torch.zeros(()))
        return y_BLD[0], moe.experts
    return fn


def graph_ops(y: torch.Tensor) -> set[str]:
    """The names of the autograd nodes behind y."""
    seen, stack = set(), [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node.name() not in seen:
            seen.add(node.name())
            stack += [f for f, _ in node.next_functions]
    return seen


@inner
def test_the_layer_routes_tokens_through_the_kernels_when_asked():
    x_TD, weights_TK, experts_TK, w1, w2 = problem(29, 2, 6, 32, 24, 4)
    outs = {}
    for impl in ("loop", "triton_fused"):
        leaves = [t.clone().requires_grad_() for t in (x_TD, weights_TK)]
        y, experts = route(impl)(*leaves, w1.clone(), w2.clone(), experts_TK)
        # the kernels' op, not the sorted rows' path (a wrapped experts call once hid the impl from the dispatcher)
        assert any("fused_experts" in n for n in graph_ops(y)) == (impl == "triton_fused"), graph_ops(y)
        y.backward(torch.ones_like(y))
        outs[impl] = [y.detach(), *(t.grad for t in leaves), experts.w_gate_up_EDF2.grad, experts.w_down_EFD.grad]
    for a, b in zip(outs["triton_fused"], outs["loop"]):
        torch.testing.assert_close(a, b, **TOL)


@inner
def test_compiled_matches_eager():
    from moelab.model.fused_experts import fused_experts

    x_TD, weights_TK, experts_TK, w1, w2 = problem(33, 2, 4, 32, 16, 4)

    def fn(x, w, a, b):
        order_N = torch.argsort(experts_TK.reshape(-1), stable=True)
        return fused_experts(x, w, a, b, order_N, torch.bincount(experts_TK.reshape(-1), minlength=4))
    eager = value_and_grads(fn, x_TD, weights_TK, w1, w2)
    torch._dynamo.reset()
    compiled = value_and_grads(torch.compile(fn, backend="aot_eager", fullgraph=True), x_TD, weights_TK, w1, w2)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def micro_batches(fn, w1, w2, batches, hook=False):
    """The weights' gradients after one backward per micro batch (x, weights, experts), autograd accumulating
    across them as a training step does; with `hook`, a post-accumulate-grad hook on each weight (counted)."""
    a, b = torch.nn.Parameter(w1.clone()), torch.nn.Parameter(w2.clone())
    calls = []
    if hook:
        for w in (a, b):
            w.register_post_accumulate_grad_hook(lambda w: calls.append(1))
    for i, (x_TD, weights_TK, experts_TK) in enumerate(batches):
        y = fn(x_TD, weights_TK, experts_TK, a, b)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(10 + i)))
    return a.grad, b.grad, len(calls)


def fused(x, w, experts_TK, a, b):
    from moelab.model.fused_experts import fused_experts

    order_N = torch.argsort(experts_TK.reshape(-1), stable=True)
    return fused_experts(x, w, a, b, order_N, torch.bincount(experts_TK.reshape(-1), minlength=a.shape[0]))


@inner
def test_later_micro_batches_add_into_grad_in_the_kernels(monkeypatch):
    # from the second micro batch on, the weight-gradient kernels start from .grad and write the sum into it:
    # the autograd op's backward (_bwd, which returns fresh gradients) runs once, for the first micro batch only;
    # the sums match the reference's autograd accumulation (fp32: the same products, the old gradient added first
    # instead of last, a few ulp: TOL)
    import moelab.model.fused_experts as fe

    batches = [problem(37, 2, 6, 48, 40, 5, seed=s)[:3] for s in range(3)]
    _, _, _, w1, w2 = problem(37, 2, 6, 48, 40, 5)
    op_calls = []
    op = fe._bwd
    monkeypatch.setattr(fe, "_bwd", lambda *a: op_calls.append(1) or op(*a))
    got1, got2, _ = micro_batches(fused, w1, w2, batches)
    assert len(op_calls) == 1
    want1, want2, _ = micro_batches(lambda x, w, e, a, b: reference(x, w, e, a, b), w1, w2, batches)
    torch.testing.assert_close(got1, want1, **TOL)
    torch.testing.assert_close(got2, want2, **TOL)


@inner
def test_weights_with_hooks_keep_autograds_accumulation(monkeypatch):
    # a post-accumulate-grad hook (FSDP's, an optimizer-in-backward's) must see every micro batch's accumulation:
    # such weights get their gradients from the op and autograd adds them, hooks called once per micro batch
    import moelab.model.fused_experts as fe

    batches = [problem(29, 2, 6, 32, 24, 4, seed=s)[:3] for s in range(2)]
    _, _, _, w1, w2 = problem(29, 2, 6, 32, 24, 4)
    op_calls = []
    op = fe._bwd
    monkeypatch.setattr(fe, "_bwd", lambda *a: op_calls.append(1) or op(*a))
    got1, got2, hooks = micro_batches(fused, w1, w2, batches, hook=True)
    assert len(op_calls) == 2 and hooks == 4
    want1, want2, _ = micro_batches(lambda x, w, e, a, b: reference(x, w, e, a, b), w1, w2, batches)
    torch.testing.assert_close(got1, want1, **TOL)
    torch.testing.assert_close(got2, want2, **TOL)
    # with a process group up (DDP's reducer hooks the accumulator node, out of sight), autograd accumulates too
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    got1, got2, hooks = micro_batches(fused, w1, w2, batches)
    assert len(op_calls) == 4 and hooks == 0
    torch.testing.assert_close(got1, want1, **TOL)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm")
def test_lean_grouped_experts_match_the_reference():
    # the same saved tensors through torch._grouped_mm (fp32 eager on CPU, 16-byte aligned widths; traced, its meta
    # function takes bf16 only: compiled, it is checked on the GPU by gallery/scripts/gpu_moe_layer.py)
    from moelab.model.fused_experts import lean_grouped_experts

    x_TD, weights_TK, experts_TK, w1, w2 = problem(37, 2, 6, 48, 40, 3)
    order_N = torch.argsort(experts_TK.reshape(-1), stable=True)
    counts_E = torch.bincount(experts_TK.reshape(-1), minlength=6)

    def fn(x, w, a, b):
        return lean_grouped_experts(x, w, a, b, order_N, counts_E)
    got = value_and_grads(fn, x_TD, weights_TK, w1, w2)
    want = value_and_grads(lambda x, w, a, b: reference(x, w, experts_TK, a, b), x_TD, weights_TK, w1, w2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)
