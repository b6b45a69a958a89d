"""The Run side of live controls and forks: Run.set / `moelab set` refuse a field that cannot change and a bad
value with the config's message and leave every byte of the folder as it was; a change asked of a run that
trains on the local executor is applied at a step boundary and recorded; a fork without changes repeats its
parent's steps after k exactly, and a fork with a change starts it at k and knows its parent."""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from moelab import Session
from moelab.config import ConfigError
from moelab.contract.stream import read_events
from moelab.run.run import Run
from support import moelab_cli

SMALL = {"model": {"num_layers": 2, "hidden_size": 32, "moe": {"num_experts": 4, "expert_ffn_size": 32}},
         "train": {"seq_len": 16, "global_batch_size": 4, "micro_batch_size": 2, "device": "cpu",
                   "warmup_steps": 1}}


def _session(**train):
    return Session("tiny", model=SMALL["model"], train={**SMALL["train"], **train})


def _bytes(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _losses(folder) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_events(Path(folder) / "metrics.jsonl") if e["event"] == "step"}


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    folder = tmp_path_factory.mktemp("parent") / "run"
    return _session(steps=6, checkpoint_every=2, keep_checkpoints=5).submit("inline", folder=folder)


def test_refusals_and_bad_values_leave_the_folder_untouched(parent, tmp_path):
    run = Run.load(parent.folder)
    before = _bytes(run.folder)
    with pytest.raises(ConfigError, match=r"model.moe.num_experts=16: cannot change while a run trains"):
        run.set(num_experts=16)
    with pytest.raises(ConfigError, match=r"parallel.ep=2: cannot change .*layout"):
        run.set({"parallel.ep": 2})
    with pytest.raises(ConfigError, match=r"model.moe.capacity_factor=-1.0: must be >= 0"):
        run.set(capacity_factor=-1)
    with pytest.raises(ConfigError, match=r"model.moe.aux_loss_coef.*did you mean 'model.moe.aux_loss_coeff'"):
        run.set({"model.moe.aux_loss_coef": 0.1})
    with pytest.raises(ConfigError, match=r"model.moe.dynamic_capacity=True: needs model.moe.capacity_factor > 0"):
        run.set(dynamic_capacity=True)  # the config's own rule, on the config as it trains
    cli = moelab_cli("set", run.folder, "model.num_layers=4")
    assert cli.returncode == 2 and "model.num_layers=4: cannot change while a run trains" in cli.stderr
    assert _bytes(run.folder) == before
    with pytest.raises(ConfigError, match=r"at=-1: the step after which the change applies, an integer >= 0"):
        run.set(aux_loss_coeff=0.1, at=-1)
    assert _bytes(run.folder) == before
    with pytest.raises(ConfigError, match="COMPLETED"):
        Run.load(parent.folder).set(aux_loss_coeff=0.1)  # a finished run: fork it instead


def test_a_fork_without_changes_repeats_the_parent_after_k(parent, tmp_path):
    child = parent.fork(step=2, folder=tmp_path / "same", executor="inline")
    assert child.status == "COMPLETED" and child.parent["step"] == 2
    assert Path(child.parent["parent"]) == parent.folder.resolve()
    assert _losses(child.folder) == _losses(parent.folder)  # steps 1-2 copied, 3-6 trained again: equal exactly
    assert child.controls == []


