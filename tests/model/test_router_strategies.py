"""Each load-balancing strategy of the router, tested on its defining property.

(The Switch loss's hand-checked value and its gradient through the MoE layer, and the aux-free bias lowering the
load's cv under a skewed router, are in test_router_basics.py.)
"""
import math

import pytest
import torch

from moelab.config import BackendConfig, MoEConfig
from moelab.model.moe import MoE
from moelab.model.router import Router


def _router(dim: int, fake_balanced_gate: bool = False, fake_gate_noise: float = 0.0, **moe) -> Router:
    r = Router(dim, MoEConfig(**moe), fake_balanced_gate, fake_gate_noise)
    torch.nn.init.normal_(r.weight, generator=torch.Generator().manual_seed(0))
    r.reset_buffers()
    return r


def _router_with_logits(logits_TE, **moe) -> tuple[Router, torch.Tensor]:
    """A router whose logits equal `logits_TE` for the returned one-hot inputs [1, T, T]."""
    logits_TE = torch.as_tensor(logits_TE, dtype=torch.float32)
    T, E = logits_TE.shape
    r = Router(T, MoEConfig(num_experts=E, **moe))
    with torch.no_grad():
        r.weight.copy_(logits_TE.T)
    r.reset_buffers()
    return r, torch.eye(T).unsqueeze(0)


# ---------------------------------------------------------------------- capacity factor
@pytest.mark.parametrize("seed,top_k,factor", [(0, 1, 1.0), (1, 2, 1.0), (2, 2, 0.5), (3, 4, 1.25)])
def test_capacity_keeps_exactly_the_highest_scored_assignments_up_to_capacity(seed, top_k, factor):
    g = torch.Generator().manual_seed(seed)
    T, E = 40, 8
    logits = torch.randn(T, E, generator=g) * 2
    logits[:, 0] += 2.0  # expert 0 is popular, so it overflows
    r, x = _router_with_logits(logits, top_k=top_k, capacity_factor=factor)
    weights_TK, experts_TK, keep_TK, _ = r(x)
    capacity = math.ceil(factor * T * top_k / E)
    expected_dropped = 0
    for e in range(E):
        mine = experts_TK == e
        scores = weights_TK[mine]
        kept = keep_TK[mine]
        n = int(mine.sum())
        assert int(kept.sum()) == min(n, capacity), (e, n, capacity)
        expected_dropped += max(n - capacity, 0)
        if n > capacity:  # every kept assignment outranks every dropped one
            assert scores[kept].min() >= scores[~kept].max()
    assert expected_dropped > 0  # the case exercises dropping
    stats = r.pop_stats()
    assert stats["dropped"].item() == expected_dropped
    assert stats["tokens_per_expert"].sum().item() == T * top_k - expected_dropped
    assert stats["routed_per_expert"].sum().item() == T * top_k  # demand, before dropping


def test_dropped_assignments_contribute_nothing_and_grouped_matches_loop():
    """Rows the grouped GEMM leaves undefined (past the kept ones) must not leak into outputs or gradients."""
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, top_k=2, expert_ffn_size=8, capacity_factor=0.5)
    outs = []
    for impl in ("grouped_mm", "loop"):
        moe = MoE(8, cfg, BackendConfig(experts=impl))
        torch.manual_seed(1)
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.5)
        moe.router.reset_buffers()
        x = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
        for _ in range(3):  # repeated calls: garbage from earlier allocations would show up here
            x.grad = None
            y = moe(x)
            y.square().sum().backward()
        outs.append((y.detach(), x.grad.clone()))
        assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1])


# ---------------------------------------------------------------------- dynamic capacity
def _factor(spread: float) -> float:
    return 1 + 0.5 / (1 + math.exp(-(spread - 1)))


