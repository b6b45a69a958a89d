"""Tensor parallelism (moelab.parallel.tensor) on gloo processes reproduces the single-process run: losses,
routing counts, aux losses, gradient norms and parameters after 4 AdamW steps.

What TP changes is the order of fp32 sums: row-parallel projections add two partial sums, the vocabulary-parallel
loss combines per-shard maxima and sums of exponentials, sequence-parallel gathers feed the weight gradients in
two halves. The gradients of the first step agree to a few ulp of their largest terms (measured: 6e-9 absolute
at gradients of 2e-2, 3e-7 relative norm per tensor); losses to 1e-5 relative. Adam divides each gradient by its
own magnitude, so an element whose gradient is within that rounding of zero (layer 0's o_proj holds some at 2e-9)
takes an update anywhere in [-lr, lr] either way: parameters are held to lr/3 absolute and 2e-3 relative norm
(measured worst over 4 steps: 5.4e-4 and 1.0e-3 (tp2xep2), in that o_proj), as CP's bound in test_equivalence is
a kernel change's. The learned router with the aux-loss-free bias update off: the bias moves by +-rate on each step's
load signs, which turns a 1e-6 rounding difference at a near-tie into another routing (the counts are then not
comparable); capacity off, as for CP (each rank drops by capacity among its own tokens).
"""
import json

import pytest

from moelab.config import load_config

pytestmark = pytest.mark.slow

SHARED = ("model.moe.capacity_factor=0", "model.moe.bias_update_rate=0")
# the model families at tiny's sizes (as tests/hf/test_export_hf.py): Qwen3-MoE's QK norms; DeepSeek-V3's MLA
# (Kimi-K2's too) with low-rank queries, sigmoid group-limited routing and a shared expert
FAMILY = {
    "qwen3": ("model.qk_norm=true",),
    "deepseek": ("model.attention=mla", "model.num_kv_heads=4", "model.q_lora_rank=12", "model.kv_lora_rank=8",
                 "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=8",
                 "model.moe.score_func=sigmoid", "model.moe.num_shared_experts=1", "model.moe.num_groups=4",
                 "model.moe.topk_groups=2", "model.moe.route_scale=2.5"),
    # GPT-OSS: sinks, sliding windows, attention/router/expert biases, eager attention (sinks)
    "gptoss": ("model.attention_sinks=true", "model.sliding_window=4", "model.num_dense_layers=0",
               "model.attention_bias=true", "model.moe.router_bias=true", "model.moe.expert_proj_bias=true",
               "model.moe.score_func=softmax_topk", "model.moe.norm_topk_prob=false", "model.moe.activation=gpt_oss",
               "backend.attention=eager"),
    "eager": ("backend.attention=eager",),  # CP's per-chunk attention rounds like one eager kernel
    "full": ("train.activation_checkpointing=full",),  # each block recomputed in backward, hooks and all
    "tied": ("model.tie_embeddings=true",),  # the head is the vocabulary-parallel embedding
}
LAYOUTS = {  # name: (processes, layout overrides); a family's name ends the layout's
    "tp2": (2, ["parallel.tp=2"]),
    "tp2-qwen3": (2, ["parallel.tp=2"]),
    "tp2-deepseek": (2, ["parallel.tp=2"]),
    "tp2-gptoss": (2, ["parallel.tp=2"]),
    "tp2-full": (2, ["parallel.tp=2"]),
    "tp2-tied": (2, ["parallel.tp=2"]),
    "tp2xcp2-eager": (4, ["parallel.tp=2", "parallel.cp=2"]),  # router loss means over the 4 ranks of a sequence
    "tp2xpp2": (4, ["parallel.tp=2", "parallel.pp=2"]),  # stages pass their sequence shards (1F1B, 4 micro batches)
    "tp2xfsdp2": (4, ["parallel.tp=2"]),  # FSDP2 on the 2-D (dp_cp, tp) mesh
    "tp2xep2": (4, ["parallel.tp=2", "parallel.ep=2"]),  # EP carved from the TP pair, expert-FSDP over the dp ranks
}
LR = 0.003  # tiny's train.lr


def shared(name: str) -> tuple:
    """The overrides a layout shares with its single-process reference: SHARED and its model family's."""
    return SHARED + FAMILY.get(name.rsplit("-", 1)[-1], ())


