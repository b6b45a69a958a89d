"""FlexAttention against the eager reference; multi-head latent attention; YaRN against transformers."""
import pytest
import torch

from moelab.config import BackendConfig, load_config
from moelab.model.attention import GQAttention, attention_path, causal_attention
from moelab.model.layers import rope_cos_sin
from moelab.model.mla import MLAttention, mla_softmax_scale

# On CPU flex runs unfused (and forward only); that is what these tests want.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.mark.parametrize("window,sinks,heads", [(0, False, (4, 4)), (5, False, (4, 2)), (5, True, (4, 2)),
                                                (0, True, (4, 1))])
def test_flex_matches_eager(window, sinks, heads):
    g = torch.Generator().manual_seed(0)
    H, G = heads
    q = torch.randn(2, H, 24, 16, generator=g)
    k, v = torch.randn(2, G, 24, 16, generator=g), torch.randn(2, G, 24, 16, generator=g)
    sinks_H = torch.randn(H, generator=g) * 2 if sinks else None
    eager = causal_attention(q, k, v, "eager", window, sinks_H)
    flex = causal_attention(q, k, v, "flex", window, sinks_H)
    torch.testing.assert_close(flex, eager, rtol=1e-5, atol=1e-5)
    if not window and not sinks:
        torch.testing.assert_close(causal_attention(q, k, v, "sdpa"), eager, rtol=1e-5, atol=1e-5)


def test_flex_matches_eager_with_other_value_dim_and_scale():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 3, 20, 24, generator=g), torch.randn(1, 3, 20, 24, generator=g), torch.randn(1, 3, 20, 8,
                                                                                                          generator=g)
    eager = causal_attention(q, k, v, "eager", scale=0.3)
    for backend in ("flex", "sdpa"):
        torch.testing.assert_close(causal_attention(q, k, v, backend, scale=0.3), eager, rtol=1e-5, atol=1e-5)


def test_gpt_oss_style_layer_flex_equals_eager():
    cfg = load_config("tiny", {"model.sliding_window": 6, "model.attention_sinks": True,
                               "model.attention_bias": True, "backend.attention": "eager"}).model
    torch.manual_seed(0)
    eager = GQAttention(cfg, BackendConfig(attention="eager"), window=6)
    with torch.no_grad():
        eager.sinks.normal_()
    flex = GQAttention(cfg, BackendConfig(attention="flex"), window=6)
    flex.load_state_dict(eager.state_dict())
    x = torch.randn(2, 20, cfg.hidden_size)
    cos, sin = rope_cos_sin(torch.arange(20), cfg.head_dim, cfg.rope_theta, x.dtype)
    with torch.no_grad():
        torch.testing.assert_close(flex(x, cos, sin), eager(x, cos, sin), rtol=1e-5, atol=1e-5)
        assert flex._flex_mask is not None  # the block mask is cached for the next call of this length


def _mla_cfg(**kw):
    over = {"model.attention": "mla", "model.q_lora_rank": 24, "model.kv_lora_rank": 16, "model.qk_nope_head_dim": 8,
            "model.qk_rope_head_dim": 8, "model.v_head_dim": 12}
    over.update(kw)
    return load_config("tiny", over).model


@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_mla_backends_agree_and_are_causal(q_lora_rank):
    cfg = _mla_cfg(**{"model.q_lora_rank": q_lora_rank})
    torch.manual_seed(0)
    ref = MLAttention(cfg, BackendConfig(attention="eager"))
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 16, cfg.hidden_size)
    cos, sin = rope_cos_sin(torch.arange(16), cfg.qk_rope_head_dim, cfg.rope_theta, x.dtype)
    with torch.no_grad():
        y = ref(x, cos, sin)
        for backend in ("sdpa", "flex"):
            other = MLAttention(cfg, BackendConfig(attention=backend))
            other.load_state_dict(ref.state_dict())
            torch.testing.assert_close(other(x, cos, sin), y, rtol=1e-5, atol=1e-5)
        x2 = x.clone()
        x2[:, 10:] = torch.randn(2, 6, cfg.hidden_size)  # the future must not change the past
        torch.testing.assert_close(ref(x2, cos, sin)[:, :10], y[:, :10])
    assert (q_lora_rank == 0) == (ref.q_proj is not None)


def test_mla_softmax_scale_includes_yarn_mscale():
    plain = _mla_cfg()
    assert mla_softmax_scale(plain) == pytest.approx(16 ** -0.5)
    yarn = _mla_cfg(**{"model.rope_scaling.kind": "yarn", "model.rope_scaling.factor": 40.0,
                       "model.rope_scaling.mscale_all_dim": 1.0, "model.rope_scaling.mscale": 1.0})
    import math
    assert mla_softmax_scale(yarn) == pytest.approx(16 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)


@pytest.mark.parametrize("rope", [
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False},
    {"factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.8},
])
def test_yarn_matches_transformers(rope):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.GptOssConfig(head_dim=64, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, **rope})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    pos = torch.arange(0, 5000, 37)
    freqs = pos.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)
    ours = load_config("tiny", {"model.rope_scaling.kind": "yarn", "model.rope_scaling.factor": rope["factor"],
                                "model.rope_scaling.beta_fast": rope["beta_fast"],
                                "model.rope_scaling.beta_slow": rope["beta_slow"],
                                "model.rope_scaling.original_max_len": 4096,
                                "model.rope_scaling.truncate": rope.get("truncate", True),
                                "model.rope_scaling.mscale": rope.get("mscale", 0.0),
                                "model.rope_scaling.mscale_all_dim": rope.get("mscale_all_dim", 0.0)}).model
    cos, sin = rope_cos_sin(pos, 64, 150000.0, torch.float32, ours.rope_scaling)
    torch.testing.assert_close(cos, emb.cos() * factor, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sin, emb.sin() * factor, rtol=1e-4, atol=1e-4)


def test_flex_training_on_cpu_says_what_to_do():
    from moelab.config import ConfigError

    q = torch.randn(1, 2, 8, 8, requires_grad=True)
    with pytest.raises(ConfigError, match="backend.attention=eager"):
        causal_attention(q, q, q, "flex")


def test_sdpa_runs_packed_documents_through_flex_on_a_gpu():
    """backend.attention=sdpa with packed documents (data.kind sft) takes FlexAttention's block-sparse document
    mask on a GPU, sdpa's dense mask on CPU (no FlexAttention backward there); nothing else changes path."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert attention_path("sdpa", cuda, packed=True) == "flex"
    assert attention_path("sdpa", cpu, packed=True) == "sdpa"
    assert attention_path("sdpa", cuda, packed=False) == "sdpa"
    assert [attention_path(b, cuda, packed=True) for b in ("eager", "flex", "te")] == ["eager", "flex", "te"]
