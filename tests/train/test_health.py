"""Expert health (dead / overloaded experts, warnings on the transition) and per-expert learning rates."""
import pytest
import torch

from moelab.config import BackendConfig, MoEConfig, load_config
from moelab.model.moe import MoE
from moelab.train.expert_lr import ExpertLR, expert_lr_scales
from moelab.train.health import ExpertHealth, load_shares
from moelab.contract.stream import read_events
from moelab.train.trainer import Trainer


# ---------------------------------------------------------------------- health
def test_dead_expert_is_reported_after_n_idle_steps_and_warned_once():
    h = ExpertHealth(MoEConfig(num_experts=3, dead_expert_steps=3))
    seen = []
    for step in range(1, 6):
        health, warnings = h.observe(step, [[10, 0, 5], [5, 5, 5]])
        seen.append((health["dead_experts"], [w["kind"] for w in warnings]))
    assert seen[0] == ([], []) and seen[1] == ([], [])
    assert seen[2] == ([[0, 1]], ["dead_expert"])  # becomes dead at its 3rd idle step
    assert seen[3] == ([[0, 1]], []) and seen[4] == ([[0, 1]], [])  # stays dead, no new warning
    health, warnings = h.observe(6, [[10, 1, 5], [5, 5, 5]])  # revived
    assert health["dead_experts"] == [] and warnings == []
    for step in range(7, 10):
        health, warnings = h.observe(step, [[10, 0, 5], [5, 5, 5]])
    assert [w["kind"] for w in warnings] == ["dead_expert"]  # dead again: warned again
    assert warnings[0]["layer"] == 0 and warnings[0]["expert"] == 1 and warnings[0]["step"] == 9


def test_overloaded_expert_reports_its_share_and_warns_when_it_becomes_overloaded():
    h = ExpertHealth(MoEConfig(num_experts=4, overload_factor=2.0))
    health, warnings = h.observe(1, [[70, 10, 10, 10]])  # mean 25: 70 > 2 x 25
    assert health["overloaded"] == [[0, 0, 0.7]]
    assert [(w["kind"], w["expert"], w["share"]) for w in warnings] == [("overloaded_expert", 0, 0.7)]
    assert "70.0%" in warnings[0]["message"]
    health, warnings = h.observe(2, [[60, 20, 10, 10]])
    assert health["overloaded"] == [[0, 0, 0.6]] and warnings == []  # still overloaded: no new warning
    health, warnings = h.observe(3, [[50, 20, 20, 10]])  # 50 = 2 x mean: not over
    assert health["overloaded"] == [] and warnings == []
    health, warnings = h.observe(4, [[80, 10, 5, 5]])
    assert health["overloaded"] == [[0, 0, 0.8]] and warnings == []  # it never went back to the mean: no flood
    h.observe(5, [[25, 25, 25, 25]])  # recovered: at the mean
    _, warnings = h.observe(6, [[80, 10, 5, 5]])
    assert len(warnings) == 1  # overloaded again
    assert load_shares([[80, 10, 5, 5], [0, 0, 0, 0]]) == [[0.8, 0.1, 0.05, 0.05], [0.0] * 4]


def test_trainer_writes_health_in_step_events_and_warnings_on_transitions(tmp_path):
    # 8 tokens per step over 16 experts, top-1: at least 8 experts idle each step; any expert with 1 token is
    # over the mean load of 0.5
    cfg = load_config("tiny", ["train.steps=3", "train.global_batch_size=1", "train.micro_batch_size=1",
                               "train.seq_len=8", "model.moe.top_k=1", "model.moe.dead_expert_steps=2",
                               "model.moe.overload_factor=1.0"])
    Trainer(cfg, tmp_path).run()
    events = read_events(tmp_path / "metrics.jsonl")
    steps = [e for e in events if e["event"] == "step"]
    warnings = [e for e in events if e["event"] == "warning"]
    assert steps[0]["health"]["dead_experts"] == []  # not yet idle for 2 steps
    prev = {"dead_experts": set(), "overloaded": set()}
    for i, s in enumerate(steps):
        idle = [{(li, e) for li, layer in enumerate(st["routing"]["routed_per_expert"]) for e, c in enumerate(layer)
                 if c == 0} for st in steps[max(i - 1, 0): i + 1]]
        dead = {tuple(d) for d in s["health"]["dead_experts"]}
        assert dead == (idle[0] & idle[1] if i else set())  # idle on this step and the one before
        over = {(li, e) for li, e, _ in s["health"]["overloaded"]}
        assert over == {(li, e) for li, layer in enumerate(s["routing"]["routed_per_expert"])
                        for e, c in enumerate(layer) if c > sum(layer) / len(layer)}
        for kind, now, key in (("dead_expert", dead, "dead_experts"), ("overloaded_expert", over, "overloaded")):
            warned = {(w["layer"], w["expert"]) for w in warnings if w["kind"] == kind and w["step"] == s["step"]}
            assert warned == now - prev[key], (kind, s["step"])  # only the experts that just became so
            prev[key] = now
    assert len(steps[1]["health"]["dead_experts"]) >= 8 and steps[0]["health"]["overloaded"]
    # each warning follows the step event it belongs to
    order = [(e["event"], e.get("step")) for e in events if e["event"] in ("step", "warning")]
    for i, (kind, step) in enumerate(order):
        if kind == "warning":
            assert ("step", step) in order[:i]


