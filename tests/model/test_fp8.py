"""train.fp8=rowwise on CPU: the quantisation and scaling math, and the autograd wiring of the FP8 GEMMs
(moelab.model.fp8) against references built here from dequantised operands in fp32, gradients included; the
model conversion; the refusals. The CUDA kernels are checked against the same emulation on the GPU
(gallery/scripts/gpu_perf_fp8check.py)."""
import pytest
import torch
from torch import nn

from moelab.config import ConfigError, load_config
from moelab.model import fp8, fp8_convert
from moelab.model.fp8 import E4M3_MAX, FP8Linear, fp8_grouped_mm, fp8_linear, quantize_rowwise
from moelab.model.fp8_convert import enable_fp8


def rel(a, b):
    return float((a - b).norm() / b.norm())


def deq(x, dim):
    """Quantise x row-wise along `dim` and dequantise: the operand the FP8 GEMM multiplies."""
    q, s = quantize_rowwise(x.movedim(dim, -1), -1)
    return (q.float() * s).movedim(-1, dim)


def test_quantize_rowwise_scales_and_error():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-3, 3, 64)[:, None]  # rows over six decades
    x[5] = 0.0
    q, inv = quantize_rowwise(x, -1)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and inv.shape == (64, 1)
    assert inv.dtype == torch.float32 and torch.isfinite(inv).all()
    # power-of-two scales: dequantising is exact, and each row's amax lands in [224, 448] (rounded)
    assert torch.equal(torch.log2(inv), torch.round(torch.log2(inv)))
    amax_q = q.float().abs().amax(-1)
    nonzero = torch.arange(64) != 5
    assert (amax_q[nonzero] >= E4M3_MAX / 2).all() and (amax_q <= E4M3_MAX).all()
    # e4m3 keeps 3 mantissa bits: a relative rounding error of at most 2^-4 for values in the normal range
    back = q.float() * inv
    big = x.abs() > x.abs().amax(-1, keepdim=True) / 64
    assert ((back - x).abs()[big] <= x.abs()[big] * 2 ** -4 * 1.0001).all()
    assert torch.equal(back[5], torch.zeros(96))


def test_quantize_along_other_dim():
    x = torch.randn(16, 48)
    q, inv = quantize_rowwise(x, 0)
    assert inv.shape == (1, 48)
    assert rel(q.float() * inv, x) < 0.05