def test_a_fork_with_a_change_applies_it_at_k(parent, tmp_path):
    before = _bytes(parent.folder)
    child = parent.fork(step=4, name="aux", executor="inline", aux_loss_coeff=0.2, lr=0.01)
    assert child.folder == parent.folder.parent / f"{parent.folder.name}-fork4-aux"
    assert [(e["step"], e["field"], e["new"]) for e in child.controls] == [
        (4, "model.moe.aux_loss_coeff", 0.2), (4, "train.lr", 0.01)]
    mine, theirs = _losses(child.folder), _losses(parent.folder)
    assert [mine[s] for s in range(1, 6)] == [theirs[s] for s in range(1, 6)]  # step 5's loss precedes its update
    assert mine[6] != theirs[6]
    assert _bytes(parent.folder) == before  # the parent is only read
    with pytest.raises(ConfigError, match="no intact checkpoint there; its checkpoints"):
        parent.fork(step=3, executor="inline")
    with pytest.raises(ConfigError, match="model.moe.top_k=1: cannot change"):
        parent.fork(step=4, executor="inline", top_k=1)


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["local", pytest.param("slurm", marks=pytest.mark.slurm)])
def test_set_while_a_run_trains(tmp_path, request, executor):
    """Run.set and `moelab set` reach a running run through its folder; on SLURM on two EP ranks."""
    if executor == "slurm":
        request.getfixturevalue("slurm_cluster")
        run = _session(steps=2000).set("parallel.ep", 2).submit("slurm", nproc=2, folder=tmp_path / "live",
                                                                time=10)
    else:
        run = _session(steps=2000).submit("local", folder=tmp_path / "live")
    try:
        deadline = time.monotonic() + 240
        while not any(e["event"] == "step" for e in run.events) and time.monotonic() < deadline:
            assert run.status in ("PENDING", "RUNNING"), run.error
            time.sleep(0.5)
        outcome = run.set(aux_loss_coeff=0.05, wait=120)
        assert outcome is not None and outcome["kind"] == "applied", outcome
        cli = moelab_cli("set", run.folder, "bias_update_rate=0.01", "--wait", "120")
        assert cli.returncode == 0 and "applied after step" in cli.stdout, cli.stderr
    finally:
        run.cancel()
        run.wait(120)
    controls = [(e["field"], e["new"], e["who"].split()[-1]) for e in run.controls]
    assert controls == [("model.moe.aux_loss_coeff", 0.05, "notebook"), ("model.moe.bias_update_rate", 0.01, "cli")]
    assert run.controls[0]["step"] == outcome["step"] <= run.controls[1]["step"]
    events = run.events
    assert not [e for e in events if e["event"] == "error"]
    assert max(e["step"] for e in events if e["event"] == "step") > run.controls[1]["step"]  # trained on after it


@pytest.mark.slow
def test_set_at_a_step_lands_after_that_step(tmp_path):
    """Run.set(at=K), asked as the run starts, applies at the boundary after step K exactly; `moelab set --at`
    asked of a run already past its step applies at the next boundary."""
    run = _session(steps=2000).submit("local", folder=tmp_path / "at")
    try:
        outcome = run.set(aux_loss_coeff=0.05, at=3, wait=240)
        assert outcome is not None and outcome["kind"] == "applied" and outcome["step"] == 3, outcome
        cli = moelab_cli("set", run.folder, "bias_update_rate=0.01", "--at", "1", "--wait", "240")
        assert cli.returncode == 0 and "applied after step" in cli.stdout, (cli.stdout, cli.stderr)
    finally:
        run.cancel()
        run.wait(120)
    steps = [(e["field"], e["step"]) for e in run.controls]
    assert steps[0] == ("model.moe.aux_loss_coeff", 3)
    assert steps[1][0] == "model.moe.bias_update_rate" and steps[1][1] >= 3


def test_a_sweep_of_forks_is_compared_by_its_changes(parent, tmp_path):
    from moelab.run.sweep import Sweep

    forks = Sweep.fork(parent, {"model.moe.aux_loss_coeff": [0.0, 0.3]}, step=4, folder=tmp_path / "forks",
                       executor="inline")
    assert forks.status == ["COMPLETED", "COMPLETED"] and [f.parent["step"] for f in forks] == [4, 4]
    table = forks.compare().table
    rows = table.to_dict("records") if hasattr(table, "to_dict") else table
    assert [r["model.moe.aux_loss_coeff"] for r in rows] == [0.0, 0.3]
    assert Sweep.load(tmp_path / "forks").folder == tmp_path / "forks"
    with pytest.raises(ConfigError, match="model.moe.num_experts=8: cannot change"):
        Sweep.fork(parent, {"num_experts": [8]}, step=4, folder=tmp_path / "bad", executor="inline")
    assert not (tmp_path / "bad").exists()