@pytest.fixture(scope="module")
def tp_run(helpers, tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            nproc, overrides = LAYOUTS[name]
            run_dir = tmp_path_factory.mktemp(name)
            cache[name] = (*helpers.run_multi(helpers.small_config(*shared(name), *overrides), run_dir, nproc),
                           run_dir)
        return cache[name]

    return get


@pytest.mark.parametrize("name", LAYOUTS)
def test_tensor_parallel_reproduces_single_process(name, reference, tp_run, helpers):
    assert load_config("tiny").train.lr == LR
    ref_losses, ref_params, ref_dir = reference(*shared(name))
    losses, params, run_dir = tp_run(name)
    assert len(losses) == 4 and losses[0] == pytest.approx(ref_losses[0], rel=1e-6)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    ref_ev, ev = helpers.step_events(ref_dir), helpers.step_events(run_dir)
    assert [e["routing"]["tokens_per_expert"] for e in ev] == [e["routing"]["tokens_per_expert"] for e in ref_ev]
    assert [e["aux_loss"] for e in ev] == pytest.approx([e["aux_loss"] for e in ref_ev], rel=1e-5)
    assert [e["grad_norm"] for e in ev] == pytest.approx([e["grad_norm"] for e in ref_ev], rel=1e-4)
    assert params.keys() == ref_params.keys()
    for key, ref in ref_params.items():
        assert params[key].shape == ref.shape, key
        assert (params[key] - ref).abs().max().item() < LR / 3, key
        assert ((params[key] - ref).norm() / ref.norm().clamp(min=1e-12)).item() < 2e-3, key
    # TP's shards: rank 0's attention, dense MLP, embedding and head are DTensors (nothing left plain)
    placed = json.loads((run_dir / "placement_rank0.json").read_text())["params"]
    assert all(kind == "dtensor" for kind in placed.values()), placed


def tp_collectives_per_step(cfg, micro_batches: int) -> int:
    """The sequence-parallel all-gathers (and as many reduce-scatters) of one TP rank per step, for the planner
    (moelab.planner): per micro batch, forward gathers each attention's and each dense MLP's input and the head's,
    and reduce-scatters their outputs and the embedding's; backward does the reverse of each. Each moves the
    activations [micro_batch, seq_len / cp, hidden] (a rank sends (tp - 1) / tp of them)."""
    m = cfg.model
    return micro_batches * (2 * (m.num_layers + m.num_dense_layers) + 2)


@pytest.mark.parametrize("name", ["tp2", "tp2xfsdp2"])
def test_tensor_parallel_collectives_follow_the_formula(name, tp_run, helpers):
    nproc, overrides = LAYOUTS[name]
    cfg = helpers.small_config(*shared(name), *overrides)
    run_dir = tp_run(name)[2]
    dp = nproc // 2
    micro = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
    steps = json.loads((run_dir / "placement_rank0.json").read_text())["collectives"]
    assert len(steps) == 4
    for got in steps:
        assert got["tp_all_gathers"] == got["tp_reduce_scatters"] == tp_collectives_per_step(cfg, micro), got


def test_live_controls_land_on_both_tp_ranks(helpers, tmp_path):
    """A live change (moelab.contract.controls) reaches both TP ranks at the same step: the losses stay those of
    one process steered the same way (a rank applying it late would compute another loss than its peer; the
    aux-loss-free bias is off, see SHARED)."""
    from moelab.contract.controls import append_request
    from moelab.contract.stream import read_events

    changes = {"model.moe.aux_loss_coeff": 0.05, "train.lr": 0.01}
    runs = {}
    for name, nproc, extra in (("one", 1, ()), ("tp2", 2, ("parallel.tp=2",))):
        run_dir = tmp_path / name
        run_dir.mkdir()
        append_request(run_dir, changes, who="test", at=2)
        cfg = helpers.small_config(*SHARED, "train.steps=5", *extra)
        runs[name] = (helpers.run_single(cfg, run_dir) if nproc == 1 else helpers.run_multi(cfg, run_dir, nproc))
    # steps 3-4 run the changed values: held tightly (steered and unsteered runs part at step 4 by more than 1e-4,
    # tests/parallel/test_controls_parallel.py);
    # step 5 after two updates at the tripled lr, whose Adam noise in near-zero gradients TP's rounding triples
    assert runs["tp2"][0][:4] == pytest.approx(runs["one"][0][:4], rel=1e-5)
    assert runs["tp2"][0] == pytest.approx(runs["one"][0], rel=5e-5)
    controls = [(e["step"], e["field"]) for e in read_events(tmp_path / "tp2" / "metrics.jsonl")
                if e["event"] == "control"]
    assert controls == [(2, k) for k in changes]
