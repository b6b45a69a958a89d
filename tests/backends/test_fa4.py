"""backend.attention=fa4 and auto's choice of it (moelab.backends.fa4, moelab.backends.auto_attention).

FlashAttention-4's kernels run on sm90 / sm100 GPUs only: here the custom ops' shapes, layouts and autograd wiring are
checked under fake tensors, and the switchboard's choices on this CPU machine; the kernels' values against SDPA,
forward and every gradient, eager and compiled, are gallery/scripts/gpu_attention.py's check (a device call)."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from moelab.backends import BackendUnavailable, auto_attention, check_backends, detected, unsupported_reason
from moelab.backends.fa4 import fa4_causal_attention
from moelab.config import load_config
from moelab.model.attention import GQAttention, attention_path
from moelab.model.layers import rope_cos_sin

B, L, H, G, DH = 2, 64, 8, 2, 32


def _qkv_BHLD(fake: FakeTensorMode):
    with fake:  # (B, L, heads, Dh) projections seen as (B, heads, L, Dh), as GQAttention hands them over
        q = torch.empty(B, L, H, DH, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        k = torch.empty(B, L, G, DH, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        v = torch.empty(B, L, G, DH, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    return q, k, v


def test_the_forward_op_returns_the_output_and_its_log_sum_exp_in_the_kernels_layouts():
    fake = FakeTensorMode()
    q, k, v = _qkv_BHLD(fake)
    with fake:
        out, lse = torch.ops.moelab.fa4_causal(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.5)
    assert out.shape == (B, L, H, DH) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert lse.shape == (B, H, L) and lse.dtype == torch.float32


def test_the_backward_op_gives_each_gradient_its_inputs_shape_and_strides():
    fake = FakeTensorMode()
    q, k, v = _qkv_BHLD(fake)
    with fake:
        q_BLHD, k_BLGD, v_BLGD = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out, lse = torch.ops.moelab.fa4_causal(q_BLHD, k_BLGD, v_BLGD, 0.5)
        dq, dk, dv = torch.ops.moelab.fa4_causal_backward(out, q_BLHD, k_BLGD, v_BLGD, out, lse, 0.5)
    for grad, x in ((dq, q_BLHD), (dk, k_BLGD), (dv, v_BLGD)):
        assert grad.shape == x.shape and grad.stride() == x.stride() and grad.dtype == x.dtype


def test_autograd_reaches_q_k_and_v_through_the_ops_in_sdpas_layout():
    fake = FakeTensorMode()
    q, k, v = _qkv_BHLD(fake)
    with fake:
        o_BHLD = fa4_causal_attention(q, k, v)
        assert o_BHLD.shape == (B, H, L, DH)
        o_BHLD.float().sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert q.grad.stride() == q.stride() and k.grad.stride() == k.stride()


def test_torch_compile_traces_the_op_into_the_blocks_graph():
    graphs = []

    def record(gm, example_inputs):  # the graph as dynamo hands it over; not run (no kernels on this machine)
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return lambda *args: (torch.zeros(()),)

    def block(q_BHLD, k_BGLD, v_BGLD):
        return fa4_causal_attention(q_BHLD * 2, k_BGLD, v_BGLD).float().sum()

    torch._dynamo.reset()
    q, k, v = (torch.randn(B, n, L, DH, dtype=torch.bfloat16) for n in (H, G, G))
    torch.compile(block, backend=record, fullgraph=True)(q, k, v)  # fullgraph: a graph break would raise
    assert len(graphs) == 1 and any("moelab.fa4_causal" in t for t in graphs[0])


def test_fa4_on_cpu_tensors_is_sdpa_bitwise():
    cfg = load_config("tiny")
    torch.manual_seed(0)
    sdpa = GQAttention(cfg.model, cfg.backend)
    fa4 = GQAttention(cfg.model, load_config("tiny", ["backend.attention=fa4"]).backend)
    fa4.load_state_dict(sdpa.state_dict())
    assert (sdpa.backend, fa4.backend) == ("sdpa", "fa4")
    assert attention_path("fa4", torch.device("cpu"), packed=False) == "sdpa"
    x_BLD = torch.randn(2, 16, cfg.model.hidden_size)
    cos_LD, sin_LD = rope_cos_sin(torch.arange(16), cfg.model.head_dim, cfg.model.rope_theta, x_BLD.dtype)
    assert torch.equal(sdpa(x_BLD, cos_LD, sin_LD), fa4(x_BLD, cos_LD, sin_LD))


def test_auto_is_sdpa_where_fa4_cannot_run():
    cfg = load_config("tiny")
    assert cfg.backend.attention == "auto"
    assert auto_attention(cfg, "cpu") == "sdpa"
    assert check_backends(cfg, "cpu")["attention"] == "sdpa"


@pytest.mark.parametrize("override, named", [
    (["parallel.cp=2"], "parallel.cp=2"),
    (["model.head_dim=48"], "model.head_dim=48"),
])
def test_fa4_names_what_it_does_not_take(override, named):
    cfg = load_config("tiny", ["backend.attention=fa4", *override])
    reason = unsupported_reason("fa4", cfg, "cuda")
    assert reason is not None and named in reason and "backend.attention=sdpa" in reason


def test_mla_models_keep_sdpa():
    cfg = load_config("deepseek-v3-proxy")
    assert "model.attention='mla'" in unsupported_reason("fa4", cfg, "cuda")
    assert auto_attention(cfg, "cuda") == "sdpa"


def test_asking_for_fa4_where_it_cannot_run_is_refused_with_the_fix():
    cfg = load_config("tiny", ["backend.attention=fa4"])
    with pytest.raises(BackendUnavailable) as e:
        check_backends(cfg, "cpu")
    assert "backend.attention='fa4'" in str(e.value) and "backend.attention='sdpa'" in str(e.value)
    if not detected()["fa4"]:
        assert "flash-attn-4" in str(e.value)
    with pytest.warns(RuntimeWarning, match="falling back"):
        assert check_backends(load_config("tiny", ["backend.attention=fa4", "backend.fallback=true"]),
                              "cpu")["attention"] == "sdpa"