def test_moelab_fork_from_the_shell(parent, tmp_path):
    out = tmp_path / "cli-fork"
    cli = moelab_cli("fork", parent.folder, "--step", 2, "--executor", "inline", "--out", out)
    assert cli.returncode == 0, cli.stderr
    assert "at step 2" in cli.stdout
    assert _losses(out) == _losses(parent.folder)
    cli = moelab_cli("fork", parent.folder, "--step", 2, "--out", tmp_path / "bad", "--set",
                     "model.hidden_size=64")
    assert cli.returncode == 2 and "model.hidden_size=64: cannot change" in cli.stderr
    assert not (tmp_path / "bad").exists()


# ---------------------------------------------------------------------- issue 42: changes never lost
def test_a_finished_run_refuses_a_change_and_names_the_fork(parent):
    with pytest.raises(ConfigError, match=r"COMPLETED: there is no step left.*`moelab fork "):
        Run.load(parent.folder).set(lr=0.001)
    cli = moelab_cli("set", parent.folder, "train.lr=0.001", "--wait", "5")
    assert cli.returncode == 2 and f"moelab fork {parent.folder}" in cli.stderr, cli.stderr
    assert "next step boundary" not in cli.stdout + cli.stderr and len(cli.stderr.strip().splitlines()) == 1
    lines = (parent.folder / "controls.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["kind"] == "closed"  # closed as it completed, nothing after it


def _stopped(folder: Path, config: Path) -> Path:
    """A PREEMPTED run's folder (a change asked of it applies when it is resumed): config, run.json, stream."""
    from moelab.contract.events import EndEvent, StartEvent
    from moelab.contract.folder import RunFolder
    from moelab.contract.stream import MetricsWriter

    run = RunFolder(folder)
    folder.mkdir()
    run.config.write_bytes(config.read_bytes())
    run.write_info({"name": "x", "executor": "inline", "status": "PREEMPTED"})
    w = MetricsWriter(run.metrics)
    w.emit(StartEvent(config={"name": "x"}, total_steps=6))
    w.emit(EndEvent(step=2, status="PREEMPTED"))
    return folder


def test_set_on_a_read_only_folder_or_a_full_disk_is_one_line_and_leaves_nothing(parent, tmpfs):
    from support import fill_disk

    disk = tmpfs(256 * 1024)
    run = _stopped(disk / "run", parent.folder / "config.yaml")
    before = _bytes(run)
    fill_disk(disk)
    for cause in ("disk full", "read-only file system"):
        with pytest.raises(OSError, match=cause):
            Run.load(run).set(lr=0.001)
        cli = moelab_cli("set", run, "train.lr=0.001")
        assert cli.returncode == 1 and cause in cli.stderr and str(run / "controls.jsonl") in cli.stderr
        assert len(cli.stderr.strip().splitlines()) == 1, cli.stderr  # one line, no traceback
        assert _bytes(run) == before  # no empty controls.jsonl left behind
        tmpfs.read_only(disk)


def test_set_reads_only_what_is_new(parent, tmp_path, monkeypatch):
    # issue 42.5: config.yaml parsed once, controls.jsonl read once and then only what was appended
    import moelab.run.controls as run_controls

    run = _stopped(tmp_path / "run", parent.folder / "config.yaml")
    parsed = []
    load = run_controls.load_config
    monkeypatch.setattr(run_controls, "load_config", lambda *a: parsed.append(a) or load(*a))
    folder = Run.load(run)
    ids = [folder.set(aux_loss_coeff=0.001 * (i + 1)) for i in range(300)]
    assert len(parsed) == 1
    requests, _ = run_controls.read_controls(run)
    assert [r["id"] for r in requests] == ids
    assert [r["changes"]["model.moe.aux_loss_coeff"] for r in requests[-2:]] == [0.299, 0.3]
