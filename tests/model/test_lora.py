"""LoRA (moelab.model.lora): the model starts as its base, only adapters train, grouped expert LoRA equals a
per-expert reference (gradients included), merging folds the adapters into the weights, checkpoints hold only
what trains and resume exactly, and bad train.lora values are refused before anything runs."""
import json
from pathlib import Path

import pytest
import torch

from moelab.config import ConfigError, load_config
from moelab.model import build_model
from moelab.model.assemble import assemble
from moelab.model.experts import GroupedExperts, swiglu
from moelab.model.lora import ExpertAdapters, is_adapter, merge_lora_state
from moelab.contract.stream import read_events
from support import run_one_thread

ALL_GQA = "attention,dense_mlp,experts"
MLA = {"model.attention": "mla", "model.q_lora_rank": 16, "model.kv_lora_rank": 16, "model.qk_nope_head_dim": 8,
       "model.qk_rope_head_dim": 8, "model.v_head_dim": 8, "model.moe.num_shared_experts": 1}
SHORT = {"train.steps": 3, "train.seq_len": 16, "train.global_batch_size": 4, "train.micro_batch_size": 2,
         "train.warmup_steps": 0, "train.lr": 1e-2}


def lora_config(targets=ALL_GQA, **changes):
    return load_config("tiny", {"train.lora.rank": 4, "train.lora.alpha": 8.0, "train.lora.targets": targets,
                                **SHORT, **changes})


def lora_model(cfg):
    """A LoRA model built as the trainer builds it (moelab.model.assemble): adapters added, then initialised."""
    return assemble(cfg, "lora")


def randomize_adapters(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter(name):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("arch", ["gqa", "mla"])
def test_lora_at_init_equals_base(arch):
    changes = MLA if arch == "mla" else {}
    targets = "attention,dense_mlp,shared_experts,experts" if arch == "mla" else ALL_GQA
    cfg = lora_config(targets, **changes)
    model, base = lora_model(cfg), build_model(cfg)
    adapted = {n.rsplit(".", 1)[-1] for n, _ in model.named_parameters() if is_adapter(n)}
    kinds = {n.split(".")[3] for n, _ in model.named_parameters() if is_adapter(n) and ".attention." in n}
    assert kinds == ({"q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj"} if arch == "mla"
                     else {"q_proj", "k_proj", "v_proj", "o_proj"})
    assert {"lora_a_gate_up_EDR", "lora_b_down_ERD", "lora_A", "lora_B"} <= adapted
    assert any(".shared_experts." in n and is_adapter(n) for n, _ in model.named_parameters()) == (arch == "mla")
    for name, p in model.named_parameters():
        if is_adapter(name) and name.rsplit(".", 1)[-1] in ("lora_B", "lora_b_gate_up_ERF2", "lora_b_down_ERD"):
            assert not p.any(), name
        elif not is_adapter(name):
            assert torch.equal(p, base.state_dict()[name]), name
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens), base(tokens))


def reference_experts(x_ND, counts, w1, w2, a1, b1, a2, b2, scaling):
    """Per expert, with the adapters merged into the weights: W + scaling * A B."""
    out, start = [], 0
    for e, n in enumerate(counts):
        h = x_ND[start:start + n] @ (w1[e] + scaling * a1[e] @ b1[e])
        gate, up = h.chunk(2, dim=-1)
        out.append(swiglu(gate, up) @ (w2[e] + scaling * a2[e] @ b2[e]))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("impl", ["grouped_mm", "loop"])
