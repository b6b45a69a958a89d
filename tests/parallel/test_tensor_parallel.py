"""Tensor parallelism (moelab.parallel.tensor) on gloo processes reproduces the single-process run: losses,
routing counts, aux losses, gradient norms and parameters after 4 AdamW steps, for every model family (Qwen3,
DeepSeek-V3, GPT-OSS) at tp2, tp2 x ep2, tp2 x pp2, tp2 x fsdp2 and tp2 x cp2 (one single-process reference per
family); the TP and FSDP2 collectives counted on the ranks are the planner's.

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
    "full": ("train.activation_checkpointing=full",),  # each block recomputed in backward, hooks and all
    "tied": ("model.tie_embeddings=true",),  # the head is the vocabulary-parallel embedding
}
KINDS = {  # layout kind: (processes, overrides); each runs every model family of the issue (FAMILIES)
    "tp2": (2, ["parallel.tp=2"]),
    "tp2xep2": (4, ["parallel.tp=2", "parallel.ep=2"]),  # EP carved from the TP pair, expert-FSDP over the dp ranks
    "tp2xpp2": (4, ["parallel.tp=2", "parallel.pp=2"]),  # stages pass their sequence shards (1F1B, 4 micro batches)
    "tp2xfsdp2": (4, ["parallel.tp=2"]),  # FSDP2 on the 2-D (dp_cp, tp) mesh
    "tp2xcp2": (4, ["parallel.tp=2", "parallel.cp=2"]),  # router loss means over the 4 ranks of a sequence
}
FAMILIES = ("qwen3", "deepseek", "gptoss")
LAYOUTS = {  # name: (processes, layout overrides); the family's name follows the kind's, one reference per family
    **{f"{kind}-{family}": spec for kind, spec in KINDS.items() for family in FAMILIES},
    "tp2": KINDS["tp2"],  # tiny itself: `moelab run tiny --nproc 2 --set parallel.tp=2`
    "tp2-full": (2, ["parallel.tp=2"]),
    "tp2-tied": (2, ["parallel.tp=2"]),
    # DeepSeek's shared expert column/row-parallel over TP (parallel.tp_shared_experts): alone on TP (one dense
    # rank: no FSDP2 unit takes it) and as its own FSDP2 unit over the 2-D mesh
    **{f"{kind}-deepseek-column_row": (n, over + ["parallel.tp_shared_experts=column_row"])
       for kind, (n, over) in KINDS.items() if kind in ("tp2", "tp2xfsdp2")},
}
LR = 0.003  # tiny's train.lr


def shared(name: str) -> tuple:
    """The overrides a layout shares with its single-process reference: SHARED and its model family's."""
    return SHARED + FAMILY.get(name.split("-")[1] if "-" in name else "", ())


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


def assert_same_steps(losses, run_dir, ref_losses, ref_dir, helpers) -> None:
    """A TP run's 4 steps against one process's: losses (the first to 1e-6), routing counts exact, aux losses and
    gradient norms (TP's bounds: the module docstring)."""
    assert len(losses) == 4 and losses[0] == pytest.approx(ref_losses[0], rel=1e-6)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    ref_ev, ev = helpers.step_events(ref_dir), helpers.step_events(run_dir)
    assert [e["routing"]["tokens_per_expert"] for e in ev] == [e["routing"]["tokens_per_expert"] for e in ref_ev]
    assert [e["aux_loss"] for e in ev] == pytest.approx([e["aux_loss"] for e in ref_ev], rel=1e-5)
    assert [e["grad_norm"] for e in ev] == pytest.approx([e["grad_norm"] for e in ref_ev], rel=1e-4)


@pytest.mark.parametrize("name", LAYOUTS)
def test_tensor_parallel_reproduces_single_process(name, reference, tp_run, helpers):
    assert load_config("tiny").train.lr == LR
    ref_losses, ref_params, ref_dir = reference(*shared(name))
    losses, params, run_dir = tp_run(name)
    assert_same_steps(losses, run_dir, ref_losses, ref_dir, helpers)
    assert params.keys() == ref_params.keys()
    for key, ref in ref_params.items():
        assert params[key].shape == ref.shape, key
        assert (params[key] - ref).abs().max().item() < LR / 3, key
        assert ((params[key] - ref).norm() / ref.norm().clamp(min=1e-12)).item() < 2e-3, key
    # TP's shards: rank 0's attention, dense MLP, embedding and head are DTensors (nothing left plain)
    placed = json.loads((run_dir / "placement_rank0.json").read_text())["params"]
    assert all(kind == "dtensor" for kind in placed.values()), placed


COUNTED = [name for name in LAYOUTS if "xpp2" not in name]  # one stage: the plan's worst rank is every rank


@pytest.mark.parametrize("name", COUNTED)
def test_tp_collectives_counted_on_the_ranks_are_the_planners(name, tp_run, helpers):
    """TP's all-gathers and reduce-scatters (DTensor's functional collectives, counted per step on every rank by
    rank_entry) are the planner's tp_collectives_per_step (moelab.planner.plan.tp_traffic): per micro batch and
    block those of attention, of a dense MLP and of column/row shared experts, forward and backward (and full
    recompute's rerun), and the vocabulary-parallel embedding's and head's. FSDP2's all-gathers and reduce-scatters
    are the plan's too (moelab.planner.comm.fsdp_units: under TP a MoE layer's router and replicated shared
    experts are a unit over dp*cp*tp, column/row shared experts one over dp*cp, the experts one over
    expert-FSDP)."""
    from moelab.planner.plan import plan, tp_gathered_sublayers

    nproc, overrides = LAYOUTS[name]
    cfg = helpers.small_config(*shared(name), *overrides)
    planned = plan(cfg, gpus=nproc)
    m = cfg.model
    # full recompute stops before a gathered FFN's final reduce-scatter (torch's checkpoint early stop)
    gathered_ffns = sum(tp_gathered_sublayers(cfg, i >= m.num_dense_layers) - 1 for i in range(m.num_layers))
    unmatched = planned.micro_batches_per_step * gathered_ffns if cfg.train.activation_checkpointing == "full" else 0
    for rank in range(nproc):
        steps = json.loads((tp_run(name)[2] / f"placement_rank{rank}.json").read_text())["collectives"]
        assert len(steps) == 4
        for got in steps:
            assert got["tp_all_gathers"] - got["tp_reduce_scatters"] == unmatched, got
            assert got["tp_all_gathers"] + got["tp_reduce_scatters"] == planned.comm["tp_collectives_per_step"], \
                (rank, got, planned.comm["tp_collectives_per_step"])
            assert (got["all_gathers"], got["reduce_scatters"]) == (
                planned.comm["fsdp_all_gathers_per_step"], planned.comm["fsdp_reduce_scatters_per_step"]), (rank, got)


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
