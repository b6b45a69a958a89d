"""train.optimizer_state: AdamW's moments in bf16 next to fp32 master weights (bf16_moments), or everything bf16.
MomentsAdamW is torch's AdamW to the bit when its moments are fp32 (so the bf16 path differs only by the
rounding of the stored moments); the trainer allocates the state in the chosen dtypes, each choice learns as fp32
does on a learnable workload, and a bf16-moment run interrupted and resumed repeats the uninterrupted one."""
from __future__ import annotations

import os
import signal

import pytest
import torch

from moelab.config import ConfigError, load_config
from moelab.planner.plan import plan
from moelab.planner.states import state_bytes
from moelab.train.adamw_moments import MomentsAdamW
from moelab.contract.stream import read_events
from moelab.train.optim import build_optimizer
from moelab.train.trainer import Trainer

SMALL = {"model.num_layers": 2, "train.seq_len": 32, "train.global_batch_size": 4, "train.micro_batch_size": 2,
         "train.device": "cpu", "train.warmup_steps": 2}


def _losses(run_dir) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "step"}


def _groups(ws):
    return [{"params": ws[:1], "weight_decay": 0.1}, {"params": ws[1:], "weight_decay": 0.0}]


def test_moments_adamw_with_fp32_moments_is_torch_adamw_to_the_bit():
    torch.manual_seed(0)
    ref = [torch.randn(5, 7, requires_grad=True), torch.randn(7, requires_grad=True)]
    new = [w.detach().clone().requires_grad_() for w in ref]
    o_ref = torch.optim.AdamW(_groups(ref), lr=1e-2, betas=(0.9, 0.95), foreach=False)
    o_new = MomentsAdamW(_groups(new), moment_dtype=torch.float32, lr=1e-2, betas=(0.9, 0.95))
    for _ in range(5):
        for ws, opt in ((ref, o_ref), (new, o_new)):
            opt.zero_grad()
            ((ws[0] ** 2).sum() + ws[1].sin().sum()).backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ref, new))
    assert torch.equal(o_ref.state[ref[0]]["exp_avg_sq"], o_new.state[new[0]]["exp_avg_sq"])


def test_bf16_moments_are_the_fp32_moments_rounded():
    torch.manual_seed(0)
    w32, w16 = torch.randn(300, requires_grad=True), None
    w16 = w32.detach().clone().requires_grad_()
    o32 = MomentsAdamW([w32], moment_dtype=torch.float32, lr=1e-2)
    o16 = MomentsAdamW([w16], moment_dtype=torch.bfloat16, lr=1e-2)
    g = torch.randn(300)
    w32.grad, w16.grad = g.clone(), g.clone()
    o32.step(), o16.step()  # one step from zero moments: the bf16 moments are the fp32 ones, rounded to nearest
    s32, s16 = o32.state[w32], o16.state[w16]
    assert s16["exp_avg"].dtype == s16["exp_avg_sq"].dtype == torch.bfloat16 and w16.dtype == torch.float32
    assert torch.equal(s16["exp_avg"], s32["exp_avg"].to(torch.bfloat16))
    assert torch.equal(s16["exp_avg_sq"], s32["exp_avg_sq"].to(torch.bfloat16))
    assert torch.equal(w16, w32)  # the first update used the fp32 moments, before they were stored


@pytest.mark.parametrize("state, overrides, weight, moments", [
    ("fp32", {}, torch.float32, torch.float32),
    ("bf16_moments", {}, torch.float32, torch.bfloat16),
    ("bf16", {"train.dtype": "bfloat16", "train.param_dtype": "bfloat16"}, torch.bfloat16, torch.bfloat16),
])
def test_the_trainer_allocates_the_state_in_the_chosen_dtypes(tmp_path, state, overrides, weight, moments):
    cfg = load_config("tiny", {**SMALL, **overrides, "train.steps": 1, "train.optimizer_state": state})
    tr = Trainer(cfg, tmp_path)
    tr.run()
    for p in tr.model.parameters():
        s = tr.optimizer.state[p]
        assert p.dtype == weight and s["exp_avg"].dtype == s["exp_avg_sq"].dtype == moments
    b = state_bytes(cfg.train)
    assert (b.weight, b.moments) == ((4 if weight == torch.float32 else 2), (8 if moments == torch.float32 else 4))


