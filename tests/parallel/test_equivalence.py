"""EP, FSDP, PP (1F1B and interleaved with virtual stages), CP and their compositions on gloo processes reproduce
the single-process run: the loss of every step and every parameter after the run (gathered to full tensors),
within a tight fp32 tolerance."""
import pytest

pytestmark = pytest.mark.slow

NO_CAPACITY = "model.moe.capacity_factor=0"  # CP drops by capacity per rank (moelab.parallel.context)
OVERLAP = "parallel.ep_overlap=true"
CHUNKS = "backend.loss_chunk_tokens=24"
LAYOUTS = {  # name: (processes, overrides of the layout, overrides shared with its single-process reference)
    "ep2": (2, ["parallel.ep=2"], ()),
    "fsdp2": (2, [], ()),
    "ep4": (4, ["parallel.ep=4"], ()),
    "ep2xfsdp2": (4, ["parallel.ep=2"], ()),  # 4 data-parallel ranks; experts: 2 EP groups x 2 expert-FSDP
    "pp2": (2, ["parallel.pp=2"], ()),  # 1F1B over 4 micro batches
    "pp2vp2": (2, ["parallel.pp=2", "parallel.vp=2", "parallel.pp_schedule=interleaved_1f1b"], ()),
    "pp2xep2": (4, ["parallel.pp=2", "parallel.ep=2"], ()),  # 2 stages x (2 data-parallel ranks = 1 EP group)
    # SDPA with a lower-right causal mask per query chunk; the fake balanced gate (see below)
    "cp2": (2, ["parallel.cp=2"], (NO_CAPACITY, "backend.fake_balanced_gate=true")),
    "cp2xep2": (2, ["parallel.cp=2", "parallel.ep=2"], (NO_CAPACITY, "backend.attention=eager")),
    # parallel.ep_overlap: the all-to-all in two chunks overlapped with the experts (also held to plain EP below)
    "ep2overlap": (2, ["parallel.ep=2", OVERLAP], ()),
    "ep2xfsdp2overlap": (4, ["parallel.ep=2", OVERLAP], ()),
    # FSDP2 options that change no value: every block gathered through backward, explicit prefetching
    "fsdp2-lean": (2, ["parallel.reshard_after_forward=never", "parallel.fsdp_prefetch=explicit"], ()),
    # gradients reduce-scattered once per step (2 micro batches per rank): the first accumulates them unsharded;
    # with EP the experts' own units too (micro batches of 1: 2 per rank on 4 ranks)
    "fsdp2-step": (2, ["parallel.fsdp_grad_sync=step"], ()),
    "ep2xfsdp2-step": (4, ["parallel.ep=2", "parallel.fsdp_grad_sync=step"], ("train.micro_batch_size=1",)),
    # the fused loss (backend.loss=chunked, the default) in chunks of 24 tokens: 64 tokens per rank and micro
    # batch leave a partial chunk (CP's 32 per rank too), with the head FSDP2-sharded, on the last pipeline stage,
    # next to EP, and over CP's sequence shards
    "fsdp2-chunks": (2, [], (CHUNKS,)),
    "ep2-chunks": (2, ["parallel.ep=2"], (CHUNKS,)),
    "pp2-chunks": (2, ["parallel.pp=2"], (CHUNKS,)),
    "cp2xep2-chunks": (2, ["parallel.cp=2", "parallel.ep=2"], (NO_CAPACITY, "backend.attention=eager", CHUNKS)),
    # selective recompute (moelab.model.recompute) against the one process without recompute: the experts rerun
    # in backward on the rows the dispatch delivered (no second all-to-all: tests/parallel/test_recompute_exchanges)
    # with the router's kept choices; pipeline stages recompute inside the schedule
    "ep2-selective": (2, ["parallel.ep=2", "train.activation_checkpointing=selective"], ()),
    "pp2xep2-selective": (4, ["parallel.pp=2", "parallel.ep=2", "train.activation_checkpointing=selective"], ()),
    # the experts' checkpointed piece is their FSDP2 unit (expert-FSDP over 2 ranks): gathered again to recompute
    "ep2xfsdp2-selective": (4, ["parallel.ep=2", "train.activation_checkpointing=selective"], ()),
}
OVERLAPPED = {"ep2overlap": "ep2", "ep2xfsdp2overlap": "ep2xfsdp2"}  # overlapped layout: the same without it
# One-rank meshes skip FSDP2 (moelab.parallel.fsdp): EP over all dp*cp ranks leaves the experts plain (one rank
# of expert-FSDP), one rank per pipeline stage leaves everything plain; every other parameter is a DTensor.
PLAIN = {"ep2": "experts", "ep2overlap": "experts", "ep4": "experts", "pp2xep2": "experts", "cp2xep2": "experts", "pp2": "all",
         "pp2vp2": "all", "ep2-chunks": "experts", "pp2-chunks": "all", "cp2xep2-chunks": "experts",
         "ep2-selective": "experts", "pp2xep2-selective": "experts"}