def _load_with_cv(cv: float, E: int = 8) -> torch.Tensor:
    """Loads with mean 100 and population coefficient of variation `cv` (half high, half low)."""
    return torch.tensor([100 * (1 + cv)] * (E // 2) + [100 * (1 - cv)] * (E // 2))


def test_dynamic_capacity_factor_follows_the_spread_over_its_window():
    r = _router(4, num_experts=8, capacity_factor=1.0, dynamic_capacity=True, capacity_window=3)
    assert r.capacity_factor.item() == 1.0  # the starting factor
    r.update_capacity(_load_with_cv(0.0))
    assert r.capacity_factor.item() == pytest.approx(_factor(0.0))
    r.update_capacity(_load_with_cv(0.8))  # window holds cv 0 and 0.8
    assert r.capacity_factor.item() == pytest.approx(_factor(0.4))
    for _ in range(3):  # the balanced step has left the 3-step window
        r.update_capacity(_load_with_cv(0.8))
    assert r.capacity_factor.item() == pytest.approx(_factor(0.8))
    # a wider spread gives a larger factor, bounded by 1.5
    for _ in range(3):
        r.update_capacity(_load_with_cv(0.99))
    assert _factor(0.8) < r.capacity_factor.item() < 1.5
    # and the capacity in force uses it: ceil(factor * T * K / E)
    x = torch.randn(1, 32, 4)
    _, experts_TK, keep_TK, _ = r(x)
    cap = math.ceil(r.capacity_factor.item() * 32 * 2 / 8)
    assert max(int(keep_TK[experts_TK == e].sum()) for e in range(8)) <= cap


def test_dynamic_capacity_is_off_by_default():
    r = _router(4, num_experts=8, capacity_factor=1.25)
    r.update_capacity(_load_with_cv(0.9))
    assert r.capacity_factor.item() == 1.25


# ---------------------------------------------------------------------- sequence-level aux loss
def test_sequence_aux_loss_sees_imbalance_within_sequences_that_the_batch_loss_averages_away():
    # two sequences of 4 tokens, 2 experts, top-1: sequence 0 goes to expert 0, sequence 1 to expert 1
    logits = torch.tensor([[3.0, 0.0]] * 4 + [[0.0, 3.0]] * 4)
    kw = dict(top_k=1, aux_loss_coeff=1.0)
    batch_r, x = _router_with_logits(logits, aux_loss_type="batch", **kw)
    seq_r, _ = _router_with_logits(logits, aux_loss_type="sequence", **kw)
    batch_r.train(), seq_r.train()
    x_BLD = x.view(2, 4, 8)
    batch_loss, seq_loss = batch_r(x_BLD)[3], seq_r(x_BLD)[3]
    p = torch.softmax(torch.tensor([3.0, 0.0]), -1)
    # batch: f = [1/2, 1/2], P = [1/2, 1/2] -> E * sum f P = 1 (looks balanced)
    torch.testing.assert_close(batch_loss, torch.tensor(1.0))
    # sequence: each sequence has f = [1, 0] and P = p -> 2 * p[0]
    torch.testing.assert_close(seq_loss, 2 * p[0])
    assert seq_loss > batch_loss + 0.5


def test_sequence_aux_loss_equals_the_batch_loss_for_one_sequence():
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    for score_func in ("softmax", "sigmoid"):
        kw = dict(top_k=2, aux_loss_coeff=1.0, score_func=score_func)
        a, x = _router_with_logits(logits, aux_loss_type="batch", **kw)
        b, _ = _router_with_logits(logits, aux_loss_type="sequence", **kw)
        a.train(), b.train()
        torch.testing.assert_close(a(x)[3], b(x)[3])


def test_switch_aux_loss_is_one_when_balanced_and_larger_when_collapsed():
    balanced, x = _router_with_logits(torch.eye(4) * 5, top_k=1, aux_loss_coeff=1.0)
    collapsed, _ = _router_with_logits(torch.tensor([[5.0, 0, 0, 0]] * 4), top_k=1, aux_loss_coeff=1.0)
    balanced.train(), collapsed.train()
    torch.testing.assert_close(balanced(x)[3], torch.tensor(1.0))
    assert collapsed(x)[3] > 3.0  # -> E = 4 as the router's probability concentrates


# ---------------------------------------------------------------------- z-loss
def test_z_loss_is_the_mean_squared_logsumexp_and_its_gradient_shrinks_the_logits():
    logits = torch.tensor([[2.0, 1.0, -1.0], [0.5, 0.5, 4.0]])
    r, x = _router_with_logits(logits, top_k=1, z_loss_coeff=0.1)
    r.train()
    loss = r(x)[3]
    z = torch.logsumexp(logits, -1).pow(2).mean()
    torch.testing.assert_close(loss, 0.1 * z)
    loss.backward()
    # d/dW of logsumexp^2 is positive along the softmax: a gradient step lowers every token's logsumexp
    with torch.no_grad():
        r.weight -= 1.0 * r.weight.grad
        assert (torch.logsumexp(x[0] @ r.weight.T, -1) < torch.logsumexp(logits, -1)).all()
    torch.testing.assert_close(r.pop_stats()["z_loss"], z)
    r.eval()
    assert r(x)[3].item() == 0.0  # only while training


# ---------------------------------------------------------------------- group-limited routing
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_group_limited_routing_only_picks_experts_in_the_selected_groups(score_func):
    T, E, G, top_groups, K = 256, 16, 4, 2, 4
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(1)) * 2
    kw = dict(top_k=K, num_groups=G, topk_groups=top_groups, score_func=score_func)
    r, x = _router_with_logits(logits, **kw)
    flat_r, _ = _router_with_logits(logits, top_k=K, score_func=score_func)
    experts_TK = r(x)[1]
    scores = torch.sigmoid(logits) if score_func == "sigmoid" else torch.softmax(logits, -1)
    group_TG = scores.view(T, G, E // G).topk(2, -1).values.sum(-1)  # a group's score: its best two experts
    chosen_TG = torch.zeros(T, G, dtype=torch.bool).scatter_(1, group_TG.topk(top_groups, -1).indices, True)
    assert chosen_TG.gather(1, experts_TK // (E // G)).all()
    # within the chosen groups, it is still the top-k by score
    masked = scores.masked_fill(~chosen_TG.repeat_interleave(E // G, 1), -1.0)
    assert torch.equal(experts_TK.sort(-1).values, masked.topk(K, -1).indices.sort(-1).values)
    # and the limit binds: unrestricted routing picks other experts for some tokens
    assert not torch.equal(flat_r(x)[1].sort(-1).values, experts_TK.sort(-1).values)


# ---------------------------------------------------------------------- fake balanced gate
def test_fake_balanced_gate_is_exactly_balanced_with_distinct_experts_per_token():
    E, K, T = 8, 2, 64
    r = _router(16, num_experts=E, top_k=K, fake_balanced_gate=True)
    weights_TK, experts_TK, _, _ = r(torch.randn(1, T, 16))
    counts = torch.bincount(experts_TK.flatten(), minlength=E)
    assert counts.tolist() == [T * K // E] * E
    assert (experts_TK[:, 0] != experts_TK[:, 1]).all()
    torch.testing.assert_close(weights_TK, torch.full((T, K), 1 / K))


def test_fake_gate_noise_is_seeded_by_content_and_unbalances_a_little():
    E, K, T = 8, 2, 256
    r = _router(16, num_experts=E, top_k=K, fake_balanced_gate=True, fake_gate_noise=0.5)
    x = torch.randn(1, T, 16, generator=torch.Generator().manual_seed(0))
    a, b = r(x)[1], r(x.clone())[1]
    assert torch.equal(a, b)  # a recompute (activation checkpointing) routes identically
    counts = torch.bincount(a.flatten(), minlength=E)
    assert counts.sum() == T * K and counts.min() > 0 and counts.max() > counts.min()
    assert (a[:, 0] != a[:, 1]).all()
    # the aux-free bias leaves a fake gate alone
    r2 = _router(16, num_experts=E, top_k=K, bias_update_rate=0.1, fake_balanced_gate=True)
    r2.update_bias(counts.float())
    assert r2.expert_bias.abs().sum() == 0


# ---------------------------------------------------------------------- aux-free bias: the update rule
def test_aux_free_bias_update_is_sign_of_mean_minus_load():
    r = _router(4, num_experts=4, bias_update_rate=0.01)
    r.update_bias(torch.tensor([10.0, 30.0, 20.0, 20.0]))
    torch.testing.assert_close(r.expert_bias, torch.tensor([0.01, -0.01, 0.0, 0.0]))


# ---------------------------------------------------------------------- precision
def test_routing_is_computed_in_fp32_under_bf16_autocast():
    r = _router(64, num_experts=16, top_k=2)
    with torch.no_grad():
        r.weight.mul_(0.02)  # a freshly initialised router: small logits, near-ties
    x = torch.randn(2, 64, 64)
    ref = r(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = r(x)
    assert torch.equal(ref[1], got[1])
    torch.testing.assert_close(ref[0], got[0].float())