def test_contradicting_dtypes_are_refused_naming_the_fix():
    with pytest.raises(ConfigError, match="train.optimizer_state.*param_dtype=bfloat16"):
        load_config("tiny", {"train.optimizer_state": "bf16"})
    with pytest.raises(ConfigError, match="train.optimizer_state.*no fp32 master"):
        load_config("tiny", {"train.optimizer_state": "bf16_moments", "train.dtype": "bfloat16",
                             "train.param_dtype": "bfloat16"})


STEPS = 40
# each choice against fp32 on the learnable synthetic Markov chain: after STEPS steps the mean loss of the
# last 5 steps is within TOLERANCE (relative) of fp32's, and every choice has learned (loss well below start)
# (measured: bf16_moments 0.01%; bf16 3.4%, its weights have no fp32 master, so updates below bf16's resolution
# are lost; at 60 steps it trails by 9%: bf16_moments is the choice that saves memory at no cost in loss)
TOLERANCE = {"bf16_moments": 0.005, "bf16": 0.06}


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("fp32")
    Trainer(load_config("tiny", {**SMALL, "train.steps": STEPS, "train.optimizer_state": "fp32"}), run).run()
    return _losses(run)


@pytest.mark.parametrize("state", ["bf16_moments", "bf16"])
def test_each_state_precision_converges_as_fp32_does(tmp_path, fp32_run, state):
    extra = {"train.dtype": "bfloat16", "train.param_dtype": "bfloat16"} if state == "bf16" else {}
    cfg = load_config("tiny", {**SMALL, **extra, "train.steps": STEPS, "train.optimizer_state": state})
    Trainer(cfg, tmp_path).run()
    got = _losses(tmp_path)
    tail = lambda losses: sum(losses[s] for s in range(STEPS - 4, STEPS + 1)) / 5  # noqa: E731
    assert tail(got) < 0.7 * got[1], f"{state} did not learn: {got[1]:.3f} -> {tail(got):.3f}"
    rel = abs(tail(got) - tail(fp32_run)) / tail(fp32_run)
    print(f"\n{state}: last-5 mean loss {tail(got):.4f} vs fp32 {tail(fp32_run):.4f} ({100 * rel:.2f}%)")
    assert rel <= TOLERANCE[state], (state, tail(got), tail(fp32_run))


def test_bf16_moments_checkpoint_and_resume_exactly(tmp_path):
    cfg = load_config("tiny", {**SMALL, "train.steps": 6, "train.checkpoint_every": 3,
                               "train.optimizer_state": "bf16_moments", "model.moe.bias_update_rate": 0.01})
    Trainer(cfg, tmp_path / "whole").run()
    baseline = _losses(tmp_path / "whole")

    class StoppedAtStep3(Trainer):
        def after_step(self, step, last):
            super().after_step(step, last)
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    run = tmp_path / "resumed"
    stopped = StoppedAtStep3(cfg, run).run()
    assert stopped["status"] == "PREEMPTED" and 3 <= stopped["steps"] < 6
    tr = Trainer(cfg, run)
    tr.run()
    starts = [e for e in read_events(run / "metrics.jsonl") if e["event"] == "start"]
    assert starts[-1]["start_step"] == stopped["steps"] and starts[-1]["resumed_from"]
    assert all(tr.optimizer.state[p]["exp_avg"].dtype == torch.bfloat16 for p in tr.model.parameters())
    got = _losses(run)
    assert sorted(got) == list(range(1, 7))
    assert max(abs(got[s] - baseline[s]) for s in baseline) <= 1e-6, (got, baseline)


def test_the_planner_counts_the_state_precision():
    base = {"train.dtype": "bfloat16"}
    p32 = plan(load_config("tiny", {**base, "train.optimizer_state": "fp32"}))
    p16 = plan(load_config("tiny", {**base, "train.optimizer_state": "bf16_moments"}))
    pbf = plan(load_config("tiny", {**base, "train.param_dtype": "bfloat16", "train.optimizer_state": "bf16"}))
    n = p32.trained_params
    assert p32.memory["optimizer"] == 8 * n and p16.memory["optimizer"] == 4 * n and pbf.memory["optimizer"] == 4 * n
    assert p16.memory["parameters"] == p32.memory["parameters"] == 4 * p32.params_per_gpu
    assert p16.memory["gradients"] == p32.memory["gradients"] and pbf.memory["gradients"] == 2 * n
    assert any("bf16_moments" in a for a in p16.assumptions)