# ---------------------------------------------------------------------- per-expert learning rates
def test_expert_lr_scales_follow_the_formula():
    counts = torch.tensor([[40.0, 20.0, 10.0, 10.0], [0.0, 0.0, 0.0, 0.0]])  # fair share 20 per expert
    s = expert_lr_scales(counts, power=1.0, max_scale=4.0)
    torch.testing.assert_close(s[0], torch.tensor([1.0, 1.0, 2.0, 2.0]))  # over-used experts keep the base rate
    torch.testing.assert_close(s[1], torch.ones(4))  # a layer without tokens is left alone
    s = expert_lr_scales(torch.tensor([[75.0, 20.0, 5.0, 0.0]]), power=0.5, max_scale=3.0)
    torch.testing.assert_close(s[0], torch.tensor([1.0, 1.118034, 2.236068, 3.0]))  # dead -> the maximum


def _moe(seed: int) -> MoE:
    moe = MoE(8, MoEConfig(num_experts=4, top_k=2, expert_ffn_size=8), BackendConfig(experts="loop"))
    torch.manual_seed(seed)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe.router.reset_buffers()
    return moe


def test_each_expert_is_updated_with_lr_times_its_scale():
    """Three AdamW steps with per-step counts: every expert's rows must equal a reference AdamW run on that
    expert alone with learning rate lr x scale_e of each step (moments included)."""
    lr, wd = 0.01, 0.1
    moe = _moe(0)
    opt = torch.optim.AdamW(moe.parameters(), lr=lr, weight_decay=wd)
    scaler = ExpertLR(opt, [moe], power=1.0, max_scale=3.0)
    # the reference: one tensor per (parameter, expert), each with its own AdamW
    w0 = {n: p.detach().clone() for n, p in moe.experts.named_parameters()}
    ref = {(n, e): w0[n][e].clone().requires_grad_() for n in w0 for e in range(4)}
    ref_opt = {k: torch.optim.AdamW([t], lr=lr, weight_decay=wd) for k, t in ref.items()}
    step_counts = [[50.0, 30.0, 15.0, 5.0], [10.0, 40.0, 40.0, 10.0], [0.0, 60.0, 20.0, 20.0]]
    x = torch.randn(3, 2, 6, 8, generator=torch.Generator().manual_seed(1))
    for i, counts in enumerate(step_counts):
        opt.zero_grad()
        moe(x[i]).square().sum().backward()
        grads = {n: p.grad.clone() for n, p in moe.experts.named_parameters()}
        opt.step()
        scale = scaler.apply(torch.tensor([counts]))[0]
        for (n, e), t in ref.items():
            ref_opt[(n, e)].param_groups[0]["lr"] = lr * scale[e].item()
            t.grad = grads[n][e]
            ref_opt[(n, e)].step()
    for (n, e), t in ref.items():
        torch.testing.assert_close(getattr(moe.experts, n)[e], t.detach(), rtol=1e-5, atol=1e-6)
    # experts did move differently from a plain AdamW run (the scaling is not a no-op)
    assert scale.tolist() != [1.0] * 4


def test_scale_one_leaves_the_update_bit_identical_and_non_expert_params_untouched():
    a, b = _moe(0), _moe(0)
    opt_a = torch.optim.AdamW(a.parameters(), lr=0.01)
    opt_b = torch.optim.AdamW(b.parameters(), lr=0.01)
    scaler = ExpertLR(opt_b, [b], power=1.0, max_scale=4.0)
    x = torch.randn(2, 6, 8)
    for m, opt in ((a, opt_a), (b, opt_b)):
        m(x).square().sum().backward()
        opt.step()
    scaler.apply(torch.tensor([[25.0, 25.0, 25.0, 25.0]]))  # perfectly balanced: every scale is 1
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n
    with pytest.raises(RuntimeError, match="optimizer.step"):
        scaler.apply(torch.tensor([[25.0, 25.0, 25.0, 25.0]]))  # no step since the last apply
    scaler.remove()


def test_expert_lr_is_off_by_default_and_trains_when_on(tmp_path):
    assert ExpertLR.attach(torch.optim.AdamW(_moe(0).parameters()), [None], load_config("tiny")) is None
    cfg = load_config("tiny", ["train.steps=3", "train.seq_len=16", "model.moe.expert_lr_power=1.0"])
    trainer = Trainer(cfg, tmp_path)
    summary = trainer.run()
    assert summary["final_loss"] < summary["first_loss"]
    assert trainer.expert_lr is not None and trainer.expert_lr._before is None  # the snapshot is freed


def test_a_slice_of_experts_uses_the_scales_of_its_global_ids():
    """Under expert parallelism a rank holds experts [offset, offset + n): its rows take those experts' scales."""
    local = MoE(8, MoEConfig(num_experts=2, top_k=1, expert_ffn_size=8), BackendConfig(experts="loop"))
    torch.manual_seed(0)
    for p in local.parameters():
        torch.nn.init.normal_(p, std=0.3)
    local.experts.expert_offset = 2  # this rank holds global experts 2 and 3 of 4
    before = {n: p.detach().clone() for n, p in local.experts.named_parameters()}
    plain = {n: p.detach().clone() for n, p in local.experts.named_parameters()}
    opt = torch.optim.SGD(local.experts.parameters(), lr=0.1)
    scaler = ExpertLR(opt, [local], power=1.0, max_scale=8.0)
    for n, p in local.experts.named_parameters():
        p.grad = torch.ones_like(p)
        plain[n] -= 0.1 * p.grad
    opt.step()
    scaler.apply(torch.tensor([[35.0, 35.0, 10.0, 0.0]]))  # shares: expert 2 1/8 -> scale 2; 3 none -> max 8
    for n, p in local.experts.named_parameters():
        delta, plain_delta = p.detach() - before[n], plain[n] - before[n]
        torch.testing.assert_close(delta[0], 2.0 * plain_delta[0])
        torch.testing.assert_close(delta[1], 8.0 * plain_delta[1])
