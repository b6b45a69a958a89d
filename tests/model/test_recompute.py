"""Activation checkpointing (moelab.model.recompute). Selective: the loss and every gradient equal the run
without recompute, the router runs once per layer (its choices are kept, not recomputed), routing statistics
are counted once, and the planner counts less activation memory than without recompute and more than full.
Full: the router runs again in backward, but the recompute has no side effect: a trained run's routing records
(tokens per expert, drops, balance, dead experts) and its aux-loss-free bias equal the run without recompute."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import run_one_thread

from moelab.config import load_config
from moelab.contract.stream import read_events
from moelab.model import build_model
from moelab.model.layers import RMSNorm
from moelab.model.router import Router
from moelab.parallel.place import apply_activation_checkpointing
from moelab.planner.plan import plan

BASE = {"model.num_layers": 3, "model.num_dense_layers": 1, "train.seq_len": 16, "train.micro_batch_size": 2}


def _step(cfg, mode, monkeypatch):
    """(loss, {name: grad}, router calls, stat_calls per MoE layer) of one forward + backward under `mode`."""
    cfg = load_config(cfg, {"train.activation_checkpointing": mode})
    model = build_model(cfg)
    apply_activation_checkpointing(model, cfg)
    calls, norms = [], []
    forward, norm = Router.forward, RMSNorm.forward
    monkeypatch.setattr(Router, "forward", lambda self, x, *a: calls.append(1) or forward(self, x, *a))
    monkeypatch.setattr(RMSNorm, "forward", lambda self, x: norms.append(1) or norm(self, x))
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    n_forward, n_norms = len(calls), len(norms)
    loss.backward()
    monkeypatch.setattr(Router, "forward", forward)
    monkeypatch.setattr(RMSNorm, "forward", norm)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    stats = [float(m.router.stat_calls) for m in model.moe_layers()]
    return loss.detach(), grads, (n_forward, len(calls)), (stats, len(norms) - n_norms)


@pytest.mark.parametrize("extra", [
    {},
    {"backend.attention": "eager", "model.moe.capacity_factor": 1.0},  # the eager path's scores; dropped rows
])
def test_selective_recompute_gives_the_same_loss_and_gradients_and_never_reruns_the_router(monkeypatch, extra):
    cfg = load_config("tiny", {**BASE, **extra})
    n_moe = cfg.model.num_layers - cfg.model.num_dense_layers
    loss0, grads0, calls0, stats0 = _step(cfg, "none", monkeypatch)
    loss1, grads1, calls1, stats1 = _step(cfg, "selective", monkeypatch)
    _, _, calls_full, stats_full = _step(cfg, "full", monkeypatch)
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys()
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-6, atol=1e-7, msg=name)
    assert calls0 == calls1 == (n_moe, n_moe), "selective: the router runs in forward only"
    assert calls_full == (n_moe, 2 * n_moe), "full recompute re-runs the router in backward"
    assert stats1[0] == stats0[0] == stats_full[0] == [1.0] * n_moe, "the routing statistics are counted once"
    # the cheap parts are recomputed: both norms of every block (not the model's final norm)
    assert (stats0[1], stats1[1]) == (0, 2 * cfg.model.num_layers)


def test_the_planner_counts_selective_between_none_and_full():
    cfg = load_config("qwen3-moe-30b-a3b", {"train.dtype": "bfloat16", "train.micro_batch_size": 1})
    acts = {m: plan(load_config(cfg, {"train.activation_checkpointing": m}), gpus=8).memory["activations"]
            for m in ("none", "selective", "full")}
    assert acts["full"] < acts["selective"] < acts["none"], acts


def test_full_recompute_keeps_the_routing_records_of_the_run_without_it(tmp_path):
    # two MoE layers, micro batches accumulated, dropped tokens (capacity 1.0) and the aux-loss-free bias
    over = {"model.num_layers": 3, "model.num_dense_layers": 1, "model.hidden_size": 32, "model.moe.num_experts": 4,
            "model.moe.expert_ffn_size": 32, "train.seq_len": 16, "train.global_batch_size": 4,
            "train.micro_batch_size": 2, "train.device": "cpu", "train.steps": 3,
            "model.moe.bias_update_rate": 0.01, "model.moe.capacity_factor": 1.0}
    runs = {}
    for mode in ("none", "full"):
        trainer = run_one_thread(load_config("tiny", {**over, "train.activation_checkpointing": mode}), tmp_path / mode)
        steps = [e for e in read_events(tmp_path / mode / "metrics.jsonl") if e["event"] == "step"]
        bias = [m.router.expert_bias.clone() for m in trainer.par.moe_layers_all]
        runs[mode] = [(e["loss"], e["aux_loss"], e["routing"], e["health"]) for e in steps], bias
    (records0, bias0), (records1, bias1) = runs["none"], runs["full"]
    assert len(records0) == 3 and sum(records0[0][2]["dropped_tokens"]) > 0
    assert records1 == records0
    assert all(torch.equal(a, b) for a, b in zip(bias0, bias1)) and any(b.abs().sum() > 0 for b in bias0)
