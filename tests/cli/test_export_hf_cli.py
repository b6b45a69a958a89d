"""`moelab export RUN --to hf OUT` and `run.export_hf(out)`: a run trained by `moelab run`, exported, loaded by
transformers with the logits of moelab's model; and the refusals as one line with exit status 2."""
import json
import os

import pytest
import torch

from moelab.cli import main

transformers = pytest.importorskip("transformers")
SETS = ["model.qk_norm=true", "model.num_layers=2", "model.moe.num_experts=8", "train.seq_len=16",
        "train.global_batch_size=2", "train.micro_batch_size=2", "train.device=cpu"]


def logits(model, vocab):
    ids = torch.randint(0, vocab, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)


def test_export_to_hf_from_the_command_line(tmp_path, capsys):
    from moelab import Run
    from moelab.hf import load_hf

    run = tmp_path / "run"
    args = ["run", "tiny", "--steps", "2", "--out", str(run)]
    for s in SETS:
        args += ["--set", s]
    assert main(args) == 0
    capsys.readouterr()

    out = tmp_path / "hf"
    assert main(["export", str(run), "--to", "hf", str(out), "--max-shard-size", "40KB"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()

    again = Run.load(run).export_hf(tmp_path / "api", dtype="bfloat16")  # the same from Python
    assert json.loads((again / "config.json").read_text())["dtype"] == "bfloat16"
    ours = load_hf(again, dtype=torch.float32)  # bf16 weights: rounded, so the reference is their own export
    torch.testing.assert_close(logits(theirs, 256), logits(load_hf(out), 256), rtol=1e-4, atol=1e-5)
    assert (logits(ours, 256) - logits(theirs, 256)).abs().max() < 0.05 * logits(theirs, 256).abs().max()

    # refusals: one line, exit status 2, naming what and how
    assert main(["export", str(run), "--to", "hf", str(out)]) == 2
    err = capsys.readouterr().err
    assert "moelab: config error: out=" in err and "not empty" in err and "--force" in err
    assert main(["export", str(run), "--to", "hf", str(out), "--force"]) == 0
    assert not (out / "model.safetensors.index.json").exists() and (out / "model.safetensors").is_file()
    capsys.readouterr()
    assert main(["export", str(run), "--to", "hf"]) == 2
    assert "OUT is required" in capsys.readouterr().err
    assert main(["export", str(run), "--to", "hf", str(tmp_path / "x"), "--lora", "merged"]) == 2
    assert "the run has no LoRA adapters" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--to", "hf", str(tmp_path / "y")]) == 2
    assert "not a run folder" in capsys.readouterr().err


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("export") / "run"
    args = ["run", "tiny", "--steps", "1", "--out", str(run)]
    for s in SETS:
        args += ["--set", s]
    assert main(args) == 0
    return run


def test_force_replaces_only_the_files_an_export_wrote(small_run, tmp_path, capsys):
    """Issue 42.9: --force used to delete every *.safetensors in OUT. Now it replaces the files an export writes
    (config.json, model*.safetensors, the index, adapters, tokenizer files) and nothing else."""
    out = tmp_path / "hf"
    assert main(["export", str(small_run), "--to", "hf", str(out), "--max-shard-size", "40KB"]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    (out / "weights.safetensors").write_bytes(b"a person's file")
    (out / "notes.txt").write_text("mine")
    assert main(["export", str(small_run), "--to", "hf", str(out), "--force"]) == 0  # shards -> one file
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt",
                                                     "weights.safetensors"]
    assert (out / "weights.safetensors").read_bytes() == b"a person's file"


def test_export_into_a_full_or_read_only_disk_is_one_line_and_leaves_nothing(small_run, tmpfs, capsys):
    disk = tmpfs(96 * 1024)  # less than the model's weights
    assert main(["export", str(small_run), "--to", "hf", str(disk / "hf")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "disk full" in err and "export again" in err and "resume" not in err, err
    assert list(disk.iterdir()) == []
    (disk / "hf").mkdir()  # a folder of the person's, with a file: the partial export goes, their file stays
    (disk / "hf" / "notes.txt").write_text("mine")
    assert main(["export", str(small_run), "--to", "hf", str(disk / "hf"), "--force"]) == 1
    assert "disk full" in capsys.readouterr().err and os.listdir(disk / "hf") == ["notes.txt"]

    ro = tmpfs(4 << 20)
    tmpfs.read_only(ro)
    assert main(["export", str(small_run), "--to", "hf", str(ro / "hf")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "read-only file system" in err, err
