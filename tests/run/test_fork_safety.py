"""Issue 42 items 6-8 and 18: a fork is as safe as a run. Its name follows a run's name rules (never a folder
outside the parent's), its folder name holds no '=' or ',', a checkpoint the parent rotates away mid-copy is
never used (the partial fork is removed: "fork again"), and a full or read-only disk is one line with nothing
left behind. The disks are real (a tmpfs, tests/conftest.py); the parent is a real finished run."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from moelab import Session
from moelab.config import ConfigError
from moelab.contract.writes import FolderWriteError
from moelab.run import fork as fork_module
from moelab.run.fork import default_folder, fork_label, prepare_fork
from moelab.run.run import Run
from support import fill_disk, moelab_cli

SMALL = {"model": {"num_layers": 2, "hidden_size": 32, "moe": {"num_experts": 4, "expert_ffn_size": 32}},
         "train": {"seq_len": 16, "global_batch_size": 4, "micro_batch_size": 2, "device": "cpu",
                   "warmup_steps": 1}}


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    folder = tmp_path_factory.mktemp("parent") / "run"
    return Session("tiny", model=SMALL["model"], train={**SMALL["train"], "steps": 4, "checkpoint_every": 2,
                                                         "keep_checkpoints": 5}).submit("inline", folder=folder)


def _tree(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.parametrize("name", ["../../../../x", "a/b", "a\tb", "..", ".hidden", ""])
def test_a_fork_name_follows_the_rules_of_a_run_name(parent, name):
    before = _tree(parent.folder.parent.parent)
    with pytest.raises(ConfigError, match=r"name=.*must be 1-128 characters.*fork's name") as e:
        parent.fork(step=2, name=name, executor="inline")
    assert "\n" not in str(e.value)
    assert _tree(parent.folder.parent.parent) == before, "nothing written anywhere"


def test_moelab_fork_refuses_a_name_that_leaves_the_folder_in_one_line(parent, tmp_path):
    cli = moelab_cli("fork", parent.folder, "--step", 2, "--name", "../../../../x", "--executor", "inline")
    assert cli.returncode == 2, cli.stderr
    assert cli.stderr.count("\n") == 1 and "config error: name='../../../../x'" in cli.stderr


def test_fork_folder_names_hold_no_equals_or_comma(parent):
    folder = default_folder(parent, 2, None, {"model.moe.aux_loss_coeff": 0.01, "train.lr": 1e-3})
    assert folder.name == f"{parent.folder.name}-fork2-aux_loss_coeff-0.01+lr-0.001"
    assert default_folder(parent, 2, None, {}).name.endswith("-fork2-same")
    assert fork_label({"data.path": "/a b/c,d=e"}) == "path--a-b-c-d-e"


def test_a_checkpoint_rotated_away_mid_copy_leaves_no_fork(parent, tmp_path, monkeypatch):
    """The parent's rotation (Checkpointer: older step folders removed) happening while the fork copies: the
    first file is copied, then the step folder goes, as a running parent with keep_checkpoints=1 does."""
    source = tmp_path / "moving"
    shutil.copytree(parent.folder, source)
    moving = Run.load(source)
    real = fork_module._link_or_copy
    copied = []

    def rotate_after_first(src, dst):
        real(src, dst)
        copied.append(src)
        if len(copied) == 1:
            shutil.rmtree(source / "checkpoints" / "step_000002")

    monkeypatch.setattr(fork_module, "_link_or_copy", rotate_after_first)
    dest = tmp_path / "fork"
    with pytest.raises(ConfigError, match="fork again") as e:
        prepare_fork(moving, 2, dest, {})
    assert "while it was copied" in str(e.value) and "step 2" in str(e.value)
    assert not dest.exists(), "no partial fork left"


def test_a_checkpoint_rewritten_mid_copy_is_caught_by_verifying_the_copy(parent, tmp_path, monkeypatch):
    """A file that changes under the copy (its bytes no longer match the metadata's crc32): the copy is verified
    after copying, never trusted."""
    source = tmp_path / "moving"
    shutil.copytree(parent.folder, source)

    def copy_then_corrupt(src, dst):  # a copy (no hard link), whose bytes then change
        shutil.copy2(src, dst)
        if not src.endswith("metadata.json") and os.path.getsize(dst) > 0:
            with open(dst, "r+b") as f:
                f.write(b"\xff" * 8)

    monkeypatch.setattr(fork_module, "_link_or_copy", copy_then_corrupt)
    dest = tmp_path / "fork"
    with pytest.raises(ConfigError, match="fork again"):
        prepare_fork(Run.load(source), 2, dest, {})
    assert not dest.exists()


def test_without_interference_the_copy_is_whole(parent, tmp_path):
    from moelab.contract.checkpoints import verify

    dest, _, _ = prepare_fork(parent, 2, tmp_path / "fork", {})
    assert verify(dest.checkpoints / "step_000002") == []


@pytest.mark.parametrize("empty_folder_there", [False, True])
def test_a_fork_into_a_full_disk_is_one_line_and_leaves_nothing(parent, tmpfs, empty_folder_there):
    disk = tmpfs(512 * 1024)
    dest = disk / "fork"
    if empty_folder_there:
        dest.mkdir()
    fill_disk(disk)
    with pytest.raises(FolderWriteError) as e:
        prepare_fork(parent, 2, dest, {"aux_loss_coeff": 0.02})
    text = str(e.value)
    assert e.value.cause == "disk full" and "fork again" in text and "resume" not in text and "\n" not in text
    assert "nothing is left behind" in text
    assert sorted(os.listdir(disk)) == (["filler", "fork"] if empty_folder_there else ["filler"])
    if empty_folder_there:
        assert os.listdir(dest) == []


def test_moelab_fork_into_a_read_only_disk_is_one_line(parent, tmpfs):
    disk = tmpfs(4 << 20)
    tmpfs.read_only(disk)
    cli = moelab_cli("fork", parent.folder, "--step", 2, "--out", disk / "fork", "--executor", "inline")
    assert cli.returncode == 1 and cli.stderr.count("\n") == 1, cli.stderr
    assert "read-only file system" in cli.stderr and "fork again" in cli.stderr and "resume" not in cli.stderr
    assert os.listdir(disk) == []
