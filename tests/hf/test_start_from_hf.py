"""A run that starts from a Hugging Face checkpoint (`hf:PATH`, train.init_from), on one process and on gloo
layouts: with train.lr=0 the trained state is the checkpoint's tensors, the restored model gives transformers'
logits, and each rank read only its share of the checkpoint (moelab.hf.sharded_load)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moelab import Session, load_hf  # noqa: E402
from moelab.config import ConfigError  # noqa: E402
from moelab.contract.stream import read_events  # noqa: E402

RUN = {"steps": 2, "lr": 0.0, "warmup_steps": 1, "seq_len": 16, "global_batch_size": 4, "micro_batch_size": 1,
       "device": "cpu"}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, hfm):
    """A Qwen3-MoE checkpoint made here: a dense first layer, top-2 of 8 experts, an untied head, sharded files."""
    ref = hfm.build("qwen3_moe", tie_word_embeddings=False)
    assert ref.config.mlp_only_layers == [0] and ref.config.num_experts_per_tok == 2
    path = tmp_path_factory.mktemp("qwen3")
    ref.save_pretrained(path, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").exists()
    ids = torch.randint(0, hfm.V, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = ref(ids).logits
    return path, ids, logits


def trained_state(run_dir: Path) -> dict:
    """The run's last checkpoint, read into this process with torch.distributed.checkpoint (global tensors)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    out = run_dir / "state.pt"
    dcp_to_torch_save(ckpt, out)
    return torch.load(out, weights_only=False)["model"]


def check_run(run_dir: Path, path: Path, ids, ref_logits, hfm) -> dict:
    """Every parameter after training equals the checkpoint's (1e-6), and the restored model's logits equal
    transformers' (1e-4 relative); returns the start event's init_from record."""
    model = load_hf(path)
    expected = dict(model.named_parameters())
    state = trained_state(run_dir)
    assert set(expected) <= set(state), sorted(set(expected) - set(state))
    for name, want in expected.items():
        torch.testing.assert_close(state[name].float(), want.detach(), rtol=0, atol=1e-6, msg=name)
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()}, strict=True)
    with torch.no_grad():
        hfm.close(model.eval()(ids), ref_logits, "logits of the restored model", rel=1e-4)
    start = next(e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "start")
    assert start["config"]["train"]["init_from"] == f"hf:{path.resolve()}"
    return start["init_from"]


def test_one_process_from_hf(qwen, tmp_path, hfm):
    path, ids, logits = qwen
    s = Session(f"hf:{path}", train=RUN)
    assert s.config.model.num_dense_layers == 1 and s.config.model.moe.top_k == 2
    assert not s.config.model.tie_embeddings
    run = s.submit("inline", folder=tmp_path / "one")
    assert run.status == "COMPLETED", run.error
    loaded = check_run(tmp_path / "one", path, ids, logits, hfm)
    assert loaded["bytes_read_per_rank"] == [loaded["checkpoint_bytes"]]  # one process reads it all, once
    # a resume restores its own checkpoint and does not read the base again
    from moelab.parallel.env import DistEnv
    from moelab.train.trainer import Trainer

    trainer = Trainer(s.set("train.steps", 3).config, tmp_path / "one", env=DistEnv())
    try:
        trainer.setup()
        assert trainer.loaded is None and trainer.restored.step == 2
    finally:
        if trainer.writer:
            trainer.writer.close()
        trainer.stop.restore()


@pytest.mark.slow
@pytest.mark.parametrize("layout,nproc", [({"ep": 2}, 2), ({"fsdp": 2}, 2), ({"ep": 2, "fsdp": 4}, 4)])
def test_ep2_and_fsdp2_from_hf_read_only_their_share(qwen, tmp_path, hfm, layout, nproc):
    """EP=2 (dense weights FSDP-sharded over both ranks), FSDP=2 (experts sharded by rows too), and EP=2 x
    expert-FSDP=2 on 4 ranks (each rank: half of its EP rank's experts)."""
    path, ids, logits = qwen
    run = Session(f"hf:{path}", train=RUN, parallel=layout).submit("local", nproc=nproc, folder=tmp_path / "r")
    run.wait()
    assert run.status == "COMPLETED", (run.error, run.logs(rank=0))
    loaded = check_run(tmp_path / "r", path, ids, logits, hfm)
    per_rank, total = loaded["bytes_read_per_rank"], loaded["checkpoint_bytes"]
    # disjoint row ranges: together the ranks read the checkpoint exactly once, each well under all of it
    assert sum(per_rank) == total and max(per_rank) < 1.5 / nproc * total, (per_rank, total)


