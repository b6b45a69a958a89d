"""Router outputs and the auxiliary loss on hand-checked cases; the aux gradient reaches the router."""
import math

import torch

from moelab.config import MoEConfig
from moelab.model.moe import MoE
from moelab.config import BackendConfig
from moelab.model.router import Router


def _router(logits_rows, **moe):
    """A router whose logits equal `logits_rows` for one-hot inputs (weight = logits^T)."""
    E = len(logits_rows[0])
    cfg = MoEConfig(num_experts=E, **moe)
    r = Router(len(logits_rows), cfg)
    with torch.no_grad():
        r.weight.copy_(torch.tensor(logits_rows, dtype=torch.float32).T)
    r.reset_buffers()
    x = torch.eye(len(logits_rows)).unsqueeze(0)  # [B=1, L=T, D=T]
    return r, x


def test_softmax_topk_weights_and_selection():
    r, x = _router([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0]], top_k=2, norm_topk_prob=False)
    w, idx, keep, _ = r(x)
    assert idx[0].tolist() == [0, 1] and idx[1, 0].item() == 2
    p0 = torch.softmax(torch.tensor([2.0, 1.0, 0.0, -1.0]), -1)
    torch.testing.assert_close(w[0], p0[:2])
    assert keep is None


def test_normalised_topk_and_route_scale():
    r, x = _router([[2.0, 1.0, 0.0, -1.0]], top_k=2, norm_topk_prob=True, route_scale=2.5)
    w, _, _, _ = r(x)
    p = torch.softmax(torch.tensor([2.0, 1.0, 0.0, -1.0]), -1)[:2]
    torch.testing.assert_close(w[0], 2.5 * p / p.sum())


def test_sigmoid_scores_and_bias_only_changes_selection():
    r, x = _router([[1.0, 0.5, 0.0, -3.0]], top_k=1, score_func="sigmoid", norm_topk_prob=False)
    r.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0]))  # pushes expert 3 into the selection
    w, idx, _, _ = r(x)
    assert idx[0, 0].item() == 3
    torch.testing.assert_close(w[0, 0], torch.sigmoid(torch.tensor(-3.0)))  # weight from the unbiased score


def test_switch_aux_loss_hand_checked():
    # two tokens, two experts, top-1: token 0 -> expert 0, token 1 -> expert 0 as well
    r, x = _router([[1.0, 0.0], [2.0, 0.0]], top_k=1, aux_loss_coeff=1.0)
    r.train()
    _, idx, _, loss = r(x)
    assert idx.flatten().tolist() == [0, 0]
    p = torch.softmax(torch.tensor([[1.0, 0.0], [2.0, 0.0]]), -1)
    f = torch.tensor([1.0, 0.0])  # share of assignments
    expected = 2 * (f * p.mean(0)).sum()
    torch.testing.assert_close(loss, expected)


def test_aux_loss_gradient_reaches_the_router_through_the_moe_layer():
    torch.manual_seed(0)
    moe = MoE(8, MoEConfig(num_experts=4, top_k=2, expert_ffn_size=8, aux_loss_coeff=1.0), BackendConfig())
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe.router.reset_buffers()
    x = torch.randn(2, 5, 8)
    # Zero the output gradient: any router gradient left can only come from the attached aux loss.
    y = moe(x)
    y.backward(torch.zeros_like(y))
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0
    # With the coefficient off, the same backward gives the router no gradient.
    moe2 = MoE(8, MoEConfig(num_experts=4, top_k=2, expert_ffn_size=8, aux_loss_coeff=0.0), BackendConfig())
    moe2.load_state_dict(moe.state_dict())
    y2 = moe2(x)
    y2.backward(torch.zeros_like(y2))
    assert moe2.router.weight.grad is None or moe2.router.weight.grad.abs().sum() == 0


def test_aux_free_bias_moves_a_skewed_load_toward_balance():
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=8, top_k=2, score_func="sigmoid", bias_update_rate=0.01)
    r = Router(16, cfg)
    with torch.no_grad():
        r.weight.normal_(std=0.1)
        r.weight[:2] += 0.1  # a router that prefers experts 0 and 1 for most inputs
    r.reset_buffers()
    x = torch.randn(1, 512, 16).abs()

    def cv():
        r.pop_stats()
        r(x)
        load = r.pop_stats()["tokens_per_expert"]
        return (load.std(unbiased=False) / load.mean()).item(), load

    before, load = cv()
    for _ in range(100):
        r.update_bias(load)
        after, load = cv()
    assert after < 0.5 * before, (before, after)


def test_stats_count_every_assignment():
    r, x = _router([[1.0, 0.0, 0.5], [0.0, 1.0, 0.2], [0.3, 0.2, 0.1]], top_k=2)
    r(x)
    stats = r.pop_stats()
    assert stats["tokens_per_expert"].sum().item() == 3 * 2
    assert r.pop_stats()["tokens_per_expert"].sum().item() == 0  # reset after pop
    assert math.isclose(stats["dropped"].item(), 0.0)