# Parameters after 4 AdamW steps (conftest.layout_bounds): every layout that only reorders float32 sums (over
# the step's tokens, across ranks) is held to steps x tokens x eps relative (1.2e-4 here) and Adam's 2 x steps x lr
# absolute (elements whose gradient is rounding noise). Expert parallelism also weights the expert outputs at
# combine, one process before the down projection (moelab.model.moe.Dispatcher.row_weights): the same products in
# another order, within the same bound. CP computes attention per query chunk, other arithmetic than one
# whole-sequence kernel, and its bound is what a kernel change does to this same run: switching one process from
# SDPA to eager attention moves parameters by up to 3e-4 absolute and 5e-4 relative norm (measured). CP's losses,
# routing counts, aux losses and gradient norms are held to the derived bounds.
PARAM_TOL = {"cp2": (5e-4, 1e-3), "cp2xep2": (5e-4, 1e-3), "cp2xep2-chunks": (5e-4, 1e-3)}  # (max abs difference, relative norm difference)


# cp2 (CP with FSDP2 over the two CP ranks, no EP) with the learned router matched one process on one CPU kind and
# not on another (a Sapphire Rapids: step 4's loss 2.3e-4 relative apart). Its step 1 agreed to float32 rounding,
# then a near-tie among the tiny model's router logits fell the other way at step 2 (the routing counts differ from
# there on): SDPA per query chunk rounds apart from the whole sequence, and a flip amplifies it. So cp2 runs the
# fake balanced gate, whose routing rounding cannot move: its losses are then bit-identical to one process. The
# learned router under CP is held by cp2xep2 and cp2xep2-chunks (eager attention, whose rounding matches).
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_reproduces_single_process(name, reference, layout_run, helpers):
    nproc, overrides, shared = LAYOUTS[name]
    ref_losses, ref_params, ref_dir = reference(*shared)
    losses, params, run_dir = layout_run(name)
    bounds = helpers.layout_bounds(helpers.small_config(*shared, *overrides))
    assert len(losses) == len(ref_losses) == 4
    assert losses == pytest.approx(ref_losses, rel=bounds.rel, abs=0)
    # the statistics sum: global routing counts, the mean aux loss, every rank's memory
    ref_ev, ev = helpers.step_events(ref_dir), helpers.step_events(run_dir)
    assert [e["routing"]["tokens_per_expert"] for e in ev] == [e["routing"]["tokens_per_expert"] for e in ref_ev]
    assert [e["routing"]["dropped_tokens"] for e in ev] == [e["routing"]["dropped_tokens"] for e in ref_ev]
    assert [e["aux_loss"] for e in ev] == pytest.approx([e["aux_loss"] for e in ref_ev], rel=bounds.rel, abs=0)
    assert [e["grad_norm"] for e in ev] == pytest.approx([e["grad_norm"] for e in ref_ev], rel=bounds.rel, abs=0)
    assert all(len(e["memory"]["per_rank"]) == nproc for e in ev)
    max_abs, max_rel = PARAM_TOL.get(name, (bounds.abs, bounds.rel))
    diff = helpers.assert_within(params, ref_params, bounds, max_abs, max_rel)
    print(f"{name}: worst relative norm {max(d[1] for d in diff.values()):.3g} (bound {max_rel:.3g})")
    check_placement(name, run_dir)


