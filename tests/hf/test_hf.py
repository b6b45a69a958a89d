"""load_hf / save_hf against transformers' own Qwen3-MoE, DeepSeek-V3 and GPT-OSS on tiny random models (fp32)."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moelab import load_hf, save_hf  # noqa: E402
from moelab.config import ConfigError  # noqa: E402

V = 96  # conftest's vocabulary
FAMILIES = ["qwen3_moe", "deepseek_v3", "gpt_oss"]


@pytest.fixture(scope="module", params=FAMILIES)
def hf_checkpoint(request, tmp_path_factory, hfm):
    ref = hfm.build(request.param)
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path, max_shard_size="40KB")  # sharded: exercises the index json
    ids = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = ref(ids).logits
    return request.param, path, ids, logits


def test_load_hf_matches_transformers_logits(hf_checkpoint):
    family, path, ids, ref_logits = hf_checkpoint
    assert (path / "model.safetensors.index.json").exists()
    model = load_hf(path).eval()
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (2, 13, V)
    assert ref_logits.abs().max() > 1.0  # the comparison below means something
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


def test_save_hf_round_trip_loads_in_transformers(hf_checkpoint, tmp_path):
    family, path, ids, ref_logits = hf_checkpoint
    save_hf(load_hf(path), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == family
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(load_hf(tmp_path).eval()(ids).detach(), ref_logits, rtol=1e-4, atol=1e-4)


def test_fused_expert_layout_loads_like_per_expert(tmp_path, hfm):
    """transformers' in-memory fused layout ([E, 2F, D] gate|up, [E, D, F]) is read as well as per-expert files."""
    from safetensors.torch import load_file, save_file

    ref = hfm.build("qwen3_moe")
    ref.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    for i in (1, 2):
        p = f"model.layers.{i}.mlp.experts."
        gate = torch.stack([state.pop(f"{p}{e}.gate_proj.weight") for e in range(8)])
        up = torch.stack([state.pop(f"{p}{e}.up_proj.weight") for e in range(8)])
        state[p + "gate_up_proj"] = torch.cat([gate, up], dim=1)
        state[p + "down_proj"] = torch.stack([state.pop(f"{p}{e}.down_proj.weight") for e in range(8)])
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(0, V, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(load_hf(tmp_path)(ids), ref(ids).logits, rtol=1e-4, atol=1e-4)


def test_load_hf_overrides_and_errors(hf_checkpoint, tmp_path):
    family, path, ids, _ = hf_checkpoint
    model = load_hf(path, dtype=torch.bfloat16, **{"model.moe.capacity_factor": 2.0})
    assert model.moelab_config.model.moe.capacity_factor == 2.0
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    if family == "gpt_oss":  # flex also supports sinks
        assert load_hf(path, backend={"attention": "flex"}).moelab_config.backend.attention == "flex"
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="model_type='llama'"):
        load_hf(tmp_path)


def test_block_fp8_checkpoint_is_dequantized(tmp_path, hfm):
    """The published DeepSeek-V3 / Kimi-K2 layout: 2-D weights in float8_e4m3fn with a `weight_scale_inv` per
    block; the logits must equal transformers' on the dequantized weights."""
    from safetensors.torch import load_file, save_file

    ref = hfm.build("deepseek_v3")
    ref.save_pretrained(tmp_path)
    state, block = load_file(tmp_path / "model.safetensors"), 16
    params = dict(ref.named_parameters())
    for name in [n for n, t in state.items() if t.dim() == 2 and "layers" in n and "gate.weight" not in n]:
        w = state[name]
        rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
        padded = torch.zeros(rows * block, cols * block)
        padded[:w.shape[0], :w.shape[1]] = w
        amax = padded.view(rows, block, cols, block).abs().amax(dim=(1, 3)).clamp(min=1e-6)
        scale = amax / 448.0  # e4m3's largest normal
        q = (padded.view(rows, block, cols, block) / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        state[name] = q.view(rows * block, cols * block)[:w.shape[0], :w.shape[1]].contiguous()
        state[name + "_scale_inv"] = scale
        dequant = (q.float() * scale[:, None, :, None]).view(rows * block, cols * block)[:w.shape[0], :w.shape[1]]
        with torch.no_grad():  # the reference runs on exactly the dequantized weights
            if name in params:
                params[name].copy_(dequant)
                continue
            # per-expert file tensors live fused in transformers' module: gate_up_proj [E, 2F, D], down [E, D, F]
            _, _, layer, _, _, e, proj, _ = name.split(".")
            experts = ref.model.layers[int(layer)].mlp.experts
            F = experts.gate_up_proj.shape[1] // 2
            if proj == "down_proj":
                experts.down_proj[int(e)].copy_(dequant)
            else:
                experts.gate_up_proj[int(e), (0 if proj == "gate_proj" else F):][:F].copy_(dequant)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block],
                                  "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(0, V, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(load_hf(tmp_path)(ids), ref(ids).logits, rtol=1e-4, atol=1e-4)
    cfg["quantization_config"] = {"quant_method": "awq"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="awq"):
        load_hf(tmp_path)


