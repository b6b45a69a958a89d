"""export_hf: a trained run's newest checkpoint in transformers' layout. Runs of the three families are trained
for a few steps (one process; EP=2 and PP=2 on gloo), exported, loaded with AutoModelForCausalLM and compared
with moelab's own model restored from the same checkpoint by the resume path (Trainer.setup)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from moelab.config import ConfigError, load_config
from moelab.parallel.env import DistEnv
from moelab.export.hf import export_hf
from moelab.train.trainer import Trainer

transformers = pytest.importorskip("transformers")

SMALL = {"model.num_layers": 2, "model.moe.num_experts": 8, "train.steps": 2, "train.seq_len": 16,
         "train.global_batch_size": 4, "train.micro_batch_size": 2, "train.warmup_steps": 1, "train.device": "cpu",
         "train.lr": 0.01}
FAMILIES = {
    "qwen3_moe": {"model.qk_norm": True},
    "deepseek_v3": {"model.attention": "mla", "model.num_kv_heads": 4, "model.q_lora_rank": 12,
                    "model.kv_lora_rank": 8, "model.qk_nope_head_dim": 8, "model.qk_rope_head_dim": 4,
                    "model.v_head_dim": 8, "model.moe.score_func": "sigmoid", "model.moe.num_shared_experts": 1,
                    "model.moe.num_groups": 4, "model.moe.topk_groups": 2, "model.moe.route_scale": 2.5,
                    "model.moe.bias_update_rate": 0.01},  # DeepSeek-V3's format keeps the routing bias
    "gpt_oss": {"model.attention_sinks": True, "model.sliding_window": 4, "model.num_dense_layers": 0,
                "model.attention_bias": True, "model.moe.router_bias": True, "model.moe.expert_proj_bias": True,
                "model.moe.score_func": "softmax_topk", "model.moe.norm_topk_prob": False,
                "model.moe.activation": "gpt_oss", "backend.attention": "eager"},
}


def config(family: str, **extra):
    return load_config("tiny", {**SMALL, **FAMILIES[family], **extra})


def train(cfg, run_dir):
    """One process, in this one (one CPU thread, like a launched rank)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(cfg, run_dir, env=DistEnv()).run()
    finally:
        torch.set_num_threads(threads)
    return run_dir


def restored(cfg, run_dir, tmp_path):
    """moelab's model as a resume on one process restores it from the run's newest checkpoint (on a copy)."""
    copy = tmp_path / "restored"
    shutil.copytree(run_dir, copy)
    t = Trainer(cfg.replace(parallel={"pp": 1, "ep": 1, "fsdp": -1}), copy, env=DistEnv())
    t.setup()
    assert t.start_step == cfg.train.steps
    return t.model.eval()


def assert_same_logits(out, model, vocab: int):
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), back(ids).logits
    scale = ours.abs().max().item()
    assert scale > 0.1
    err = (theirs - ours).abs().max().item()
    assert err <= 1e-4 * scale, f"transformers' logits differ from moelab's by {err:.3g} (max |logit| {scale:.3g})"
    return back


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory):
    cfg = config("qwen3_moe")
    return cfg, train(cfg, tmp_path_factory.mktemp("qwen") / "run")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_loads_in_transformers_with_moelabs_logits(family, tmp_path, qwen_run):
    cfg, run = qwen_run if family == "qwen3_moe" else (config(family), None)
    run = run or train(cfg, tmp_path / "run")
    out = export_hf(run, tmp_path / "hf")
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == family and hf["dtype"] == "float32"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # bytes: no tokenizer
    model = restored(cfg, run, tmp_path)
    assert_same_logits(out, model, cfg.model.vocab_size)
    if family == "deepseek_v3":  # the trained routing bias went to e_score_correction_bias
        bias = model.moe_layers()[0].router.expert_bias
        assert bias.abs().max() > 0
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "pt") as f:
            torch.testing.assert_close(f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias"), bias)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"parallel.ep": 2}, {"parallel.pp": 2}, {"parallel.tp": 2}],
                         ids=["ep2", "pp2", "tp2"])
def test_export_of_a_two_process_run(layout, tmp_path):
    """Checkpoints written by 2 gloo ranks (EP: each rank's experts; PP: each rank's layers; TP: each rank's
    heads, columns and vocabulary rows) export whole."""
    from moelab.launch.local import run_local_processes

    cfg = config("qwen3_moe", **layout)
    run = tmp_path / "run"
    assert run_local_processes(cfg, run, 2)["status"] == "COMPLETED"
    from moelab.contract.checkpoints import latest_checkpoint, read_metadata

    meta = read_metadata(latest_checkpoint(run))
    key = next(iter(layout)).split(".")[1]
    assert meta["world_size"] == 2 and meta["layout"][key] == 2
    out = export_hf(run, tmp_path / "hf")
    assert_same_logits(out, restored(cfg, run, tmp_path), cfg.model.vocab_size)