def test_the_bounds_catch_a_dropped_gradient_term(reference, helpers, tmp_path):
    """The derived bounds are no blanket: EP=2 with rank 1 dropping its z-loss term (TEST_RANK_OVERRIDES in
    rank_entry: its share of the router's gradient loses one term, as a loss computed on local tokens only and
    never reduced would) lands outside them, while the same layout without the bug is inside (above)."""
    ref_losses, ref_params, _ = reference()
    cfg = helpers.small_config("parallel.ep=2")
    bounds = helpers.layout_bounds(cfg)
    losses, params = helpers.run_multi(cfg, tmp_path, 2, env={"TEST_RANK_OVERRIDES": "1:model.moe.z_loss_coeff=0"})
    diff = helpers.param_differences(params, ref_params)
    worst = max(d[1] for d in diff.values())
    print(f"dropped z-loss term on rank 1: worst relative norm {worst:.3g} (bound {bounds.rel:.3g})")
    assert worst > 3 * bounds.rel, sorted(diff.items(), key=lambda kv: -kv[1][1])[:3]


@pytest.fixture(scope="module")
def layout_run(helpers, tmp_path_factory):
    """layout_run(name) -> (losses, full parameters, run folder) of LAYOUTS[name], run once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            nproc, overrides, shared = LAYOUTS[name]
            run_dir = tmp_path_factory.mktemp(name)
            cache[name] = (*helpers.run_multi(helpers.small_config(*shared, *overrides), run_dir, nproc), run_dir)
        return cache[name]

    return get


@pytest.mark.parametrize("name", OVERLAPPED)
def test_ep_overlap_gives_the_plain_ep_run(name, layout_run, helpers):
    """The two-chunk exchange changes no routing or capacity decision and no loss: the same layout without
    parallel.ep_overlap, held far tighter than the single-process reference (only the experts' GEMMs see two
    smaller batches)."""
    losses, params, run_dir = layout_run(name)
    plain_losses, plain_params, plain_dir = layout_run(OVERLAPPED[name])
    assert losses == pytest.approx(plain_losses, rel=1e-6, abs=0)
    ev, plain_ev = helpers.step_events(run_dir), helpers.step_events(plain_dir)
    for key in ("tokens_per_expert", "dropped_tokens"):
        assert [e["routing"][key] for e in ev] == [e["routing"][key] for e in plain_ev]
    assert [e["comm"] for e in ev] == [e["comm"] for e in plain_ev]  # the dispatcher's rows and bytes
    assert [e["aux_loss"] for e in ev] == pytest.approx([e["aux_loss"] for e in plain_ev], rel=1e-6, abs=0)
    assert [e["grad_norm"] for e in ev] == pytest.approx([e["grad_norm"] for e in plain_ev], rel=1e-6, abs=0)
    # The parameters after 4 AdamW steps: the experts' weight gradients are summed per chunk (another order of the
    # same float32 sums), so the derived bounds hold them (layout_bounds: Adam gives an element whose gradient is
    # rounding noise any sign, up to 2 x steps x lr apart; measured 1.3e-5 with OMP_NUM_THREADS=2)
    nproc, overrides, shared = LAYOUTS[name]
    bounds = helpers.layout_bounds(helpers.small_config(*shared, *overrides))
    diff = helpers.assert_within(params, plain_params, bounds)
    print("overlap vs plain, worst (max abs, relative norm):", max(diff.values()))



# FSDP2's collectives in each step, counted on the ranks (rank_entry.count_collectives), against the planner's
# schedule (moelab.planner.comm.fsdp_counts): a unit that reshards after forward gathers again in
# backward; gradients are reduce-scattered every micro batch, or once per step under fsdp_grad_sync=step and
# under pp > 1 (torch's schedule). 2 micro batches per rank here (4 under pp2xep2's schedule).
SCHEDULED = ["fsdp2", "fsdp2-lean", "fsdp2-step", "ep2xfsdp2", "ep2xfsdp2-step", "pp2xep2"]


@pytest.mark.parametrize("name", SCHEDULED)
def test_fsdp_collectives_follow_the_planned_schedule(name, layout_run, helpers):
    import json

    from moelab.planner.plan import plan

    nproc, overrides, shared = LAYOUTS[name]
    run_dir = layout_run(name)[2]
    planned = plan(helpers.small_config(*shared, *overrides), gpus=nproc)
    rank = planned.stage * nproc // planned.layout["pp"]  # the first rank of the stage the plan is for
    steps = json.loads((run_dir / f"placement_rank{rank}.json").read_text())["collectives"]
    c = planned.comm
    assert len(steps) == 4 and c["fsdp_reduce_scatters_per_step"] > 0
    for got in steps:
        assert (got["all_gathers"], got["reduce_scatters"]) == (c["fsdp_all_gathers_per_step"],
                                                                c["fsdp_reduce_scatters_per_step"]), got
        # FSDP2 pads each parameter's rows to a multiple of the ranks: a few elements more than the model has
        assert got["all_gather_bytes"] == pytest.approx(c["fsdp_all_gather_bytes_per_step"], rel=0.01)
        assert got["reduce_scatter_bytes"] == pytest.approx(c["fsdp_reduce_scatter_bytes_per_step"], rel=0.01)


def test_grad_sync_per_step_reduces_once(layout_run):
    """fsdp_grad_sync=step against the same layout reducing every micro batch: half the reduce-scatters (two
    micro batches), fewer all-gathers (no gather before the second forward), the same losses far tighter than
    the single-process tolerance (only the order of the gradient sums differs)."""
    import json

    (plain_losses, _, plain_dir), (losses, _, step_dir) = layout_run("fsdp2"), layout_run("fsdp2-step")
    assert losses == pytest.approx(plain_losses, rel=1e-6)
    a, b = (json.loads((d / "placement_rank0.json").read_text())["collectives"][-1] for d in (plain_dir, step_dir))
    assert 2 * b["reduce_scatters"] == a["reduce_scatters"] and b["all_gathers"] < a["all_gathers"], (a, b)


def check_placement(name, run_dir):
    """Rank 0's parameters are plain exactly where PLAIN says, and were allocated so (FSDP2 shards as shards);
    each optimizer group holds one kind (plain, or DTensors of one mesh: fused AdamW refuses a mix); the FSDP2
    options reached FSDP2."""
    import json

    got = json.loads((run_dir / "placement_rank0.json").read_text())
    plain = PLAIN.get(name)
    for key, kind in got["params"].items():
        want = plain == "all" or (plain == "experts" and ".experts." in key)
        assert kind == ("plain" if want else "dtensor"), (key, kind)
    # FSDP2 wrapped the meta-device model: every parameter that ends a shard was allocated as one (its rows only)
    kinds = list(got["params"].values())
    assert got["allocated"] == {"plain": kinds.count("plain"), "dtensor": kinds.count("dtensor")}, got["allocated"]
    assert all(len(g["kinds"]) == 1 and len(g["meshes"]) <= 1 for g in got["groups"]), got["groups"]
    units = got["units"]
    if plain == "all":
        assert units == {}
        return
    blocks = sorted((k for k in units if k.startswith("layers.") and ".experts" not in k), key=lambda k: int(k[7:]))
    # the root stays gathered (pipeline stages' roots are not in the model's module tree)
    assert blocks and not units.get("<root>", {}).get("reshard_after_forward")
    if name == "fsdp2-lean":  # never: no block reshards; explicit: the root and each block gather the next
        assert not any(units[b]["reshard_after_forward"] for b in blocks)
        assert [units[k]["forward_prefetch"] for k in ["<root>", *blocks]] == [[b] for b in blocks] + [[]]
        assert [units[k]["backward_prefetch"] for k in ["<root>", *blocks[::-1]]] == [[b] for b in blocks[::-1]] + [[]]
    elif "pp2" not in name:  # torchtitan's default: all but the last block reshard after forward
        assert [units[b]["reshard_after_forward"] for b in blocks] == [True] * (len(blocks) - 1) + [False]
    else:  # pipeline stages keep their blocks gathered through the schedule's micro batches
        assert not any(units[b]["reshard_after_forward"] for b in blocks)