def test_mxfp4_gpt_oss_checkpoint_is_dequantized(tmp_path, hfm):
    """The published GPT-OSS layout: expert matrices as MXFP4 `_blocks` + `_scales`; compared with transformers'
    own dequantization (transformers.integrations.mxfp4.convert_moe_packed_tensors)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    ref = hfm.build("gpt_oss", intermediate_size=32)  # MXFP4 packs 32 values per scale
    ref.save_pretrained(tmp_path)
    state, g = load_file(tmp_path / "model.safetensors"), torch.Generator().manual_seed(5)
    for i, layer in enumerate(ref.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            E, C, R = state.pop(name).shape  # HF's [E, in, out]; MXFP4 packs rows of `out` along `in`
            blocks = torch.randint(0, 256, (E, R, C // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(120, 128, (E, R, C // 32), generator=g, dtype=torch.uint8)
            state[name + "_blocks"], state[name + "_scales"] = blocks, scales
            with torch.no_grad():
                getattr(layer.mlp.experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(0, V, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(load_hf(tmp_path)(ids), ref(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("preset", ["qwen3-moe-30b-a3b-proxy", "deepseek-v3-proxy", "gpt-oss-20b-proxy"])
def test_save_hf_of_a_moelab_model_loads_in_transformers(preset, tmp_path, hfm):
    """A model built by moelab (no config.json behind it) exports to the matching HF family, YaRN included."""
    from moelab.config import load_config
    from moelab.model import build_model

    small = {"model.hidden_size": 32, "model.vocab_size": V, "model.num_layers": 2, "model.dense_ffn_size": 48,
             "model.moe.expert_ffn_size": 16, "model.moe.num_experts": 8, "model.moe.top_k": 2, "model.num_heads": 4,
             "model.num_kv_heads": 2, "model.head_dim": 8}
    extra = {"deepseek-v3-proxy": {"model.num_kv_heads": 4, "model.q_lora_rank": 12, "model.kv_lora_rank": 8,
                                   "model.qk_nope_head_dim": 8, "model.qk_rope_head_dim": 4, "model.v_head_dim": 8,
                                   "model.moe.num_groups": 4, "model.moe.topk_groups": 2},
             "gpt-oss-20b-proxy": {"model.sliding_window": 4, "backend.attention": "eager"}}
    cfg = load_config(preset, {**small, **extra.get(preset, {})})
    model = hfm.randomize(build_model(cfg), buffers=False)  # moelab's buffers: routing state, capacity, statistics
    save_hf(model, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(ids)
        assert ours.abs().max() > 1.0
        torch.testing.assert_close(back(ids).logits, ours, rtol=1e-4, atol=1e-4)
    if preset != "deepseek-v3-proxy":  # only DeepSeek-V3's format has a place for the routing bias
        model.moe_layers()[0].router.expert_bias[0] = 0.5
        with pytest.raises(ConfigError, match="expert_bias"):
            save_hf(model, tmp_path)


def test_legacy_rope_keys_of_published_configs(hf_checkpoint, tmp_path):
    """Published config.json files use `rope_theta` + `rope_scaling: {type: ...}` (and Kimi-K2 says
    model_type kimi_k2); they must load the same."""
    family, path, ids, ref_logits = hf_checkpoint
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    if family == "deepseek_v3":
        cfg["model_type"] = "kimi_k2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for f in path.glob("*.safetensors*"):  # the shards and their index
        (tmp_path / f.name).symlink_to(f)
    with torch.no_grad():
        torch.testing.assert_close(load_hf(tmp_path)(ids), ref_logits, rtol=1e-4, atol=1e-4)
