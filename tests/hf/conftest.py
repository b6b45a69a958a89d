"""Small random transformers models (eager attention, fp32, CPU) and the comparisons the HF tests make.
Tests get them through the `hfm` fixture (pytest runs with --import-mode=importlib: conftest is not importable)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

V = 96

QWEN = dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, mlp_only_layers=[0], rope_parameters={"rope_type": "default", "rope_theta": 1e4})
DEEPSEEK = dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16,
                q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8, n_group=4, topk_group=2,
                num_experts_per_tok=3, first_k_dense_replace=1, routed_scaling_factor=2.5,
                max_position_embeddings=4096,
                rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                 "original_max_position_embeddings": 64})
# transformers' default GPT-OSS rope: yarn, factor 32, truncate false
GPT_OSS = dict(vocab_size=V, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=2, sliding_window=4)
BASE = {"qwen3_moe": QWEN, "deepseek_v3": DEEPSEEK, "gpt_oss": GPT_OSS}
CLASSES = {"qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
           "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
           "gpt_oss": ("GptOssConfig", "GptOssForCausalLM")}


def build(family: str, seed: int = 0, **changes):
    """A transformers model of `family` with BASE's config updated by `changes`, every value random."""
    config_cls, model_cls = (getattr(transformers, n) for n in CLASSES[family])
    config = config_cls(**{**BASE[family], **changes})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomize(model_cls(config), seed)


def randomize(model, seed=0, buffers=True):
    """Random values everywhere (HF's init leaves biases, sinks and the DeepSeek score bias at zero), large enough
    to reach GPT-OSS's clamp and to make routing choices matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + (list(model.named_buffers()) if buffers else []):
            if not t.is_floating_point() or "inv_freq" in name:
                continue
            noise = torch.randn(t.shape, generator=g)
            if "norm" in name:
                t.copy_(1 + 0.2 * noise)
            elif "experts" in name and "shared" not in name:
                t.copy_(0.6 * noise)
            else:
                t.copy_(0.3 * noise)
    return model.eval()


def close(ours: torch.Tensor, ref: torch.Tensor, what: str, rel: float = 1e-4, atol: float = 1e-7) -> None:
    """max |ours - ref| <= rel * max |ref| + atol: relative to the tensor's scale; `atol` is fp32 rounding noise
    where the value is zero in exact arithmetic (the router's gradient at top_k=1 with renormalisation)."""
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    scale = ref.abs().max().item()
    err = (ours.detach().float() - ref.detach().float()).abs().max().item()
    assert err <= rel * scale + atol, f"{what}: max difference {err:.3g} against max |ref| {scale:.3g}"


def hf_memory_layout(family: str, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """save_hf's file layout (one matrix per expert for Qwen3-MoE / DeepSeek-V3) -> transformers' in-memory one
    ([E, 2F, D] gate|up, [E, D, F] down)."""
    if family == "gpt_oss":
        return out
    out, fused = dict(out), {}
    for name in [n for n in out if ".mlp.experts." in n and n.endswith(".gate_proj.weight")]:
        prefix, e = name.rsplit(".", 3)[0], int(name.rsplit(".", 3)[1])
        fused.setdefault(prefix, {})[e] = (out.pop(name), out.pop(f"{prefix}.{e}.up_proj.weight"),
                                           out.pop(f"{prefix}.{e}.down_proj.weight"))
    for prefix, by_e in fused.items():
        experts = [by_e[e] for e in sorted(by_e)]
        out[prefix + ".gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u, _ in experts])
        out[prefix + ".down_proj"] = torch.stack([d for _, _, d in experts])
    return out


@pytest.fixture(scope="session")
def hfm():
    return SimpleNamespace(V=V, BASE=BASE, build=build, randomize=randomize, close=close, hf_memory_layout=hf_memory_layout)
