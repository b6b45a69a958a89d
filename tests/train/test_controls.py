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
