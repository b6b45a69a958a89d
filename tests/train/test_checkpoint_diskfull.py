"""Disk full while saving a checkpoint, on a real file system that fills up (a small tmpfs; needs root, as CI
has): the save is refused before writing when the estimate does not fit, and one that runs out of space while
writing removes its partial folder; either way the error names the folder, the bytes needed and free and the
fix, older checkpoints stay intact, and the run resumes once space is freed. A checkpoints folder that is
read-only is the FolderWriteError of any other write to the run folder (moelab.contract.writes), an error event
without a traceback, and nothing that could pass for a checkpoint."""
from __future__ import annotations

import errno
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from moelab.config import load_config
from moelab.launch.resume import resume
from moelab.train import diskspace
from moelab.contract.checkpoints import list_checkpoints, verify
from moelab.train.checkpoint import DiskFullError
from moelab.contract.stream import read_events, write_durably
from moelab.contract.writes import FolderWriteError, append_line
from moelab.train.trainer import Trainer

# ~3.75 MB per checkpoint (1.17 MB of weights, twice that of AdamW moments)
OVERRIDES = {"train.steps": 4, "model.num_layers": 2, "train.seq_len": 32, "train.global_batch_size": 4,
             "train.micro_batch_size": 2, "train.device": "cpu", "train.warmup_steps": 1,
             "train.checkpoint_every": 2, "train.keep_checkpoints": 1}


def _cfg():
    return load_config("tiny", OVERRIDES)


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a few MB (mount(8) needs root; skipped where it cannot be mounted). Yields resize(size)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()

    def mount(size: str, remount: bool = False):
        opts = f"remount,size={size}" if remount else f"size={size}"
        return subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)], capture_output=True,
                              text=True)

    out = mount("6m")  # room for one checkpoint, not two
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({out.stderr.strip()}); run as root")
    try:
        yield mnt, lambda size: mount(size, remount=True).check_returncode()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _steps(run_dir: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "step"}


def _assert_names_folder_bytes_and_fix(message: str, run_dir: Path) -> None:
    assert message.startswith("disk full: checkpoint step 4 needs about ") and "bytes" in message
    assert f"in {run_dir / 'checkpoints'}," in message and "are free there" in message
    assert f"Free space and resume: moelab resume {run_dir}" in message
    assert "older checkpoints are intact" in message


def test_a_checkpoint_that_does_not_fit_is_refused_before_writing_and_resume_works_after(small_disk, tmp_path):
    disk, resize = small_disk
    baseline = tmp_path / "baseline"
    assert Trainer(_cfg(), baseline).run()["status"] == "COMPLETED"
    run = disk / "run"
    with pytest.raises(DiskFullError) as refused:
        Trainer(_cfg(), run).run()
    message = str(refused.value)
    _assert_names_folder_bytes_and_fix(message, run)
    assert "Nothing was written" in message
    need, free = (int(n.replace(",", "")) for n in re.findall(r"([\d,]+) bytes \(", message))
    assert 3_500_000 < need < 4_000_000 and free < need  # a checkpoint of ~3.75 MB; the refusal is right
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000002"], "no partial folder left"
    assert verify(run / "checkpoints/step_000002") == []
    error = read_events(run / "metrics.jsonl")[-1]
    assert error["event"] == "error" and error["message"].startswith("DiskFullError: disk full")
    print(f"\nRELIABILITY disk full: checkpoint of {need:,} bytes refused with {free:,} free (6 MiB tmpfs)")

    resize("20m")  # space freed
    assert resume(run).wait().summary()["status"] == "COMPLETED"
    assert _steps(run) == _steps(baseline), "the resumed run trains steps 3-4 exactly as the uninterrupted one"
    assert [p.name for p in list_checkpoints(run)] == ["step_000004"]


def test_a_disk_that_fills_up_while_writing_loses_only_the_partial_checkpoint(small_disk):
    disk, _ = small_disk
    run = disk / "run"
    trainer = Trainer(_cfg(), run)
    trainer.setup()
    try:
        trainer.checkpointer.save(2, trainer.model, trainer.optimizer)
        free_before = diskspace.free_bytes(run)
        # as where a quota hides the real limit: the save starts and meets the full disk while writing
        with pytest.raises(DiskFullError) as full:
            trainer.checkpointer.save(4, trainer.model, trainer.optimizer, check_space=False)
    finally:
        trainer.stop.restore()
    _assert_names_folder_bytes_and_fix(str(full.value), run)
    assert f"The partial checkpoint {run / 'checkpoints/.step_000004.tmp'} was removed" in str(full.value)
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000002"]
    assert verify(run / "checkpoints/step_000002") == []
    assert diskspace.free_bytes(run) == free_before, "the disk is not left full"
    assert diskspace.no_space_error(full.value.__cause__), "torch's own error is kept as the cause"