@pytest.mark.slow
def test_tp2_from_hf(qwen, tmp_path, hfm):
    """TP=2: each rank fills its heads' rows of q/k/v, its columns of o and of the MLPs' down projections, its
    vocabulary rows of the embedding and the head; the run's logits are the checkpoint's."""
    path, ids, logits = qwen
    run = Session(f"hf:{path}", train=RUN, parallel={"tp": 2}).submit("local", nproc=2, folder=tmp_path / "r")
    run.wait()
    assert run.status == "COMPLETED", (run.error, run.logs(rank=0))
    loaded = check_run(tmp_path / "r", path, ids, logits, hfm)
    per_rank, total = loaded["bytes_read_per_rank"], loaded["checkpoint_bytes"]
    # row shards read once between them; column shards read their rows whole (the files hold rows)
    assert total <= sum(per_rank) < 2 * total and max(per_rank) < total, (per_rank, total)


@pytest.mark.slow
def test_pp2_from_hf_on_the_command_line(qwen, tmp_path, hfm):
    path, ids, logits = qwen
    sets = [f"train.{k}={v}" for k, v in RUN.items()] + ["parallel.pp=2"]
    out = subprocess.run([sys.executable, "-m", "moelab", "run", f"hf:{path}", "--nproc", "2", "--out",
                          str(tmp_path / "pp"), *[a for kv in sets for a in ("--set", kv)]],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = check_run(tmp_path / "pp", path, ids, logits, hfm)
    per_rank, total = loaded["bytes_read_per_rank"], loaded["checkpoint_bytes"]
    assert sum(per_rank) == total and max(per_rank) < 0.75 * total, (per_rank, total)  # its stage's layers


def test_deepseek_v3_mla_from_hf(tmp_path, hfm):
    """MLA with q_lora, the rotary permutation, shared experts, a dense first layer, and the score-correction
    bias (a router buffer) taken from the checkpoint."""
    ref = hfm.build("deepseek_v3")
    path = tmp_path / "ds"
    ref.save_pretrained(path)
    ids = torch.randint(0, hfm.V, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = ref(ids).logits
    run = Session(f"hf:{path}", train=RUN).submit("inline", folder=tmp_path / "run")
    assert run.status == "COMPLETED", run.error
    check_run(tmp_path / "run", path, ids, logits, hfm)
    state = trained_state(tmp_path / "run")
    bias = ref.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().max() > 0
    torch.testing.assert_close(state["layers.1.ffn.router.expert_bias"], bias.float())


# ---------------------------------------------------------------------- reading slices
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_every_source_reads_any_row_range_as_its_full_tensor_does(tmp_path, hfm, family):
    """Rows a..b of every moelab tensor (stacked experts, DeepSeek's permuted rotary rows, GPT-OSS's interleaved
    gate|up) equal rows a..b of the whole tensor, and cost only their share of the bytes."""
    from moelab.hf import ADAPTERS
    from moelab.hf.safetensors_folder import SafetensorsFolder
    from moelab.hf.source import config_dict
    from moelab.config import Config

    hfm.build(family).save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    m = Config.from_dict(config_dict(f"hf:{tmp_path}")).model
    sources = ADAPTERS[family].sources(hf, m, SafetensorsFolder(tmp_path))
    for name, rows in sources.items():
        whole = rows.read()
        n = rows.shape[0] if rows.shape else 0
        for a, b in {(0, n), (1, max(1, n // 2)), (n // 3, n - 1), (n - 1, n)}:
            if 0 <= a <= b <= n:
                torch.testing.assert_close(rows.read(a, b), whole[a:b], rtol=0, atol=0, msg=f"{name} {a}:{b}")
    folder = SafetensorsFolder(tmp_path)
    lm = folder.rows("lm_head.weight" if "lm_head.weight" in folder else "model.embed_tokens.weight")
    lm.read(0, lm.shape[0] // 4)
    assert folder.bytes_read == lm.shape[0] // 4 * lm.shape[1] * 4  # fp32 file: a quarter of the rows


def test_fp8_and_mxfp4_rows_are_dequantized_like_the_whole_tensor(tmp_path):
    """Block-FP8 rows that start and end inside a scale block, and MXFP4 expert ranges."""
    from safetensors.torch import save_file

    from moelab.hf.safetensors_folder import SafetensorsFolder

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(10, 7, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 2, generator=g) + 0.5  # blocks of 4 x 4
    blocks = torch.randint(0, 256, (4, 6, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 130, (4, 6, 2), generator=g, dtype=torch.uint8)
    save_file({"w": w, "w_scale_inv": scale, "x_blocks": blocks, "x_scales": scales}, str(tmp_path / "a.safetensors"))
    fp8 = SafetensorsFolder(tmp_path, {"method": "fp8", "block": (4, 4)})
    whole = fp8.get("w")
    torch.testing.assert_close(whole[5, 6], w[5, 6].float() * scale[1, 1])
    for a, b in [(0, 10), (3, 9), (5, 6), (8, 10)]:
        torch.testing.assert_close(fp8.rows("w").read(a, b), whole[a:b], rtol=0, atol=0)
    mx = SafetensorsFolder(tmp_path, {"method": "mxfp4"})
    assert mx.shape("x") == (4, 64, 6)
    whole = mx.get("x")
    before = mx.bytes_read
    torch.testing.assert_close(mx.rows("x").read(1, 3), whole[1:3], rtol=0, atol=0)
    assert mx.bytes_read - before == (blocks[1:3].numel() + scales[1:3].numel())


def test_load_into_shows_a_progress_bar_and_fills_a_placed_model(qwen, capsys):
    from moelab.hf.sharded_load import load_into
    from moelab.hf.source import load_config
    from moelab.model.transformer import MoETransformer

    path, ids, logits = qwen
    cfg = load_config(f"hf:{path}")
    model = MoETransformer(cfg.model, cfg.backend)  # random init
    stats = load_into(model, cfg, progress=True)
    assert "loading " + path.name in capsys.readouterr().err
    assert stats["bytes_read_per_rank"] == [stats["checkpoint_bytes"]]
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), logits, rtol=1e-4, atol=1e-4)


def test_the_checkpoint_is_part_of_the_run_identity(qwen, tmp_path):
    """A resume of the run must start from the same base: train.init_from is not a resumable field."""
    from moelab.train.checkpoint import config_identity

    path, _, _ = qwen
    a = Session(f"hf:{path}").config
    other = copy_checkpoint(path, tmp_path / "other")
    b = Session(f"hf:{other}").config
    assert a.train.init_from != b.train.init_from and config_identity(a) != config_identity(b)


# ---------------------------------------------------------------------- bad input, before any rank starts
def copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_folder_without_config_or_weights_is_refused(qwen, tmp_path):
    path, _, _ = qwen
    with pytest.raises(ConfigError, match="is not a folder"):
        Session(f"hf:{tmp_path / 'nowhere'}")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        Session(f"hf:{empty}")
    (empty / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"has no weights \(\*.safetensors\)"):
        Session(f"hf:{empty}")
    with pytest.raises(ConfigError, match="train.init_from='nope'"):
        Session("tiny", train={"init_from": "nope"})


def test_weights_that_do_not_match_are_refused_before_submit(qwen, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _, _ = qwen
    bad = copy_checkpoint(path, tmp_path / "bad")
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    name = "model.layers.1.self_attn.q_proj.weight"
    file = bad / index["weight_map"][name]
    tensors = load_file(file)
    tensors[name] = tensors[name][:-8]  # misshaped
    save_file(tensors, file, metadata={"format": "pt"})
    s = Session(f"hf:{bad}", train=RUN)
    with pytest.raises(ConfigError, match=r"layers.1.attention.q_proj.weight: checkpoint \[24, 32\], model \[32, 32\]"):
        s.submit("inline", folder=tmp_path / "r1")
    assert not (tmp_path / "r1" / "metrics.jsonl").exists()
    # a model override that the weights do not fit: the missing tensor is named
    with pytest.raises(ConfigError, match="train.init_from=.*model.layers.3.input_layernorm.weight' is missing"):
        Session(f"hf:{path}", train=RUN, model={"num_layers": 4}).submit("inline", folder=tmp_path / "r2")
    tensors[name] = torch.zeros(32, 32)
    tensors["model.layers.1.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, file, metadata={"format": "pt"})
    index["weight_map"]["model.layers.1.self_attn.extra.weight"] = index["weight_map"][name]
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"1 checkpoint tensors have no place in the model.*self_attn.extra"):
        Session(f"hf:{bad}", train=RUN).submit("inline", folder=tmp_path / "r4")
    del tensors[name], tensors["model.layers.1.self_attn.extra.weight"]
    index["weight_map"].pop("model.layers.1.self_attn.extra.weight")
    save_file(tensors, file, metadata={"format": "pt"})
    index["weight_map"].pop(name)
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="self_attn.q_proj.weight' is missing"):
        Session(f"hf:{bad}", train=RUN).submit("inline", folder=tmp_path / "r3")


@pytest.mark.parametrize("layout,nproc,match", [({"ep": 3}, 3, "parallel.ep=3: must divide model.moe.num_experts=8"),
                                                 ({"pp": 4}, 4, "parallel.pp=4")])
def test_layouts_the_checkpoint_cannot_be_split_across(qwen, tmp_path, layout, nproc, match):
    path, _, _ = qwen
    with pytest.raises(ConfigError, match=match):
        Session(f"hf:{path}", train=RUN, parallel=layout).submit("local", nproc=nproc, folder=tmp_path / "r")
    assert not (tmp_path / "r" / "run.json").exists()
