"""Checkpoints and resume: a run interrupted by a real signal and resumed gives the same loss at every step as
an uninterrupted one, the metrics stream has every step exactly once, and damaged checkpoints are detected,
reported and never loaded."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moelab.cli import main as cli_main
from moelab.config import ConfigError, load_config
from moelab.launch.resume import resume
from moelab.contract.checkpoints import CheckpointError, latest_checkpoint, list_checkpoints, read_metadata, verify
from moelab.contract.events import parse_event
from moelab.contract.stream import JsonlTail, read_events, rewind_metrics
from moelab.train.trainer import Trainer

STEPS = 8
# Small and CPU-only; bias updates and dynamic capacity make the Router's buffers part of the state to restore.
OVERRIDES = {"train.steps": STEPS, "model.num_layers": 2, "train.seq_len": 32, "train.global_batch_size": 4,
             "train.micro_batch_size": 2, "train.device": "cpu", "train.warmup_steps": 2,
             "model.moe.bias_update_rate": 0.01, "model.moe.capacity_factor": 1.25,
             "model.moe.dynamic_capacity": True, "train.checkpoint_every": 3, "train.keep_checkpoints": 3}


def _cfg(**extra):
    return load_config("tiny", {**OVERRIDES, **extra})


def _steps(run_dir) -> list[dict]:
    return [e for e in read_events(Path(run_dir) / "metrics.jsonl") if e["event"] == "step"]


def _losses(run_dir) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in _steps(run_dir)}


def _assert_same_losses(run_dir, baseline: dict[int, float]) -> None:
    steps = [e["step"] for e in _steps(run_dir)]
    assert steps == list(range(1, STEPS + 1)), f"every step exactly once, in order: {steps}"
    got = _losses(run_dir)
    worst = max(abs(got[s] - baseline[s]) for s in baseline)
    assert worst <= 1e-6, f"resumed losses differ from the uninterrupted run by up to {worst}"
    print(f"\nRELIABILITY resumed run matches the uninterrupted one at all {STEPS} steps (max |diff| {worst:.1e})")


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    """One uninterrupted run with checkpoints at steps 3, 6 and 8 (the end)."""
    run = tmp_path_factory.mktemp("baseline")
    summary = Trainer(_cfg(), run).run()
    assert summary["status"] == "COMPLETED"
    return run


def _copy_run(src: Path, dst: Path) -> Path:
    """A copy; of a run folder, as a run killed after its last step (no end event, no summary): a completed run
    is not resumed (the re-run rule), a crashed one is."""
    shutil.copytree(src, dst)
    if (dst / "metrics.jsonl").is_file():  # a run folder (a checkpoint folder is copied as it is)
        lines = (dst / "metrics.jsonl").read_text().splitlines(keepends=True)
        (dst / "metrics.jsonl").write_text("".join(x for x in lines if '"event": "end"' not in x))
        (dst / "summary.json").unlink(missing_ok=True)
    return dst


def _signal_when(run_dir: Path, step: int, signum: int, pid: int) -> threading.Thread:
    """Send `signum` to `pid` as soon as the stream shows `step` (a real signal, delivered mid-run)."""
    def watch():
        tail = JsonlTail(run_dir / "metrics.jsonl")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if any(e["event"] == "step" and e["step"] >= step for e in tail.poll()):
                os.kill(pid, signum)
                return
            time.sleep(0.01)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


# ---------------------------------------------------------------------- what a checkpoint is
def test_checkpoints_are_complete_verified_and_pruned(baseline):
    names = [p.name for p in list_checkpoints(baseline)]
    assert names == ["step_000003", "step_000006", "step_000008"]
    meta = read_metadata(baseline / "checkpoints/step_000008")
    assert meta["step"] == 8 and meta["world_size"] == 1 and meta["layout"]["fsdp"] == 1
    assert ".metadata" in meta["files"] and "rng/rank_00000.json" in meta["files"]
    assert all(not verify(p) for p in list_checkpoints(baseline))
    assert latest_checkpoint(baseline).name == "step_000008"
    events = read_events(baseline / "metrics.jsonl")
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [3, 6, 8]
    assert not list((baseline / "checkpoints").glob(".*tmp")), "no temp folder left behind"


def test_keep_checkpoints_keeps_only_the_newest(tmp_path):
    Trainer(_cfg(**{"train.steps": 4, "train.checkpoint_every": 1, "train.keep_checkpoints": 2}), tmp_path).run()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000003", "step_000004"]


def test_save_checkpoints_false_writes_none(tmp_path):
    summary = Trainer(_cfg(**{"train.steps": 2, "train.checkpoint_every": 1, "train.save_checkpoints": False}),
                      tmp_path).run()
    assert summary["status"] == "COMPLETED" and not list_checkpoints(tmp_path)


# ---------------------------------------------------------------------- interrupted and resumed
def test_sigterm_checkpoints_at_the_step_boundary_and_resume_is_exact(baseline, tmp_path):
    class SignalledAtStep4(Trainer):
        """A real SIGTERM to this process, sent right after step 4 (from the step loop itself: a watcher thread
        could miss a fast run and then hit the test process with no trainer handler left)."""

        def after_step(self, step, last):
            super().after_step(step, last)
            if step == 4:
                os.kill(os.getpid(), signal.SIGTERM)

    run = tmp_path / "run"
    summary = SignalledAtStep4(_cfg(), run).run()
    assert summary["status"] == "PREEMPTED"
    stopped = summary["steps"]
    assert 4 <= stopped < STEPS
    events = read_events(run / "metrics.jsonl")
    assert events[-1]["event"] == "end" and events[-1]["status"] == "PREEMPTED" and events[-1]["step"] == stopped
    assert latest_checkpoint(run).name == f"step_{stopped:06d}"
    assert any(e["event"] == "warning" and e["kind"] == "preempted" and "SIGTERM" in e["message"] for e in events)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "the trainer puts the previous handler back"

    summary = resume(run).wait().summary()
    assert summary["status"] == "COMPLETED" and summary["steps"] == STEPS
    assert summary["first_loss"] == _losses(baseline)[1], "the summary covers the steps before the resume"
    _assert_same_losses(run, _losses(baseline))
    starts = [e for e in read_events(run / "metrics.jsonl") if e["event"] == "start"]
    assert [s["start_step"] for s in starts] == [0, stopped]
    assert starts[1]["resumed_from"].endswith(f"step_{stopped:06d}")


def test_sigkill_resumes_from_the_last_periodic_checkpoint(baseline, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    from moelab.config import save_config

    save_config(_cfg(), run / "config.yaml")
    proc = subprocess.Popen([sys.executable, "-m", "moelab.launch.entry", str(run)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    _signal_when(run, 5, signal.SIGKILL, proc.pid).join()
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert latest_checkpoint(run).name in ("step_000003", "step_000006")
    killed_at = max(_losses_live(run))
    # a kill can cut the stream's last line; make sure that case is exercised
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"event": "step", "schema": 1, "step": 99, "lo')

    assert cli_main(["resume", str(run)]) == 0
    _assert_same_losses(run, _losses(baseline))
    events = read_events(run / "metrics.jsonl")
    kinds = [e.get("kind") for e in events if e["event"] == "warning"]
    assert "truncated_metrics_line" in kinds
    print(f"\nRELIABILITY SIGKILL at step {killed_at}: resumed from {events[-1]['summary']['start_step']}")


def _losses_live(run):
    return [e["step"] for e in read_events(run / "metrics.jsonl", live=True) if e["event"] == "step"]


# ---------------------------------------------------------------------- damaged checkpoints
CORRUPTIONS = {
    "truncated shard": lambda d: _truncate(d / "__0_0.distcp"),
    "flipped byte": lambda d: _flip(d / "__0_0.distcp"),
    "missing DCP metadata": lambda d: (d / ".metadata").unlink(),
    "missing metadata.json": lambda d: (d / "metadata.json").unlink(),
    "garbage metadata.json": lambda d: (d / "metadata.json").write_text("{not json"),
    "wrong step in metadata.json": lambda d: (d / "metadata.json").write_text(
        (d / "metadata.json").read_text().replace('"step": 8', '"step": 7')),
    "missing rng file": lambda d: (d / "rng/rank_00000.json").unlink(),
}


def _truncate(f: Path) -> None:
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)


def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_every_kind_of_damage_is_detected(baseline, tmp_path, kind):
    ckpt = _copy_run(baseline / "checkpoints/step_000008", tmp_path / "step_000008")
    CORRUPTIONS[kind](ckpt)
    problems = verify(ckpt)
    assert problems, f"{kind} went unnoticed"
    print(f"\nRELIABILITY damaged checkpoint detected ({kind}): {problems[0].split(': ', 1)[1]}")


def test_random_damage_to_any_checkpoint_file_is_detected(baseline, tmp_path):
    from hypothesis import HealthCheck, assume, given, settings
    from hypothesis import strategies as st

    ckpt = _copy_run(baseline / "checkpoints/step_000006", tmp_path / "step_000006")
    files = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())
    tally = [0, 0]

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(files), st.floats(0, 1, exclude_max=True), st.integers(1, 255),
           st.sampled_from(["flip", "cut", "append"]))
    def check(name, where, xor, how):
        f = ckpt / name
        original = f.read_bytes()
        pos = int(where * len(original))
        damaged = {"flip": original[:pos] + bytes([original[pos] ^ xor]) + original[pos + 1:],
                   "cut": original[:pos], "append": original + bytes([xor])}[how]
        if name == "metadata.json":  # whitespace changes in JSON change no value: not damage
            try:
                assume(json.loads(damaged) != json.loads(original))
            except ValueError:
                pass
        f.write_bytes(damaged)
        try:
            tally[0] += 1
            tally[1] += bool(verify(ckpt))
        finally:
            f.write_bytes(original)

    check()
    assert not verify(ckpt)
    assert tally[0] == tally[1], f"{tally[0] - tally[1]} damaged checkpoints went unnoticed"
    print(f"\nRELIABILITY random damage to checkpoint files: {tally[0]} tried, {tally[1]} detected")


def test_a_corrupt_newest_checkpoint_is_reported_and_the_previous_one_used(baseline, tmp_path):
    run = _copy_run(baseline, tmp_path / "run")
    _flip(run / "checkpoints/step_000008/__0_0.distcp")
    rewind = (run / "metrics.jsonl").read_text()
    summary = resume(run).wait().summary()
    assert summary["status"] == "COMPLETED"
    events = read_events(run / "metrics.jsonl")
    warnings = [e for e in events if e["event"] == "warning" and e["kind"] == "corrupt_checkpoint"]
    assert len(warnings) == 1 and "step_000008" in warnings[0]["message"] and "crc32" in warnings[0]["message"]
    assert [e for e in events if e["event"] == "start"][-1]["start_step"] == 6
    assert list((run / "checkpoints").glob("step_000008.corrupt-*")), "the damaged folder is kept aside"
    assert not verify(run / "checkpoints/step_000008"), "a fresh step 8 checkpoint replaced it"
    _assert_same_losses(run, _losses(baseline))
    assert rewind != (run / "metrics.jsonl").read_text()


def test_no_usable_checkpoint_fails_with_a_clear_message(baseline, tmp_path, capsys):
    run = _copy_run(baseline, tmp_path / "run")
    for ckpt in list_checkpoints(run):
        _truncate(ckpt / "__0_0.distcp")
    with pytest.raises(CheckpointError, match="no usable checkpoint.*truncated"):
        resume(run)
    run2 = _copy_run(baseline, tmp_path / "run2")
    for ckpt in list_checkpoints(run2):
        (ckpt / "metadata.json").unlink()
    assert cli_main(["resume", str(run2)]) == 2
    assert "no usable checkpoint" in capsys.readouterr().err


def test_resuming_with_another_model_config_is_refused_naming_the_field(baseline, tmp_path):
    run = _copy_run(baseline, tmp_path / "run")
    before = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"different config.*model\.moe\.num_experts: 16 -> 8"):
        Trainer(_cfg(**{"model.moe.num_experts": 8}), run).run()
    assert (run / "config.yaml").read_text() == before, "the folder's config is left as it was"


def test_resume_of_a_folder_without_a_run_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not a run folder"):
        resume(tmp_path)


# ---------------------------------------------------------------------- the stream on resume
def test_rewind_drops_steps_after_the_checkpoint_and_a_cut_last_line(tmp_path):
    from moelab.contract.stream import MetricsWriter

    path = tmp_path / "metrics.jsonl"
    w = MetricsWriter(path)
    w.emit(parse_event(dict(event="start", start_step=0)))
    for s in range(1, 6):
        w.emit(parse_event(dict(event="step", step=s, loss=1.0 / s)))
        if s == 3:
            w.emit(parse_event(dict(event="checkpoint", step=3, path="x")))
    w.emit(parse_event(dict(event="checkpoint", step=5, path="y")))
    w.close()
    with open(path, "ab") as f:
        f.write(b'{"event": "st')
    records, notes = rewind_metrics(path, 3)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [n["kind"] for n in notes] == ["truncated_metrics_line"] and "half-written" in notes[0]["message"]
    events = read_events(path)
    assert [(e["event"], e.get("step")) for e in events] == [
        ("start", None), ("step", 1), ("step", 2), ("step", 3), ("checkpoint", 3)]