def test_the_estimate_from_the_state_dict_is_close_to_what_is_written_and_not_below(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    trainer = Trainer(_cfg(), tmp_path / "run")
    trainer.setup()
    try:
        model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
        estimate = diskspace.state_bytes({"model": model_sd, "optim": optim_sd})
        path = trainer.checkpointer.save(2, trainer.model, trainer.optimizer)
    finally:
        trainer.stop.restore()
    written = diskspace.folder_bytes(path)
    assert written <= estimate <= 1.1 * written, (estimate, written)
    print(f"\nRELIABILITY checkpoint size estimate {estimate:,} bytes for {written:,} written "
          f"({100 * (estimate / written - 1):+.1f}%)")


def test_no_space_is_recognised_from_a_real_enospc_and_under_torchs_runtime_error(tmp_path):
    with pytest.raises(OSError) as real:
        write_durably(Path("/dev/full"), b"x" * 10000)  # the kernel's always-full device
    assert real.value.errno == errno.ENOSPC and diskspace.no_space_error(real.value)
    try:
        try:
            write_durably(Path("/dev/full"), b"x" * 10000)
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as e:  # what torch's zip writer raises, with the OSError as its context
        assert diskspace.no_space_error(e)
    assert not diskspace.no_space_error(RuntimeError("something else")) and not diskspace.no_space_error(None)
    # a failed write takes back its own half-written file, never the device it wrote to (as root it could)
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)
    free = diskspace.free_bytes(tmp_path / "not" / "made" / "yet")  # measured on the nearest existing parent
    assert free > 0 and diskspace.shortage(free + 1, free) == 1 and diskspace.shortage(free, free) is None
    assert diskspace.left_too_little(need=10 << 20, written=1 << 20, free=5 << 20)
    assert not diskspace.left_too_little(need=10 << 20, written=9 << 20, free=5 << 20)


def test_two_ranks_refuse_together_and_resume_once_space_is_freed(small_disk):
    """With 2 gloo processes every rank raises the same DiskFullError at the same step (none waits in a
    collective for a peer that gave up), and the run resumes on 2 processes once space is freed."""
    from moelab.launch.local import RankFailed, run_local_processes

    disk, resize = small_disk
    run = disk / "run"
    with pytest.raises(RankFailed, match="DiskFullError: disk full: checkpoint step 4"):
        run_local_processes(_cfg(), run, 2)
    errors = [e for e in read_events(run / "metrics.jsonl") if e["event"] == "error"]
    assert sorted(e["rank"] for e in errors) == [0, 1]
    assert all(e["step"] == 4 and e["message"].startswith("DiskFullError: disk full") for e in errors)
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000002"]
    assert verify(run / "checkpoints/step_000002") == []
    resize("20m")
    assert resume(run).wait().summary()["status"] == "COMPLETED"
    assert sorted(_steps(run)) == [1, 2, 3, 4]


def test_a_read_only_checkpoints_folder_fails_as_any_folder_write_and_resume_works_after(tmpfs, tmp_path):
    baseline = tmp_path / "baseline"
    assert Trainer(_cfg(), baseline).run()["status"] == "COMPLETED"
    disk = tmpfs(8 << 20)
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(disk)  # the run folder writable, its checkpoints read-only
    tmpfs.read_only(disk)
    with pytest.raises(FolderWriteError) as saved:
        Trainer(_cfg(), run).run()
    with pytest.raises(FolderWriteError) as appended:  # what a metrics write there says
        append_line(disk / "metrics.jsonl", b"{}\n")
    shape = re.compile(r"(\S+): read-only file system: writing [\d,]+ bytes, [\d,]+ bytes free there; (.+)\. "
                       r"Make the folder writable, then resume the run \(`moelab resume (\S+)`\)")
    got, metrics = shape.fullmatch(str(saved.value)), shape.fullmatch(str(appended.value))
    assert got and metrics, (str(saved.value), str(appended.value))
    assert got.groups() == (str(run / "checkpoints/.step_000002.tmp"),
                            "nothing of checkpoint step 2 was written; older checkpoints are intact", str(run))
    assert saved.value.cause == appended.value.cause == "read-only file system"
    error = read_events(run / "metrics.jsonl")[-1]
    assert error["event"] == "error" and error["step"] == 2
    assert error["message"] == f"FolderWriteError: {saved.value}" and error["traceback"] == ""
    assert list(disk.iterdir()) == [] and list_checkpoints(run) == []
    tmpfs.read_only(disk, on=False)  # writable again
    assert resume(run).wait().summary()["status"] == "COMPLETED"
    assert _steps(run) == _steps(baseline)
    assert [p.name for p in list_checkpoints(run)] == ["step_000004"]
