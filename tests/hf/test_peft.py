"""LoRA export: merged adapters through save_hf load in transformers with moelab's LoRA logits, and PEFT-layout
adapters loaded by peft.PeftModel onto the transformers base give the same logits (Qwen3-MoE and DeepSeek-V3,
whose rotary rows are permuted on the way out); targets PEFT cannot hold are refused, named."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from moelab import load_hf, save_hf  # noqa: E402
from moelab.config import ConfigError  # noqa: E402
from moelab.hf.peft import write_peft_adapters  # noqa: E402
from moelab.model.assemble import assemble  # noqa: E402
from moelab.model.lora import is_adapter, merge_lora_state  # noqa: E402

V = 96
PEFT_TARGETS = {"qwen3_moe": "attention", "deepseek_v3": "attention"}  # what PEFT loads where it belongs
ALL_TARGETS = {"qwen3_moe": "attention,dense_mlp,experts", "deepseek_v3": "attention,dense_mlp,shared_experts,experts"}


def lora_from_checkpoint(path, targets, seed=3):
    """The checkpoint's model with LoRA on `targets` and random (nonzero) adapters: (model, cfg, base model)."""
    base = load_hf(path)
    cfg = base.moelab_config.replace(**{"train.lora.rank": 4, "train.lora.alpha": 8.0,
                                        "train.lora.targets": targets})

    def load(model):
        missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)  # routers' buffers included
        assert not unexpected and missing and all(is_adapter(k) for k in missing)

    model = assemble(cfg, "lora", load=load)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter(name):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.hf_config = base.hf_config
    return model.eval(), cfg, base


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def checkpoint(request, tmp_path_factory, hfm):
    path = tmp_path_factory.mktemp(request.param)
    hfm.build(request.param).save_pretrained(path)
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
    return request.param, path, ids


def test_merged_lora_loads_in_transformers_with_the_lora_logits(checkpoint, tmp_path):
    family, path, ids = checkpoint
    model, cfg, base = lora_from_checkpoint(path, ALL_TARGETS[family])
    merged = merge_lora_state(model.state_dict(), cfg)
    plain = assemble(cfg, "load", load=lambda m: m.load_state_dict(merged, strict=True))
    plain.hf_config = base.hf_config
    save_hf(plain, tmp_path / "merged")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        ours, theirs, before = model(ids), back(ids).logits, base(ids)
    assert (ours - before).abs().max() > 0.1  # the adapters change the logits: the comparison means something
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_peft_adapters_on_the_transformers_base_give_the_lora_logits(checkpoint, tmp_path):
    family, path, ids = checkpoint
    model, cfg, base = lora_from_checkpoint(path, PEFT_TARGETS[family])
    save_hf(base, tmp_path / "base")
    out = write_peft_adapters(model.state_dict(), cfg, tmp_path / "adapters",
                              base_model_name_or_path=str(tmp_path / "base"), hf=base.hf_config)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    if family == "deepseek_v3":  # MLA's down/up projections, by transformers' names (rotary rows permuted)
        assert {"model.layers.1.self_attn.kv_a_proj_with_mqa", "model.layers.1.self_attn.q_b_proj",
                "model.layers.1.self_attn.q_a_proj", "model.layers.2.self_attn.kv_b_proj"} <= set(
                    config["target_modules"])
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    tuned = peft.PeftModel.from_pretrained(hf_base, out).eval()
    n_lora = sum(1 for n, _ in tuned.named_parameters() if "lora_A" in n)
    assert n_lora == len(config["target_modules"])
    with torch.no_grad():
        ours, theirs = model(ids), tuned(input_ids=ids).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
        assert (plain(ids).logits - ours).abs().max() > 0.1
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_peft_export_refuses_what_peft_cannot_hold(checkpoint, tmp_path):
    family, path, _ = checkpoint
    model, cfg, _ = lora_from_checkpoint(path, "attention,experts")
    with pytest.raises(ConfigError, match="PEFT's layout cannot hold adapters on experts"):
        write_peft_adapters(model.state_dict(), cfg, tmp_path / "a")
    for targets in ("attention,dense_mlp", "shared_experts" if family == "deepseek_v3" else "dense_mlp"):
        with pytest.raises(ConfigError, match="PEFT's layout cannot hold adapters on (dense_mlp|shared_experts)"):
            write_peft_adapters(model.state_dict(), cfg.replace(**{"train.lora.targets": targets}), tmp_path / "c")
    router = cfg.replace(**{"train.lora.targets": "attention", "train.lora.train_router": True})
    with pytest.raises(ConfigError, match="train.lora.train_router=true"):
        write_peft_adapters(model.state_dict(), router, tmp_path / "b")
    assert not any((tmp_path / d).exists() for d in "abc")


def test_lora_base_from_hf_fills_only_the_frozen_tensors(tmp_path, hfm):
    from moelab.train.lora_state import load_base

    hfm.build("qwen3_moe").save_pretrained(tmp_path)
    base = load_hf(tmp_path)
    cfg = base.moelab_config.replace(**{"train.lora.rank": 4})
    model = assemble(cfg.replace(**{"train.seed": 0}), "lora")
    a_before = model.layers["0"].attention.q_proj.lora_A.detach().clone()
    load_base(model, f"hf:{tmp_path}")
    for key, value in base.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert torch.equal(model.layers["0"].attention.q_proj.lora_A, a_before)
    with pytest.raises(ConfigError, match="hf:PATH"):
        load_base(model, str(tmp_path))