@pytest.mark.parametrize("rank", [4, 3])  # rank 3: fp32 rows of 12 bytes are not 16-byte aligned (the loop path)
def test_grouped_expert_lora_matches_per_expert_reference(impl, rank):
    if impl == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm missing")
    E, D, F = 4, 16, 8
    cfg = load_config("tiny", {"train.lora.rank": rank, "train.lora.alpha": 6.0, "train.lora.targets": "experts"})
    experts = GroupedExperts(E, D, F, impl=impl)
    g = torch.Generator().manual_seed(0)
    from moelab.model.lora import add_expert_adapters

    add_expert_adapters(experts, rank, cfg.train.lora.alpha, 0.0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    counts = [5, 0, 7, 3]  # an expert without rows
    x_ND = torch.randn(sum(counts), D, generator=g, requires_grad=True)
    y = experts(x_ND, torch.tensor(counts))
    names = ["w_gate_up_EDF2", "w_down_EFD", "lora_a_gate_up_EDR", "lora_b_gate_up_ERF2", "lora_a_down_EFR",
             "lora_b_down_ERD"]
    leaves = [getattr(experts, n) for n in names]
    x_ref = x_ND.detach().clone().requires_grad_(True)
    ref_leaves = [p.detach().clone().requires_grad_(True) for p in leaves]
    w1, w2, a1, b1, a2, b2 = ref_leaves
    ref = reference_experts(x_ref, counts, w1, w2, a1, b1, a2, b2, 6.0 / rank)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)
    grad_out = torch.randn(y.shape, generator=g)
    y.backward(grad_out)
    ref.backward(grad_out)
    torch.testing.assert_close(x_ND.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    for name, p, r in zip(names, leaves, ref_leaves):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert leaves[3].grad.abs().sum() > 0 and leaves[3].grad[1].abs().sum() == 0  # no rows: no gradient


def test_expert_adapters_delta_grouped_equals_loop():
    E, I, R, O = 3, 8, 4, 12
    g = torch.Generator().manual_seed(2)
    experts = GroupedExperts(E, I, O // 2)
    from moelab.model.lora import add_expert_adapters

    add_expert_adapters(experts, R, 4.0, 0.0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    lora = ExpertAdapters(experts, torch.float32)
    x = torch.randn(9, I, generator=g)
    counts = torch.tensor([2, 4, 3])
    loop = torch.cat([lora.delta_expert(0, x[s:s + n], e) for e, (s, n) in enumerate([(0, 2), (2, 4), (6, 3)])])
    torch.testing.assert_close(lora.delta(0, x, counts), loop, rtol=1e-4, atol=1e-5)


def run_trainer(cfg, run_dir):
    trainer = run_one_thread(cfg, run_dir)
    losses = [e["loss"] for e in read_events(Path(run_dir) / "metrics.jsonl") if e["event"] == "step"]
    return trainer, losses


def test_only_adapters_train(tmp_path):
    cfg = lora_config()
    trainer, losses = run_trainer(cfg, tmp_path / "run")
    model, base = trainer.model, build_model(cfg).state_dict()
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(is_adapter(n) for n in trained)
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for n, p in model.named_parameters() if is_adapter(n)}
    for name, p in model.named_parameters():
        if is_adapter(name):
            continue
        assert p.grad is None, name
        assert torch.equal(p.detach(), base[name]), name  # unchanged after 3 steps
    assert any(p.detach().abs().sum() > 0 for n, p in model.named_parameters()
               if n.endswith(("lora_B", "lora_b_down_ERD")))  # B moved away from zero
    assert losses[-1] < losses[0]
    batch = torch.randint(0, cfg.model.vocab_size, (2, 17))
    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
    assert all(p.grad is None for n, p in model.named_parameters() if not is_adapter(n))
    assert all(p.grad is not None for n, p in model.named_parameters() if is_adapter(n))


def test_router_trains_when_asked(tmp_path):
    trainer, _ = run_trainer(lora_config(**{"train.lora.train_router": True}), tmp_path / "run")
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert {n for n in trained if not is_adapter(n)} == {f"layers.{i}.ffn.router.weight" for i in (1, 2, 3)}


def test_merged_state_gives_the_lora_logits():
    cfg = lora_config("attention,dense_mlp,shared_experts,experts", **MLA)
    model = lora_model(cfg)
    randomize_adapters(model)
    merged = merge_lora_state(model.state_dict(), cfg)
    assert not any(is_adapter(k) for k in merged)
    plain = build_model(cfg)
    plain.load_state_dict(merged, strict=True)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, ref, base = model(tokens), plain(tokens), build_model(cfg)(tokens)
    torch.testing.assert_close(ref, ours, rtol=1e-5, atol=1e-5)
    assert (ours - base).abs().max() > 1e-2  # the adapters changed the model


def checkpoint_keys(step_dir: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata)


def test_checkpoint_holds_only_what_trains(tmp_path):
    cfg = lora_config()
    run_trainer(cfg, tmp_path / "lora")
    run_trainer(load_config("tiny", SHORT), tmp_path / "full")
    lora_ckpt = tmp_path / "lora/checkpoints/step_000003"
    model_keys = {k[len("model."):] for k in checkpoint_keys(lora_ckpt) if k.startswith("model.")}
    router_buffers = {"expert_bias", "capacity_factor", "load_history", "history_len"}
    assert model_keys and all(is_adapter(k) or k.rsplit(".", 1)[-1] in router_buffers for k in model_keys)
    assert any(k.endswith("experts.lora_a_gate_up_EDR") for k in model_keys)
    meta = json.loads((lora_ckpt / "metadata.json").read_text())
    assert meta["base"] == {"seed": cfg.train.seed}

    def size(d):
        return sum(f.stat().st_size for f in Path(d).glob("*.distcp"))

    adapters = sum(p.numel() for n, p in lora_model(cfg).named_parameters() if is_adapter(n))
    # fp32 adapters and their two Adam moments, plus DCP's per-tensor framing and the routers' buffers
    assert 4 * 3 * adapters < size(lora_ckpt) < 1.5 * 4 * 3 * adapters
    assert size(lora_ckpt) * 5 < size(tmp_path / "full/checkpoints/step_000003")


def test_resume_equals_uninterrupted(tmp_path):
    cfg = lora_config(**{"train.steps": 4, "train.lora.dropout": 0.1})  # dropout: the RNG state resumes too
    whole, whole_losses = run_trainer(cfg, tmp_path / "whole")
    run_trainer(cfg.replace(**{"train.checkpoint_every": 2}), tmp_path / "cut")
    import shutil

    shutil.rmtree(tmp_path / "cut/checkpoints/step_000004")  # as if it had stopped after step 2's checkpoint
    resumed, losses = run_trainer(cfg, tmp_path / "cut")  # re-creates the seed base, then loads the adapters
    assert resumed.start_step == 2
    assert losses == whole_losses
    for (name, p), q in zip(resumed.model.named_parameters(), whole.model.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("changes,match", [
    ({"train.lora.targets": "q_proj,gate"}, "unknown target gate; valid targets: attention, q_proj"),
    ({"train.lora.targets": "kv_a_proj"}, "kv_a_proj name no module of this model"),
    ({"train.lora.targets": "shared_experts"}, "shared_experts name no module"),
    ({"train.lora.targets": "q_proj", **MLA}, "q_proj name no module"),  # MLA with q_lora_rank: q_a/q_b
    ({"train.lora.targets": ""}, "name at least one of"),
    ({"train.lora.alpha": 0}, "train.lora.alpha=0"),
    ({"train.lora.dropout": 1.0}, "train.lora.dropout=1.0"),
    ({"train.lora.targets": "experts", "backend.experts": "grouped_gemm"}, "backend.experts='grouped_gemm'"),
    ({"train.lora.targets": "experts", "backend.experts": "triton_fused"}, "backend.experts='triton_fused'"),
    ({"train.lora.targets": "experts", "backend.experts": "sonic"}, "backend.experts='sonic'"),
    ({"backend.attention": "te"}, "backend.attention='te'"),
    ({"train.fp8": "rowwise", "train.dtype": "bfloat16", "train.device": "cuda"}, "train.fp8='rowwise'"),
    ({"model.moe.bias_update_rate": 0.01}, "frozen router"),
    ({"parallel.pp": 2}, "parallel.pp=2"),
])
def test_bad_lora_config_is_refused(changes, match):
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
        lora_config(**{"train.lora.targets": ALL_GQA, **changes})


def test_lora_off_by_default():
    cfg = load_config("tiny")
    assert cfg.train.lora.rank == 0 and cfg.train.lora.train_router is False
    model = build_model(cfg)
    assert all(p.requires_grad for p in model.parameters()) and not any(is_adapter(n) for n, _ in
                                                                        model.named_parameters())


def test_expert_learning_rates_scale_only_the_expert_adapters(tmp_path):
    trainer, losses = run_trainer(lora_config(**{"model.moe.expert_lr_power": 0.5}), tmp_path / "run")
    held = {id(p) for _, _, p in trainer.expert_lr.params}
    experts = {id(p) for n, p in trainer.model.named_parameters() if ".experts.lora_" in n}
    assert held == experts and len(losses) == 3


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_the_lora_run(mode, tmp_path):
    cfg = lora_config()
    _, plain = run_trainer(cfg, tmp_path / "plain")
    recomputed, losses = run_trainer(cfg.replace(**{"train.activation_checkpointing": mode}), tmp_path / mode)
    assert losses == pytest.approx(plain, rel=1e-6)
    keys = checkpoint_keys(tmp_path / mode / "checkpoints/step_000003")
    assert keys == checkpoint_keys(tmp_path / "plain/checkpoints/step_000003")  # the same names, wrapped or not
