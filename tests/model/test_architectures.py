"""Published-architecture presets, their one-GPU proxies, and the model features they need (GPT-OSS experts and
router, MLA), exercised on CPU at reduced width."""
import pytest
import torch

from moelab.config import load_config
from moelab.layout.dims import check_layout
from moelab.planner.flops import count_params
from moelab.model import build_model
from moelab.model.experts import gpt_oss_glu, grouped_mm_swiglu, loop_swiglu

# (preset, published total, published activated, reference-table world size)
PUBLISHED = {"deepseek-v3": (671e9, 37e9, 256), "kimi-k2": (1.04e12, 32e9, 256),
             "qwen3-moe-30b-a3b": (30.5e9, 3.3e9, 8), "gpt-oss-20b": (20.9e9, 3.6e9, 8),
             "gpt-oss-120b": (116.8e9, 5.1e9, 64)}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_parameter_counts_match_published(name):
    total, activated, world = PUBLISHED[name]
    cfg = load_config(name)
    p = count_params(cfg.model)
    assert p.total == pytest.approx(total, rel=0.015)
    # moelab's activated count excludes the input embedding; published counts differ on that convention
    assert min(abs(p.activated - activated), abs(p.activated + p.embedding - activated)) < 0.02 * activated
    check_layout(cfg, world)  # the reference table's layout is valid for its GPU count


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_proxy_keeps_layer_shapes_and_fits_one_gpu(name):
    full, proxy = load_config(name).model, load_config(f"{name}-proxy")
    m = proxy.model
    for field in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "attention", "q_lora_rank",
                  "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "sliding_window",
                  "attention_sinks", "attention_bias", "dense_ffn_size"):
        assert getattr(m, field) == getattr(full, field), field
    for field in ("top_k", "expert_ffn_size", "num_shared_experts", "score_func", "route_scale", "activation",
                  "router_bias", "expert_proj_bias", "num_groups", "topk_groups"):
        assert getattr(m.moe, field) == getattr(full.moe, field), field
    if name in ("deepseek-v3", "kimi-k2"):  # one full-width expert layer alone would not fit (see the YAML)
        assert m.moe.num_experts < full.moe.num_experts
    else:
        assert m.moe.num_experts == full.moe.num_experts
    assert m.num_layers < full.num_layers
    assert (m.num_dense_layers > 0) == (full.num_dense_layers > 0)
    # fp32 weights + grads + Adam = 16 bytes/param must leave room on a 141 GB H200
    assert count_params(m).total * 16 < 100e9
    assert check_layout(proxy, 1).fsdp == 1 and proxy.train.seq_len == 4096


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_each_architecture_trains_a_step_at_small_width(name):
    """The preset's features (MLA, groups, shared experts, sinks, biases, clamped SwiGLU...) at toy sizes."""
    small = {"model.hidden_size": 32, "model.vocab_size": 64, "model.num_layers": 3, "model.dense_ffn_size": 48,
             "model.moe.expert_ffn_size": 16, "model.moe.num_experts": 8, "model.moe.top_k": 2,
             "model.num_heads": 4, "model.num_kv_heads": 4 if "gpt" not in name else 2, "model.head_dim": 8,
             "train.seq_len": 16}
    cfg = load_config(f"{name}-proxy", small)
    if cfg.model.attention == "mla":
        small.update({"model.q_lora_rank": 12, "model.kv_lora_rank": 8, "model.qk_nope_head_dim": 8,
                      "model.qk_rope_head_dim": 4, "model.v_head_dim": 8})
    if cfg.model.moe.num_groups > 1:
        small.update({"model.moe.num_groups": 4, "model.moe.topk_groups": 2})
    if cfg.model.sliding_window:
        small.update({"model.sliding_window": 4, "backend.attention": "eager"})
    cfg = load_config(f"{name}-proxy", small)
    model = build_model(cfg)
    tokens = torch.randint(0, 64, (2, 16))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), \
        [n for n, g in grads.items() if g is None]
    assert count_params(cfg.model).total == sum(p.numel() for p in model.parameters())


def test_expert_biases_and_gpt_oss_activation_grouped_mm_matches_loop():
    E, D, F, N = 4, 16, 8, 29
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(N, D, generator=g), torch.randn(E, D, 2 * F, generator=g),
               torch.randn(E, F, D, generator=g), torch.randn(E, 2 * F, generator=g), torch.randn(E, D, generator=g)]
    for t in tensors:
        t.requires_grad_(True)
    counts = torch.tensor([9, 0, 13, 7])
    outs, grads = [], []
    for fn in (grouped_mm_swiglu, loop_swiglu):
        y = fn(*tensors[:3], counts, *tensors[3:], act=gpt_oss_glu)
        y.square().sum().backward()
        outs.append(y.detach())
        grads.append([t.grad.clone() for t in tensors])
        for t in tensors:
            t.grad = None
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)
    assert (outs[1][9:22] != 0).any()


def test_gpt_oss_glu_clamps():
    gate = torch.tensor([10.0, -10.0, 1.0])
    up = torch.tensor([10.0, -10.0, 0.5])
    out = gpt_oss_glu(gate, up)
    ref_gate = torch.tensor([7.0, -10.0, 1.0])
    ref = (torch.tensor([7.0, -7.0, 0.5]) + 1) * ref_gate * torch.sigmoid(1.702 * ref_gate)
    torch.testing.assert_close(out, ref)


def test_softmax_topk_router_weights_are_a_softmax_over_the_chosen_logits():
    from moelab.model.router import Router

    cfg = load_config("tiny", {"model.moe.score_func": "softmax_topk", "model.moe.router_bias": True,
                               "model.moe.top_k": 3}).model.moe
    router = Router(8, cfg)
    torch.manual_seed(0)
    torch.nn.init.normal_(router.weight)
    torch.nn.init.normal_(router.bias)
    router.reset_buffers()
    x = torch.randn(1, 5, 8)
    weights, experts, _, _ = router(x)
    logits = x[0] @ router.weight.T + router.bias
    top = logits.topk(3, dim=-1)
    assert torch.equal(experts.sort(-1).values, top.indices.sort(-1).values)
    torch.testing.assert_close(weights.sort(-1).values, torch.softmax(top.values, -1).sort(-1).values)


def test_new_fields_default_to_old_behaviour_and_are_validated():
    from moelab.config import ConfigError

    moe = load_config("tiny").model.moe
    assert (moe.router_bias, moe.expert_proj_bias, moe.activation) == (False, False, "swiglu")
    assert load_config("tiny").model.rope_scaling.kind == "none"
    with pytest.raises(ConfigError, match="model.moe.num_groups"):
        load_config("tiny", {"model.moe.score_func": "softmax_topk", "model.moe.num_groups": 2})
    with pytest.raises(ConfigError, match="model.rope_scaling.factor"):
        load_config("tiny", {"model.rope_scaling.kind": "yarn", "model.rope_scaling.factor": 0.5})
    with pytest.raises(ConfigError, match="model.moe.activation"):
        load_config("tiny", {"model.moe.activation": "gelu"})
