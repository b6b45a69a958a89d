"""Live controls on one process (moelab.train.controls): a change lands at the step boundary it was due at,
is a `control` event, changes the training from the next step, travels in the checkpoint, and a resume after
it (the changes up to the checkpoint from the checkpoint, those after it replayed from controls.jsonl) gives
the uninterrupted run's losses exactly; freeze_router keeps the router weights; refusals write nothing."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from moelab.config import load_config
from moelab.contract.controls import append_request, read_controls
from moelab.contract.stream import read_events
from moelab.config.schedule import lr_at
from support import run_one_thread

STEPS = 6
OVERRIDES = {"train.steps": STEPS, "model.num_layers": 2, "model.hidden_size": 32, "model.moe.num_experts": 4,
             "model.moe.expert_ffn_size": 32, "train.seq_len": 16, "train.global_batch_size": 4,
             "train.micro_batch_size": 2, "train.device": "cpu", "train.warmup_steps": 1,
             "model.moe.capacity_factor": 1.25, "model.moe.dynamic_capacity": True,
             "train.checkpoint_every": 2, "train.keep_checkpoints": 10}
# due after step 1 (before the checkpoint at 2) and after step 3 (after it)
EARLY = {"model.moe.aux_loss_coeff": 0.05, "train.lr": 0.01}
LATE = {"model.moe.bias_update_rate": 0.02, "model.moe.capacity_factor": 1.5}


def _cfg(**extra):
    return load_config("tiny", {**OVERRIDES, **extra})


def _losses(run_dir) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_events(Path(run_dir) / "metrics.jsonl") if e["event"] == "step"}


def _controls(run_dir) -> list[dict]:
    return [e for e in read_events(Path(run_dir) / "metrics.jsonl") if e["event"] == "control"]


def _train(run_dir, early=EARLY, late=LATE):
    run_dir.mkdir(parents=True, exist_ok=True)
    if early:
        append_request(run_dir, early, who="test", at=1)
    if late:
        append_request(run_dir, late, who="test", at=3)
    return run_one_thread(_cfg(), run_dir)


@pytest.fixture(scope="module")
def steered(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("steered") / "run"
    trainer = _train(run_dir)
    return run_dir, trainer


def test_changes_land_at_their_step_as_control_events(steered, tmp_path):
    run_dir, trainer = steered
    events = _controls(run_dir)
    got = [(e["step"], e["field"], e["old"], e["new"]) for e in events]
    base = _cfg()
    assert got == [(1, "model.moe.aux_loss_coeff", base.model.moe.aux_loss_coeff, 0.05),
                   (1, "train.lr", base.train.lr, 0.01),
                   (3, "model.moe.bias_update_rate", base.model.moe.bias_update_rate, 0.02),
                   (3, "model.moe.capacity_factor", 1.25, 1.5)]
    assert all(e["who"] == "test" for e in events)
    # the values live in the trainer's config, which the routers read
    assert trainer.cfg.model.moe.aux_loss_coeff == 0.05
    assert trainer.par.moe_layers[0].router.cfg.bias_update_rate == 0.02
    # the folder's config.yaml is the run's as started
    assert load_config(run_dir / "config.yaml").model.moe.aux_loss_coeff == base.model.moe.aux_loss_coeff != 0.05
    steps = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "step"]
    assert steps[0]["lr"] == pytest.approx(lr_at(1, base))
    assert steps[1]["lr"] == pytest.approx(lr_at(2, base.replace(**{"train.lr": 0.01}))) != lr_at(2, base)
    # and step 2's update changed (its loss is before its update): a run without the changes has the same
    # losses up to step 2, and another at step 3
    plain = _losses(_train(tmp_path / "plain", None, None).run_dir)
    ours = _losses(run_dir)
    assert plain[2] == ours[2] and plain[3] != ours[3]
    _, outcomes = read_controls(run_dir)
    assert sorted(o["step"] for o in outcomes.values()) == [1, 3]


def test_resume_after_changes_reproduces_the_run_exactly(steered, tmp_path):
    run_dir, _ = steered
    full = _losses(run_dir)
    # the run as if killed after step 5 with its last checkpoint at 2: EARLY (step 1) is in that checkpoint,
    # LATE (step 3) only in controls.jsonl
    again = tmp_path / "again"
    shutil.copytree(run_dir, again)
    for p in (again / "checkpoints").iterdir():
        if p.name != "step_000002":
            shutil.rmtree(p)
    (again / "summary.json").unlink()
    # as live requests look (no `at`): only the checkpoint's state and the replay can place them at 1 and 3
    lines = [json.loads(line) for line in (again / "controls.jsonl").read_text().splitlines()]
    (again / "controls.jsonl").write_text("".join(json.dumps({k: v for k, v in rec.items() if k != "at"}) + "\n"
                                                  for rec in lines))
    trainer = run_one_thread(load_config(again / "config.yaml"), again)
    assert trainer.start_step == 2
    got = _losses(again)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in range(3, STEPS + 1)] == [full[s] for s in range(3, STEPS + 1)]  # exactly
    assert [(e["step"], e["field"]) for e in _controls(again)] == [
        (1, "model.moe.aux_loss_coeff"), (1, "train.lr"), (3, "model.moe.bias_update_rate"),
        (3, "model.moe.capacity_factor")]  # the replay recorded once, at its step


def test_checkpoint_now_and_freeze_router(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    append_request(run_dir, {"model.moe.freeze_router": True, "checkpoint": True}, who="test", at=3)
    trainer = run_one_thread(_cfg(**{"train.checkpoint_every": 0}), run_dir)
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved == ["step_000003", "step_000006"]
    # the routers did not move after step 3 (the weights in its checkpoint), the experts did
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(run_dir / "checkpoints" / "step_000003", tmp_path / "step3.pt")
    at3 = torch.load(tmp_path / "step3.pt")["model"]
    now = {k: v for k, v in trainer.model.state_dict().items()}
    routers = [k for k in now if k.endswith("router.weight")]
    experts = [k for k in now if ".experts." in k]
    assert routers and experts
    assert all(torch.equal(now[k], at3[k]) for k in routers)
    assert not any(torch.equal(now[k], at3[k]) for k in experts)


def test_a_request_the_ranks_refuse_is_recorded_not_applied(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    append_request(run_dir, {"model.moe.capacity_factor": 0.0}, who="test", at=2)  # dynamic capacity needs > 0
    run_one_thread(_cfg(**{"train.steps": 3}), run_dir)
    assert _controls(run_dir) == []
    warnings = [e for e in read_events(run_dir / "metrics.jsonl") if e.get("kind") == "control_rejected"]
    assert len(warnings) == 1 and "dynamic_capacity" in warnings[0]["message"]
    assert [o["kind"] for o in read_controls(run_dir)[1].values()] == ["rejected"]


# ---------------------------------------------------------------------- issue 42: changes never lost
Z = {"model.moe.z_loss_coeff": 0.01}


def _kill(run_dir: Path, keep: int) -> None:
    """The folder as a kill -9 after its last step would leave it, with its newest checkpoint at `keep`: the
    later checkpoints, the summary and the close of controls.jsonl never written."""
    for p in (run_dir / "checkpoints").iterdir():
        if int(p.name.split("_")[1]) > keep:
            shutil.rmtree(p)
    (run_dir / "summary.json").unlink()
    path = run_dir / "controls.jsonl"
    if path.is_file():
        path.write_text("".join(line for line in path.read_text().splitlines(keepends=True)
                                if json.loads(line)["kind"] != "closed"))


@pytest.fixture(scope="module")
def every3(tmp_path_factory):
    """Two runs with checkpoints at 3 and 6: one without changes, one with Z applied after step 3."""
    root = tmp_path_factory.mktemp("every3")
    cfg = _cfg(**{"train.checkpoint_every": 3})
    run_one_thread(cfg, root / "plain")
    (root / "z").mkdir()
    append_request(root / "z", Z, who="test", at=3)
    run_one_thread(cfg, root / "z")
    assert _losses(root / "plain")[6] != _losses(root / "z")[6]
    return root


def test_a_change_applied_where_the_resume_started_survives_the_next_resume(every3, tmp_path):
    # issue 42.3: killed at 5 (checkpoint 3), Z asked while down, resumed (Z at 3), killed at 5 again, resumed
    run = tmp_path / "run"
    shutil.copytree(every3 / "plain", run)
    _kill(run, 3)
    rid = append_request(run, Z, who="test")
    assert run_one_thread(load_config(run / "config.yaml"), run).start_step == 3
    assert read_controls(run)[1][rid]["step"] == 3
    _kill(run, 3)
    assert run_one_thread(load_config(run / "config.yaml"), run).start_step == 3
    assert _losses(run) == _losses(every3 / "z")  # exactly: Z replayed at 3, not taken as inside checkpoint 3
    assert [(e["step"], e["field"], e["new"]) for e in _controls(run)] == [(3, "model.moe.z_loss_coeff", 0.01)]
    # a fork of it at 3 without changes repeats its steps after 3: Z (outside checkpoint 3) comes with it
    from moelab.run.fork import prepare_fork
    from moelab.run.run import Run

    fork, _, _ = prepare_fork(Run.load(run), 3, tmp_path / "fork", {})
    run_one_thread(load_config(fork.config), fork.path)
    assert _losses(fork.path) == _losses(every3 / "z")


def test_a_fork_with_a_change_killed_before_its_first_checkpoint_stays_a_fork(every3, tmp_path):
    from moelab.run.fork import prepare_fork
    from moelab.run.run import Run

    fork, _, _ = prepare_fork(Run.load(every3 / "plain"), 3, tmp_path / "fork", Z)
    run_one_thread(load_config(fork.config), fork.path)
    assert _losses(fork.path) == _losses(every3 / "z")  # the fork is the run with Z at 3
    _kill(fork.path, 3)  # only the parent's checkpoint at 3 is left
    run_one_thread(load_config(fork.config), fork.path)
    assert _losses(fork.path) == _losses(every3 / "z")  # exactly, and not its parent's
    assert [(e["step"], e["field"]) for e in _controls(fork.path)] == [(3, "model.moe.z_loss_coeff")]


def test_a_request_while_the_run_completes_is_refused_and_never_applied_later(tmp_path, monkeypatch):
    # issue 42.1: asked while the last checkpoint is written (after the last step's boundary)
    from moelab.train.trainer import Trainer

    run_dir, asked, save = tmp_path / "run", [], Trainer.save_checkpoint

    def saving(self, step):
        if step == 3 and not asked:
            asked.append(append_request(self.run_dir, {"train.lr": 0.01}, who="test"))
        save(self, step)

    monkeypatch.setattr(Trainer, "save_checkpoint", saving)
    run_one_thread(_cfg(**{"train.steps": 3, "train.checkpoint_every": 0}), run_dir)
    outcome = read_controls(run_dir)[1][asked[0]]
    assert outcome["kind"] == "rejected" and outcome["step"] == 3
    assert "COMPLETED after step 3" in outcome["reason"] and f"moelab fork {run_dir} --step 3" in outcome["reason"]
    warned = [e for e in read_events(run_dir / "metrics.jsonl") if e.get("kind") == "control_rejected"]
    assert len(warned) == 1 and asked[0] in warned[0]["message"]
    from moelab.contract.controls import ControlsClosed

    with pytest.raises(ControlsClosed, match="COMPLETED after step 3"):
        append_request(run_dir, {"train.lr": 0.02}, who="test")  # after the close: refused, nothing written
    # a resume with more steps applies neither, and takes requests again while it trains
    monkeypatch.setattr(Trainer, "save_checkpoint", save)
    late = []
    step = Trainer.train_step

    def stepping(self, n):
        if n == 4:
            late.append(append_request(self.run_dir, {"train.lr": 0.03}, who="test"))
        return step(self, n)

    monkeypatch.setattr(Trainer, "train_step", stepping)
    run_one_thread(_cfg(**{"train.steps": 5, "train.checkpoint_every": 0}), run_dir)
    assert [(e["step"], e["new"]) for e in _controls(run_dir)] == [(4, 0.03)]
    kinds = [json.loads(line)["kind"] for line in (run_dir / "controls.jsonl").read_text().splitlines()]
    assert kinds == ["request", "rejected", "closed", "opened", "request", "applied", "closed"]


def test_a_line_cut_by_a_crash_is_reported_and_the_next_request_applies(tmp_path):
    # issue 42.2 on the ranks: a writer killed mid-append left a line without its newline
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / "controls.jsonl", "wb") as f:
        f.write(b'{"time": 1.0, "kind": "request", "id": "cut", "changes": {"train.l')
    append_request(run_dir, {"train.lr": 0.01}, who="test", at=1)
    from moelab.contract.controls import ControlsWarning

    with pytest.warns(ControlsWarning, match="controls.jsonl:1: not a control line"):
        run_one_thread(_cfg(**{"train.steps": 2}), run_dir)
    assert [(e["step"], e["field"], e["new"]) for e in _controls(run_dir)] == [(1, "train.lr", 0.01)]
    damaged = [e for e in read_events(run_dir / "metrics.jsonl") if e.get("kind") == "damaged_controls_line"]
    assert len(damaged) == 1 and "controls.jsonl:1: not a control line" in damaged[0]["message"]