def test_fp8_linear_forward_and_grads_match_the_emulated_reference():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 32, 64, generator=g, requires_grad=True)
    w = (torch.randn(48, 64, generator=g) * 0.1).requires_grad_()
    b = torch.randn(48, generator=g, requires_grad=True)
    y = fp8_linear(x, w, b)
    gy = torch.randn(y.shape, generator=g)
    y.backward(gy)
    x2, g2 = x.detach().reshape(-1, 64), gy.reshape(-1, 48)
    # forward: both operands scaled along K; dgrad: g along N, w along N (its columns); wgrad: both along M
    y_ref = deq(x2, 1) @ deq(w.detach(), 1).t() + b.detach()
    dx_ref = deq(g2, 1) @ deq(w.detach(), 0)
    dw_ref = deq(g2, 0).t() @ deq(x2, 0)
    assert torch.allclose(y.reshape(-1, 48), y_ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(x.grad.reshape(-1, 64), dx_ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(w.grad, dw_ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(b.grad, g2.sum(0), atol=1e-5)
    # and all three are near the float GEMMs (e4m3: a few percent)
    assert rel(y.reshape(-1, 48), x2 @ w.detach().t() + b.detach()) < 0.08
    assert rel(x.grad.reshape(-1, 64), g2 @ w.detach()) < 0.08
    assert rel(w.grad, g2.t() @ x2) < 0.08


def test_fp8_grouped_mm_forward_and_grads():
    g = torch.Generator().manual_seed(2)
    counts = torch.tensor([7, 0, 21, 4, 0, 16])  # empty experts included
    E, K, N, M = len(counts), 32, 48, int(counts.sum())
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(M, K, generator=g, requires_grad=True)
    w = (torch.randn(E, K, N, generator=g) * 0.1).requires_grad_()
    y = fp8_grouped_mm(x, w, offs)
    gy = torch.randn(y.shape, generator=g)
    y.backward(gy)
    expert = torch.repeat_interleave(torch.arange(E), counts)
    xd, wd = x.detach(), w.detach()
    # forward: x along K, w along K per expert and column; dgrad: g along N, w along N; wgrad: float
    y_ref = torch.einsum("mk,mkn->mn", deq(xd, 1), deq(wd, 1)[expert])
    dx_ref = torch.einsum("mn,mkn->mk", deq(gy, 1), deq(wd, 2)[expert])
    dw_ref = torch.zeros(E, K, N).index_add_(0, expert, xd[:, :, None] * gy[:, None, :])
    assert torch.allclose(y, y_ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(x.grad, dx_ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(w.grad, dw_ref, atol=1e-4, rtol=1e-5)
    assert torch.equal(w.grad[1], torch.zeros(K, N))
    assert rel(y, torch.einsum("mk,mkn->mn", xd, wd[expert])) < 0.08


def test_emulate_flag_is_the_cpu_path():
    """EMULATE (used on the GPU to check the kernels) selects the same emulation the CPU always runs."""
    x, w = torch.randn(16, 32), torch.randn(16, 32)
    ref = fp8_linear(x, w)
    fp8.EMULATE = True
    try:
        assert torch.equal(fp8_linear(x, w), ref)
    finally:
        fp8.EMULATE = False


def tiny_model(**over):
    from moelab.model import MoETransformer

    cfg = load_config("tiny", [f"{k}={v}" for k, v in over.items()])
    torch.manual_seed(0)
    model = MoETransformer(cfg.model, cfg.backend)
    model.init_weights()
    return cfg, model


def test_enable_fp8_converts_projections_and_experts_only():
    from moelab.model.experts import GroupedExperts

    cfg, model = tiny_model()
    keys = set(model.state_dict())
    ids = torch.randint(cfg.model.vocab_size, (2, 16))
    ref = model(ids)
    counts = enable_fp8(model)
    assert set(model.state_dict()) == keys  # the same parameters: checkpoints stay interchangeable
    converted = {n for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    plain = {n for n, m in model.named_modules() if type(m) is nn.Linear}
    assert counts["linears"] == len(converted) > 0
    assert all(n.rsplit(".", 1)[-1] in fp8_convert.PROJECTIONS for n in converted)
    assert any(n.endswith("q_proj") for n in converted) and any(n.endswith("down_proj") for n in converted)
    assert all(n.rsplit(".", 1)[-1] not in fp8_convert.PROJECTIONS for n in plain)  # router gate, LM head stay
    assert "output" in plain or not any(n == "output" for n, _ in model.named_modules())
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert counts["experts"] == len(experts) > 0 and all(m.fp8 for m in experts)
    out = model(ids)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert 0 < rel(out, ref) < 0.1  # the FP8 GEMMs ran (not bit-equal) and stay close
    out.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad
               and p.grad is not None)
    assert experts[0].w_gate_up_EDF2.grad is not None


def test_enable_fp8_lm_head_opt_in():
    cfg, model = tiny_model()
    enable_fp8(model)
    assert type(model.output) is nn.Linear  # rowwise: the LM head stays bf16
    counts = enable_fp8(model, lm_head=True)  # rowwise_lm_head; converting twice changes nothing else
    assert type(model.output) is FP8Linear and counts["linears"] == 1
    ids = torch.randint(cfg.model.vocab_size, (2, 16))
    out = model(ids)
    out.float().logsumexp(-1).mean().backward()
    assert torch.isfinite(model.output.weight.grad).all()


def test_enable_fp8_refuses_expert_biases():
    from moelab.model.experts import GroupedExperts

    holder = nn.Module()
    holder.experts = GroupedExperts(4, 16, 16, bias=True)
    with pytest.raises(ConfigError, match="train.fp8"):
        enable_fp8(holder)


@pytest.mark.parametrize("over, match", [
    (["train.fp8=rowwise", "train.device=cpu", "train.dtype=bfloat16"], "train.fp8='rowwise'.*CUDA"),
    (["train.fp8=rowwise", "train.dtype=float32"], "train.fp8='rowwise'.*bfloat16"),
    (["train.fp8=tensorwise"], "train.fp8"),
    (["train.fp8=rowwise_lm_head", "train.dtype=float32"], "train.fp8='rowwise_lm_head'.*bfloat16"),
    (["train.fp8=rowwise", "train.dtype=bfloat16", "backend.experts=grouped_gemm"], "train.fp8.*backend.experts"),
])
def test_config_refuses(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config("tiny", over)


def test_check_fp8_refuses_cpu_at_build_time(tmp_path):
    from moelab.train.trainer import Trainer

    cfg = load_config("tiny", ["train.fp8=rowwise", "train.dtype=bfloat16"])  # device auto: allowed by the config
    with pytest.raises(ConfigError, match="train.fp8='rowwise'.*CUDA GPU"):
        Trainer(cfg, tmp_path / "run").setup()


def fp8_experts_holder(E=6, D=32, F=24):
    from moelab.model.experts import GroupedExperts

    holder = nn.Module()
    holder.experts = GroupedExperts(E, D, F)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        holder.experts.w_gate_up_EDF2.copy_(torch.randn(E, D, 2 * F, generator=g) * 0.1)
        holder.experts.w_down_EFD.copy_(torch.randn(E, F, D, generator=g) * 0.1)
    enable_fp8(holder)
    return holder


def experts_out_and_grads(holder, x, counts):
    for p in holder.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_()
    y = holder.experts(x, counts)
    y.backward(torch.ones_like(y))
    return [y.detach(), x.grad] + [p.grad.clone() for p in holder.experts.parameters()]


def test_expert_weight_cache_gives_the_same_results_and_never_goes_stale():
    from moelab.model.fp8_cache import expert_weights_cached

    holder = fp8_experts_holder()
    cache = holder.experts.fp8_cache
    counts = torch.tensor([5, 0, 9, 3, 7, 8])
    x = torch.randn(int(counts.sum()), 32)
    fresh = experts_out_and_grads(holder, x, counts)
    with expert_weights_cached(holder):
        assert cache.valid and cache.operands(torch.float32) is not None
        cached = experts_out_and_grads(holder, x, counts)
        first_buffers = [t for ops in cache.buffers for t in ops]
    assert not cache.valid and cache.operands(torch.float32) is None  # invalid once the step's block ends
    for a, b in zip(fresh, cached):
        assert torch.equal(a, b)
    # the weights change (an optimizer step): outside the block the experts quantise afresh ...
    with torch.no_grad():
        holder.experts.w_gate_up_EDF2.mul_(1.5)
    changed = experts_out_and_grads(holder, x, counts)
    assert not torch.equal(changed[0], fresh[0])
    # ... and the next block refreshes the same buffers in place
    with expert_weights_cached(holder):
        again = experts_out_and_grads(holder, x, counts)
        assert all(a is b for a, b in zip(first_buffers, [t for ops in cache.buffers for t in ops]))
    for a, b in zip(changed, again):
        assert torch.equal(a, b)


def test_trainer_quantises_expert_weights_once_per_step(tmp_path, monkeypatch):
    """With gradient accumulation the cache is refreshed once per step and the run equals one without it."""
    import contextlib

    from moelab.model import fp8_cache
    from moelab.train.trainer import Trainer

    monkeypatch.setattr(fp8_convert, "check_fp8", lambda cfg, device: None)  # CPU: the emulation
    cfg = load_config("tiny", ["train.fp8=rowwise", "train.dtype=bfloat16", "train.steps=2",
                               "train.global_batch_size=8", "train.micro_batch_size=2",
                               "train.save_checkpoints=false"])
    refreshes = []
    real_refresh = fp8_cache.ExpertWeightCache.refresh
    monkeypatch.setattr(fp8_cache.ExpertWeightCache, "refresh",
                        lambda self, dtype=None: (refreshes.append(self), real_refresh(self, dtype))[1])
    used = []
    real_operands = fp8_cache.ExpertWeightCache.operands
    monkeypatch.setattr(fp8_cache.ExpertWeightCache, "operands",
                        lambda self, dtype: used.append(real_operands(self, dtype) is not None) or
                        real_operands(self, dtype))
    with_cache = Trainer(cfg, tmp_path / "a")
    with_cache.setup()
    losses_a = [with_cache.train_step(s)["loss"] for s in (1, 2)]
    n_moe = len(with_cache.par.moe_layers)
    assert len(refreshes) == 2 * n_moe and used and all(used)  # every micro batch read the cache
    monkeypatch.setattr(fp8_cache, "expert_weights_cached", lambda model, dtype=None: contextlib.nullcontext())
    without = Trainer(cfg, tmp_path / "b")
    without.setup()
    losses_b = [without.train_step(s)["loss"] for s in (1, 2)]
    assert losses_a == losses_b
    for (k, a), (_, b) in zip(with_cache.model.named_parameters(), without.model.named_parameters()):
        assert torch.equal(a, b), k


def test_fp8_linear_traces_into_one_graph_under_compile():
    """torch.compile (dynamo + AOTAutograd, as train.compile uses them) traces the FP8 autograd Function,
    forward and backward, without a graph break, and computes what eager computes."""
    torch._dynamo.reset()
    x = torch.randn(2, 16, 32, requires_grad=True)
    w = torch.randn(48, 32, requires_grad=True)
    gy = torch.randn(2, 16, 48)
    fn = torch.compile(fp8_linear, backend="aot_eager", fullgraph=True)
    y = fn(x, w)
    y.backward(gy)
    got = [y.detach(), x.grad.clone(), w.grad.clone()]
    x.grad = w.grad = None
    y = fp8_linear(x, w)
    y.backward(gy)
    for a, b in zip(got, [y.detach(), x.grad, w.grad]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)


def test_fp8_experts_with_cache_under_compile():
    from moelab.model.fp8_cache import expert_weights_cached

    torch._dynamo.reset()
    holder = fp8_experts_holder()
    counts = torch.tensor([5, 0, 9, 3, 7, 8])
    x = torch.randn(int(counts.sum()), 32)
    ref = experts_out_and_grads(holder, x, counts)
    holder.experts.compile(backend="aot_eager")
    with expert_weights_cached(holder):
        got = experts_out_and_grads(holder, x, counts)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)


def test_enable_fp8_converts_mla_projections():
    """MLA (DeepSeek-V3, Kimi-K2): its low-rank q and kv projections and o_proj run in FP8, the model trains."""
    cfg, model = tiny_model(**{"model.attention": "mla", "model.q_lora_rank": 24, "model.kv_lora_rank": 16,
                               "model.qk_nope_head_dim": 8, "model.qk_rope_head_dim": 8, "model.v_head_dim": 12})
    ids = torch.randint(cfg.model.vocab_size, (2, 16))
    ref = model(ids)
    enable_fp8(model)
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert {"q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj"} <= names
    out = model(ids)
    assert 0 < rel(out, ref) < 0.1
    out.float().logsumexp(-1).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_fp8_experts_weight_each_row_before_the_down_projection():
    """A power-of-two routing weight moves its row's e4m3 scale by the same power, so the weighted experts equal
    the weight times the unweighted ones exactly, and so do the gradients of the rows and weights. The routing
    weights' own gradient <d(w a), a> now comes from the FP8 dgrad GEMM (before: <g, y> from the forward's): an
    estimate as close to the FP8-free one (fp32 experts) as the old one, within e4m3 noise."""
    from moelab.model.experts import GroupedExperts

    holder = fp8_experts_holder()
    exact = GroupedExperts(6, 32, 24)
    exact.load_state_dict(holder.experts.state_dict())
    g = torch.Generator().manual_seed(4)
    x = torch.randn(200, 32, generator=g, requires_grad=True)
    w = (2.0 ** torch.randint(-3, 2, (200,), generator=g)).requires_grad_()
    counts, grad = torch.tensor([50, 0, 70, 30, 40, 10]), torch.randn(200, 32, generator=g)
    inputs = [w, x, *holder.experts.parameters()]
    weighted = holder.experts(x, counts, w)
    reference = holder.experts(x, counts) * w[:, None]
    torch.testing.assert_close(weighted, reference, rtol=0, atol=0)
    got, want = torch.autograd.grad(weighted, inputs, grad), torch.autograd.grad(reference, inputs, grad)
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    dw_exact = torch.autograd.grad(exact(x, counts, w), w, grad)[0]
    assert rel(got[0], dw_exact) < 0.15 and rel(want[0], dw_exact) < 0.15
