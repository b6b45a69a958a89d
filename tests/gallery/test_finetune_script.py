"""gallery/scripts/finetune_gpu.sh (the fine-tuning entry's GPU call) run on CPU with TINY=1: it makes a small
Qwen3-MoE checkpoint with transformers, fine-tunes it from hf: with LoRA and in full, and writes one record per
run in gallery/results' format."""
import json
import os
import subprocess

import pytest

from moelab.gallery import RESULT_FIELDS, default_root

pytest.importorskip("transformers")


def test_finetune_script_makes_a_checkpoint_and_fine_tunes_it_from_hf(tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    env = {**os.environ, "TINY": "1", "STEPS": "3", "OUT": str(out), "CKPT": str(ckpt), "MOELAB_COMMIT": "abc123"}
    proc = subprocess.run(["bash", str(default_root() / "scripts" / "finetune_gpu.sh")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    made = json.loads((out / "make.json").read_text())
    assert made["bytes"] == sum(p.stat().st_size for p in ckpt.glob("*.safetensors")) > 0
    assert (ckpt / "tokenizer.json").is_file() and (ckpt / "config.json").is_file()
    recs = {m: json.loads((out / f"qwen3-moe-30b-a3b-proxy-{w}-1gpu--moelab--{m}.json").read_text())
            for m, w in (("lora", "finetune"), ("full", "full-finetune"))}
    assert recs["lora"]["workload"] == "qwen3-moe-30b-a3b-proxy-finetune-1gpu"  # the gallery entry's name
    for mode, r in recs.items():
        assert all(r.get(k) is not None for k in RESULT_FIELDS), [k for k in RESULT_FIELDS if r.get(k) is None]
        assert r["status"] == "COMPLETED" and r["steps"] == 3 and r["commit"] == "abc123"
        assert 0 < r["load_bytes"] <= made["bytes"] and r["tokens_per_s_per_gpu"] > 0
        assert r["planned_memory_gb"] > 0 and f"--mode {mode}" in r["command"] and r["device"] == "cpu"
    # LoRA trains the adapters only; full fine-tuning trains every parameter of the checkpoint
    assert recs["full"]["trained_params"] == recs["full"]["total_params"]
    assert 0 < recs["lora"]["trained_params"] < recs["full"]["trained_params"]
    assert recs["lora"]["final_loss"] < recs["lora"]["first_loss"]


def test_the_proxy_checkpoint_has_the_proxy_presets_model():
    """The checkpoint the GPU call makes maps (config_from_hf) onto the qwen3-moe-30b-a3b-proxy preset's model:
    every layer shape of Qwen3-30B-A3B, 8 layers. Only the aux-loss weight differs: the checkpoint keeps the
    released router_aux_loss_coef (0.001, x top-k in moelab's convention), the preset trains with 0.001."""
    import dataclasses

    import transformers

    from moelab.config import Config, load_config
    from moelab.hf import config_from_hf
    from moelab.hf.example_checkpoint import QWEN3_30B_A3B_PROXY

    hf = transformers.Qwen3MoeConfig(**QWEN3_30B_A3B_PROXY).to_dict()
    ours = dataclasses.asdict(Config.from_dict(config_from_hf(hf)).model)
    preset = dataclasses.asdict(load_config("qwen3-moe-30b-a3b-proxy").model)
    assert ours["sliding_window"] == preset["sliding_window"] == 0  # so the sliding pattern does not matter
    ours.pop("sliding_pattern"), preset.pop("sliding_pattern")
    assert (ours["moe"].pop("aux_loss_coeff"), preset["moe"].pop("aux_loss_coeff")) == (0.008, 0.001)
    assert ours == preset