def test_sharded_export_has_an_index_and_bf16(qwen_run, tmp_path):
    cfg, run = qwen_run
    one = export_hf(run, tmp_path / "one")
    out = export_hf(run, tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    from safetensors import safe_open

    with safe_open(str(one / "model.safetensors"), "pt") as f:
        whole = {k: f.get_tensor(k) for k in f.keys()}
    assert set(index["weight_map"]) == set(whole)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in whole.values())
    for file in files:
        with safe_open(str(out / file), "pt") as f:
            size = sum(f.get_tensor(k).numel() * 4 for k in f.keys())
            assert size <= 40_000 or len(list(f.keys())) == 1  # a tensor past the limit gets a file of its own
    assert_same_logits(out, restored(cfg, run, tmp_path), cfg.model.vocab_size)

    half = export_hf(run, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(half / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def test_base_config_fields_and_tokenizer_files_are_kept(qwen_run, tmp_path):
    """With the HF folder the run started from, its config.json keys and its tokenizer files go along."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg, run = qwen_run
    base = export_hf(run, tmp_path / "base")
    hf = json.loads((base / "config.json").read_text())
    hf.update(bos_token_id=3, eos_token_id=4, custom_note="from the base")
    (base / "config.json").write_text(json.dumps(hf))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(cfg.model.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(base / "tokenizer.json"))
    (base / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "eos_token": "w4"}))
    out = export_hf(run, tmp_path / "hf", base=f"hf:{base}")
    got = json.loads((out / "config.json").read_text())
    assert (got["bos_token_id"], got["eos_token_id"], got["custom_note"]) == (3, 4, "from the base")
    assert (out / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    assert loaded("w5 w7")["input_ids"] == [5, 7] and loaded.eos_token == "w4"


def test_a_run_from_an_hf_checkpoint_with_lr_0_exports_that_checkpoint(qwen_run, tmp_path):
    """`moelab run hf:BASE` records BASE (train.init_from): the export keeps BASE's config.json fields without
    being told, and with learning rate 0 gives BASE's logits."""
    from moelab.cli import main
    from moelab.export.hf import base_of

    cfg, run = qwen_run
    base = export_hf(run, tmp_path / "base")
    hf = json.loads((base / "config.json").read_text())
    hf["custom_note"] = "from the base"
    (base / "config.json").write_text(json.dumps(hf))
    tuned = tmp_path / "tuned"
    sets = ["train.device=cpu", "train.seq_len=16", "train.global_batch_size=2", "train.micro_batch_size=2",
            "train.lr=0"]
    assert main(["run", f"hf:{base}", "--steps", "1", "--out", str(tuned), *[a for s in sets for a in ("--set", s)]]) == 0
    assert base_of(load_config(tuned / "config.yaml")) == base
    out = export_hf(tuned, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["custom_note"] == "from the base"
    ids = torch.randint(0, cfg.model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()(ids).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_a_runs_own_tokenizer_json_is_copied(qwen_run, tmp_path):
    """A run that trained with a tokenizer.json (bpe, or a path) has it in its folder: it goes along, loadable."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg, run = qwen_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(copy / "tokenizer.json"))
    out = export_hf(copy, tmp_path / "hf")
    assert transformers.AutoTokenizer.from_pretrained(out)("b a")["input_ids"] == [1, 0]


def test_refusals(qwen_run, tmp_path):
    cfg, run = qwen_run
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty.*--force"):
        export_hf(run, busy)
    export_hf(run, busy, max_shard_size="40KB", force=True)
    assert (busy / "model.safetensors.index.json").is_file()
    export_hf(run, busy, force=True)  # the shards of the export before are gone, the user's file stays
    assert sorted(p.name for p in busy.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    assert_same_logits(busy, restored(cfg, run, tmp_path), cfg.model.vocab_size)

    for kwargs, match in [({"lora": "merged"}, "the run has no LoRA adapters"),
                          ({"lora": "adapters"}, "the run has no LoRA adapters"),
                          ({"lora": "both"}, "lora='both'"), ({"dtype": "float16"}, "dtype='float16'"),
                          ({"max_shard_size": "lots"}, "max_shard_size='lots'"),
                          ({"base": tmp_path}, "no config.json")]:
        with pytest.raises(ConfigError, match=match):
            export_hf(run, tmp_path / "new", **kwargs)
    assert not (tmp_path / "new" / "config.json").exists()


def test_runs_it_cannot_export(tmp_path):
    no_ckpt = train(config("qwen3_moe", **{"train.save_checkpoints": False}), tmp_path / "none")
    with pytest.raises(ConfigError, match="no checkpoint.*train.save_checkpoints=true.*train.checkpoint_every"):
        export_hf(no_ckpt, tmp_path / "a")
    # Qwen3-MoE's layout has no place for the aux-loss-free routing bias a run trained
    biased = train(config("qwen3_moe", **{"model.moe.bias_update_rate": 0.01}), tmp_path / "biased")
    with pytest.raises(ConfigError, match="cannot be exported.*expert_bias"):
        export_hf(biased, tmp_path / "b")
    assert not (tmp_path / "b").exists()
    # no HF family expresses a GQA model without qk_norm and without sinks: refused before any weight is read
    plain = train(load_config("tiny", SMALL), tmp_path / "plain")
    with pytest.raises(ConfigError, match="qk_norm"):
        export_hf(plain, tmp_path / "c")
    assert not (tmp_path / "c").exists()
    # a config.yaml edited after the checkpoint was written
    from moelab.config import save_config

    save_config(config("qwen3_moe", **{"model.moe.bias_update_rate": 0.01, "model.norm_eps": 1e-5}),
                biased / "config.yaml")
    with pytest.raises(ConfigError, match=r"not the config .*model.norm_eps: 1e-06 -> 1e-05"):
        export_hf(biased, tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="not a run folder"):
        export_hf(tmp_path / "nowhere", tmp_path / "d")


def test_lora_call_sites(qwen_run, tmp_path, monkeypatch):
    """The extension point for LoRA runs: a checkpoint holding adapter tensors goes to
    moelab.model.lora.merge_lora_state (lora="merged", the default) or moelab.hf.peft.write_peft_adapters
    (lora="adapters"). Those two belong to the LoRA work; here stand-ins with their signatures take the calls."""
    import sys
    import types

    cfg, run = qwen_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    t = Trainer(cfg, copy, env=DistEnv())
    t.setup()
    q = t.model.layers["1"].attention.q_proj
    g = torch.Generator().manual_seed(0)
    q.register_parameter("lora_A", torch.nn.Parameter(torch.randn(2, q.in_features, generator=g)))
    q.register_parameter("lora_B", torch.nn.Parameter(torch.randn(q.out_features, 2, generator=g)))
    t.checkpointer.save(cfg.train.steps + 1, t.model, torch.optim.AdamW(t.model.parameters()))
    want = (q.weight + q.lora_B @ q.lora_A).detach()
    calls = []

    def merge_lora_state(state, run_cfg):
        calls.append(("merge", sorted(k for k in state if "lora" in k), run_cfg.name))
        prefix = "layers.1.attention.q_proj."
        state[prefix + "weight"] = state[prefix + "weight"] + state.pop(prefix + "lora_B") @ state.pop(prefix + "lora_A")
        return state

    def write_peft_adapters(state, run_cfg, out, base_model_name_or_path=None, hf=None):
        calls.append(("peft", sorted(k for k in state if "lora" in k), run_cfg.name))
        (out / "adapter_config.json").write_text("{}")

    monkeypatch.setitem(sys.modules, "moelab.model.lora", types.SimpleNamespace(merge_lora_state=merge_lora_state))
    monkeypatch.setitem(sys.modules, "moelab.hf.peft", types.SimpleNamespace(write_peft_adapters=write_peft_adapters))
    names = ["layers.1.attention.q_proj.lora_A", "layers.1.attention.q_proj.lora_B"]
    merged = export_hf(copy, tmp_path / "merged")
    from safetensors import safe_open

    with safe_open(str(merged / "model.safetensors"), "pt") as f:
        torch.testing.assert_close(f.get_tensor("model.layers.1.self_attn.q_proj.weight"), want)
        assert not any("lora" in k for k in f.keys())
    adapters = export_hf(copy, tmp_path / "adapters", lora="adapters")
    assert sorted(p.name for p in adapters.iterdir()) == ["adapter_config.json"]
    assert calls == [("merge", names, cfg.name), ("peft", names, cfg.name)]


def test_a_lora_run_exports_merged_or_as_adapters(tmp_path):
    """A LoRA checkpoint holds only the adapters (and the routers' buffers) and points at its base (the seed
    here): merged, transformers gives the logits of moelab's LoRA model restored from it; adapters alone go to
    PEFT's two files."""
    cfg = config("qwen3_moe", **{"train.lora.rank": 4, "train.lora.targets": "attention"})
    run = train(cfg, tmp_path / "run")
    out = export_hf(run, tmp_path / "merged")
    assert_same_logits(out, restored(cfg, run, tmp_path), cfg.model.vocab_size)
    adapters = export_hf(run, tmp_path / "adapters", lora="adapters")
    assert sorted(p.name for p in adapters.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((adapters / "adapter_config.json").read_text())["r"] == 4
