"""The step-time model (moelab.planner.speed): its parts add up to the step and to the figures it reports, each
term moves the way its cause says, the communication it hides is what moelab's schedule can hide, FSDP2 traffic
is counted as the schedule runs it, and the prediction shows in the plan, on the command line and in Session.plan.
No test asserts a speed as a target (the rates' own records: tests/planner/test_rates.py)."""

import pytest

from moelab.config import ConfigError, load_config
from moelab.gallery.records import planner_options
from moelab.planner.comm import fsdp_bytes
from moelab.planner.flops import attention_flops_per_token, count_params
from moelab.planner.gpus import GPU_KINDS, gpu_kind
from moelab.planner.plan import plan
from moelab.planner.rates import EAGER_FACTOR, H200_MEASURED, LOSS_KERNEL_MEASURED
from moelab.planner.speed import COMM_PARTS, layer_flops

PROXY = "qwen3-moe-30b-a3b-proxy"
BF16 = {"train.dtype": "bfloat16", "train.param_dtype": "bfloat16"}
EP2 = {**BF16, "parallel.ep": 2, "parallel.fsdp": 2, "train.global_batch_size": 4}
FITS_256 = {"train.optimizer_state": "bf16_moments"}  # the preset's layout fits 256 H100s with bf16 moments


def speed(name, gpus=None, gpu="h200", **over):
    return plan(load_config(name, over), gpus=gpus, gpu=gpu).speed


def test_the_parts_add_up_to_the_step_and_its_figures():
    p = plan(load_config("deepseek-v3", FITS_256), gpus=256, gpu="h100")
    s = p.speed
    assert s.step_s == pytest.approx(sum(s.parts_s.values()), rel=1e-12)
    assert s.tokens_per_s_per_gpu == pytest.approx(512 * 4096 / 256 / s.step_s)
    assert s.tflops_per_gpu == pytest.approx(s.tokens_per_s_per_gpu * p.flops_per_token / 1e12)
    assert s.mfu == pytest.approx(s.tflops_per_gpu / GPU_KINDS["h100"].bf16_tflops)
    assert s.gpu_hours_per_billion_tokens == pytest.approx(1e9 / s.tokens_per_s_per_gpu / 3600)
    assert s.bottleneck == max(s.parts_s, key=s.parts_s.get)
    # every kind of work this layout does is charged: EP, PP, FSDP, the optimizer
    for term in ("dense_matmul", "expert_matmul", "attention", "all_to_all", "bubble", "pipeline_send", "fsdp",
                 "optimizer"):
        assert s.parts_s[term] > 0, term
    assert set(s.hidden_s) <= set(COMM_PARTS) and all(v > 0 for v in s.hidden_s.values())


def test_doubling_the_tokens_doubles_the_matmuls_and_leaves_the_optimizer():
    one = speed(PROXY, **{"train.micro_batch_size": 2, "train.global_batch_size": 2})
    two = speed(PROXY, **{"train.micro_batch_size": 4, "train.global_batch_size": 4})
    for term in ("dense_matmul", "expert_matmul", "attention", "elementwise", "head_loss"):
        assert two.parts_s[term] == pytest.approx(2 * one.parts_s[term]), term
    assert two.parts_s["optimizer"] == pytest.approx(one.parts_s["optimizer"])
    assert two.tokens_per_s_per_gpu > one.tokens_per_s_per_gpu  # the optimizer is amortised over more tokens


def test_the_matmul_terms_follow_the_flops_count():
    s = speed(PROXY, **{"train.compile": True, "backend.loss": "full"})
    cfg = load_config(PROXY)
    fl, T = layer_flops(cfg.model), 2 * 4096
    rate = lambda key: H200_MEASURED[key][0] * 1e12  # noqa: E731
    assert s.parts_s["expert_matmul"] == pytest.approx(T * 8 * fl["moe_experts"] / rate("grouped_tflops"))
    assert s.parts_s["dense_matmul"] == pytest.approx(T * 8 * fl["moe_dense"] / rate("dense_tflops"))
    assert s.parts_s["attention"] == pytest.approx(T * attention_flops_per_token(cfg.model, 4096)
                                                   / rate("attention_tflops"))
    head = T * fl["head"] / rate("dense_tflops")
    a = 2 if cfg.train.dtype == "bfloat16" else 4  # the in-place loss kernel: two reads of the logits, one write
    assert s.parts_s["head_loss"] == pytest.approx(
        head + 3 * a * T * cfg.model.vocab_size / (_measured(LOSS_KERNEL_MEASURED, "h200") * 1e12))
    # the pieces are the planner's count: 8 MoE blocks + the LM head = 6 x activated parameters
    assert 8 * (fl["moe_dense"] + fl["moe_experts"]) + fl["head"] == pytest.approx(
        plan(cfg).flops_per_token - attention_flops_per_token(cfg.model, 4096))


def test_the_loss_kind_changes_only_the_head_and_loss_and_library_losses_are_said_unmodelled():
    full, chunked = (speed(PROXY, **{"train.compile": True, "backend.loss": k}) for k in ("full", "chunked"))
    assert chunked.parts_s["head_loss"] != full.parts_s["head_loss"]
    assert {k: v for k, v in chunked.parts_s.items() if k != "head_loss"} == pytest.approx(
        {k: v for k, v in full.parts_s.items() if k != "head_loss"})
    assert full.unmodelled == chunked.unmodelled == [] and full.settings["loss"] == "full"
    liger = speed(PROXY, **{"train.compile": True, "backend.loss": "liger"})
    assert any("backend.loss=liger" in u and "not profiled" in u for u in liger.unmodelled)
    assert any(a.startswith("speed, not modelled: backend.loss=liger") for a in
               plan(load_config(PROXY, {"train.compile": True, "backend.loss": "liger"}), gpu="h200").assumptions)


def test_fp8_swaps_the_gemm_rates_and_adds_the_quantisation_whose_weight_share_a_step_amortises():
    base = {**BF16, "train.compile": True, "train.global_batch_size": 2}
    bf16, fp8 = speed(PROXY, **base), speed(PROXY, **base, **{"train.fp8": "rowwise"})
    assert fp8.parts_s["fp8_quant"] > 0 == bf16.parts_s["fp8_quant"]
    assert fp8.parts_s["expert_matmul"] < bf16.parts_s["expert_matmul"]
    assert fp8.parts_s["head_loss"] == bf16.parts_s["head_loss"] and not fp8.unmodelled  # the head stays bf16
    head = speed(PROXY, **base, **{"train.fp8": "rowwise_lm_head"})
    assert head.parts_s["head_loss"] > bf16.parts_s["head_loss"]  # the kernel check: slower with quantisation
    # the expert weights are quantised once per step (moelab.model.fp8_cache): per micro batch it falls with m
    eight = speed(PROXY, **{**base, "train.global_batch_size": 16, "train.fp8": "rowwise"})
    assert eight.parts_s["fp8_quant"] / 8 < fp8.parts_s["fp8_quant"]
    # ... but not where FSDP2 shards them (DTensors are not cached): every micro batch pays it
    sharded = [speed(PROXY, gpus=2, **{**base, "parallel.fsdp": 2, "train.fp8": "rowwise",
                                       "train.global_batch_size": g}) for g in (4, 8)]
    assert sharded[1].parts_s["fp8_quant"] == pytest.approx(2 * sharded[0].parts_s["fp8_quant"])


def test_recompute_reruns_a_forward_full_the_matmuls_selective_only_the_cheap_parts():
    none, full, sel = (speed(PROXY, **{"train.activation_checkpointing": k}) for k in ("none", "full", "selective"))
    for term in ("dense_matmul", "expert_matmul", "attention"):
        assert full.parts_s[term] == pytest.approx(4 / 3 * none.parts_s[term]), term
        assert sel.parts_s[term] == pytest.approx(none.parts_s[term]), term  # matmul and SDPA outputs kept
    assert sel.parts_s["elementwise"] == pytest.approx(full.parts_s["elementwise"])
    assert sel.parts_s["elementwise"] > none.parts_s["elementwise"]
    assert none.recompute_s == 0 < sel.recompute_s < full.recompute_s
    # full recompute reruns the block's dispatch and combine (6 exchanges a MoE layer); selective keeps what the
    # dispatch delivered (4, as without recompute)
    ep = {k: speed(PROXY, gpus=2, **EP2, **{"train.activation_checkpointing": k}) for k in ("none", "selective",
                                                                                          "full")}
    assert ep["selective"].parts_s["all_to_all"] == pytest.approx(ep["none"].parts_s["all_to_all"])
    assert ep["full"].parts_s["all_to_all"] == pytest.approx(1.5 * ep["none"].parts_s["all_to_all"])


def test_the_optimizer_follows_its_kernel_and_the_state_it_moves():
    triton, torch_adamw = (speed(PROXY, **{**BF16, "train.optimizer": k}) for k in ("auto", "adamw"))
    assert torch_adamw.parts_s["optimizer"] > triton.parts_s["optimizer"]
    assert triton.settings["optimizer"] == "adamw_triton"  # auto on a CUDA machine with Triton
    # fp32 moments move more bytes than bf16 ones beside the same fp32 weights
    fp32, bf16 = (speed(PROXY, **{"train.optimizer_state": k}) for k in ("fp32", "bf16_moments"))
    assert fp32.parts_s["optimizer"] > bf16.parts_s["optimizer"]


def test_ep_across_nodes_raises_the_all_to_all():
    base = {"parallel.fsdp": 16, "train.global_batch_size": 64, "train.micro_batch_size": 4}
    in_node = speed("qwen3-moe-30b-a3b", gpus=16, gpu="h100", **base, **{"parallel.ep": 8})
    across = speed("qwen3-moe-30b-a3b", gpus=16, gpu="h100", **base, **{"parallel.ep": 16})
    assert across.parts_s["all_to_all"] > 1.5 * in_node.parts_s["all_to_all"]
    assert any("47% of its all-to-all partners on the same node" in a for a in across.assumptions)  # 7 of 15


def test_ep_overlap_hides_at_most_half_the_exchange_and_nothing_else():
    plain = speed(PROXY, gpus=2, **EP2)
    over = speed(PROXY, gpus=2, **EP2, **{"parallel.ep_overlap": True})
    assert "all_to_all" not in plain.hidden_s
    hidden = over.hidden_s["all_to_all"]
    assert over.parts_s["all_to_all"] + hidden == pytest.approx(plain.parts_s["all_to_all"])
    assert 0 < hidden <= plain.parts_s["all_to_all"] / 2
    assert {k: v for k, v in over.parts_s.items() if k != "all_to_all"} == pytest.approx(
        {k: v for k, v in plain.parts_s.items() if k != "all_to_all"})


def test_fsdp_overlap_hides_gathers_and_reduces_behind_compute_but_not_the_first_and_last():
    s = speed("gpt-oss-20b", gpus=8, gpu="h100", **{"parallel.fsdp": 8, "train.global_batch_size": 64})
    p = plan(load_config("gpt-oss-20b", {"parallel.fsdp": 8, "train.global_batch_size": 64}), gpus=8, gpu="h100")
    c = p.comm
    wire = (c["fsdp_all_gather_bytes_per_step"] + c["fsdp_reduce_scatter_bytes_per_step"]) / (
        H200_MEASURED["nvlink_gb_s"][0] * 1e9)
    assert s.parts_s["fsdp"] + s.hidden_s["fsdp"] == pytest.approx(wire, rel=1e-6)  # all of it, one or the other
    assert s.hidden_s["fsdp"] > 0 and s.parts_s["fsdp"] > 0  # the root's gather and reduce have nothing to hide behind
    assert s.parts_s["fsdp_copies"] > 0  # FSDP2's copy-in / copy-out run on the compute stream
    # under EP, implicit prefetch starts each gather after the dispatcher's host synchronisation: less hidden
    base = {"parallel.ep": 8, "parallel.fsdp": 8, "train.global_batch_size": 64}
    explicit = speed("qwen3-moe-30b-a3b", gpus=8, gpu="h100", **base)
    implicit = speed("qwen3-moe-30b-a3b", gpus=8, gpu="h100", **base, **{"parallel.fsdp_prefetch": "implicit"})
    assert implicit.parts_s["fsdp"] >= explicit.parts_s["fsdp"]
    assert implicit.hidden_s["fsdp"] <= explicit.hidden_s["fsdp"]


def test_fsdp_across_nodes_is_slower_than_within_one():
    within = speed("gpt-oss-20b", gpus=8, gpu="h100", **{"parallel.fsdp": 8, "train.global_batch_size": 64})
    across = speed("gpt-oss-20b", gpus=16, gpu="h100", **{"parallel.fsdp": 16, "train.global_batch_size": 128})
    total = lambda s: s.parts_s["fsdp"] + s.hidden_s.get("fsdp", 0)  # noqa: E731
    assert total(across) > total(within)


def test_fsdp_traffic_is_counted_once_as_the_schedule_runs_it():
    """Without pp every micro batch reduce-scatters (and gathers); under pp the stages gather once and reduce once
    per step, so the plan's bytes do not grow with the micro batches (they were counted per micro batch before)."""
    def comm(**over):
        return plan(load_config(PROXY, {**BF16, **over}), gpus=4)
    flat = [comm(**{"parallel.fsdp": 4, "train.global_batch_size": g}).comm for g in (8, 16)]
    for key in ("fsdp_all_gather_bytes_per_step", "fsdp_reduce_scatter_bytes_per_step"):
        assert flat[1][key] == pytest.approx(2 * flat[0][key]), key
    plans = [comm(**{"parallel.pp": 2, "parallel.fsdp": 2, "train.global_batch_size": g}) for g in (8, 16)]
    piped = [p.comm for p in plans]
    for key in ("fsdp_all_gather_bytes_per_step", "fsdp_reduce_scatter_bytes_per_step"):
        assert piped[1][key] == piped[0][key] > 0, key
    m = plans[0].micro_batches_per_step
    assert {(u["gathers_per_micro_batch"] * m, u["reduce_scatters_per_step"]) for u in piped[0]["fsdp_units"]} == {
        (1.0, 1.0)}  # once per step
    # reshard_after_forward=always: gathered again in backward
    always = comm(**{"parallel.fsdp": 4, "train.global_batch_size": 8,
                     "parallel.reshard_after_forward": "always"}).comm
    assert always["fsdp_all_gather_bytes_per_step"] > flat[0]["fsdp_all_gather_bytes_per_step"]
    # the one count: bytes follow (gathers per micro batch, reduce-scatters per step) and the shard share
    one = fsdp_bytes(10**9, 8, 2, 4, micro_batches=4, compute_bytes=2, reduce_bytes=4)
    assert one["all_gather"] == 2 * 4 * 2 * 10**9 * 7 // 8 and one["reduce_scatter"] == 4 * 4 * 10**9 * 7 // 8
    alone = fsdp_bytes(10**9, 1, 2, 4, 4, 2, 4)
    assert alone["all_gather"] == alone["reduce_scatter"] == 0  # one rank sends nothing, but FSDP2 still copies
    assert alone["gather_copied"] == 2 * 4 * 10**9 * 2 * 2 and alone["reduce_copied"] == 4 * 10**9 * (2 + 4)


def test_under_pp_the_reduce_after_the_last_backward_is_exposed():
    s = speed(PROXY, gpus=4, **{**BF16, "parallel.pp": 2, "parallel.fsdp": 2, "train.global_batch_size": 8})
    p = plan(load_config(PROXY, {**BF16, "parallel.pp": 2, "parallel.fsdp": 2, "train.global_batch_size": 8}),
             gpus=4, gpu="h200")
    rs = p.comm["fsdp_reduce_scatter_bytes_per_step"] / (H200_MEASURED["nvlink_gb_s"][0] * 1e9)
    assert s.parts_s["fsdp"] >= rs


def optimizer_s(gpu: str, cfg) -> float:
    """The Triton AdamW's kernel and the Triton norm's pass, each at the rate measured on `gpu`: AdamW reads p, g, m,
    v and writes p, m, v; the norm reads g (moelab.planner.rates.ADAMW_MEASURED, GRAD_NORM_MEASURED)."""
    from moelab.planner.rates import ADAMW_MEASURED, GRAD_NORM_MEASURED

    mem = plan(cfg, gpu=gpu).memory
    g, opt = mem["gradients"], mem["optimizer"]
    return (3 * g + 2 * opt) / (ADAMW_MEASURED[gpu][0] * 1e12) + g / (GRAD_NORM_MEASURED[gpu][0] * 1e12)


def test_h100_against_h200_scales_memory_bound_terms_by_hbm_only():
    # but the Triton AdamW's and its norm's, each measured on both (moelab.planner.rates)
    h100, h200 = speed(PROXY, gpu="h100", **BF16), speed(PROXY, gpu="h200", **BF16)  # fits 80 GB
    ratio = GPU_KINDS["h200"].hbm_tb_s / GPU_KINDS["h100"].hbm_tb_s
    cfg = load_config(PROXY, BF16)
    for gpu, s in (("h100", h100), ("h200", h200)):
        assert s.parts_s["optimizer"] == pytest.approx(optimizer_s(gpu, cfg))
    assert h100.parts_s["elementwise"] == pytest.approx(ratio * h200.parts_s["elementwise"])
    assert h100.parts_s["dense_matmul"] == pytest.approx(h200.parts_s["dense_matmul"])  # the same BF16 peak
    assert h100.gpu == "H100 SXM 80GB" and h100.tokens_per_s_per_gpu < h200.tokens_per_s_per_gpu


def test_compile_changes_only_the_elementwise_and_loss_work():
    eager, compiled = speed(PROXY, **{"backend.loss": "full"}), speed(PROXY, **{"train.compile": True,
                                                                              "backend.loss": "full"})
    assert eager.parts_s["elementwise"] == pytest.approx(EAGER_FACTOR * compiled.parts_s["elementwise"])
    assert eager.parts_s["head_loss"] == compiled.parts_s["head_loss"]  # the in-place loss kernel either way
    before = {k: plan(load_config(PROXY, {"backend.loss": "full", "train.compile": c}), gpu="h200",
                      full_loss="compiled").speed for k, c in (("eager", False), ("compiled", True))}
    assert before["eager"].parts_s["head_loss"] > before["compiled"].parts_s["head_loss"]
    assert eager.parts_s["dense_matmul"] == compiled.parts_s["dense_matmul"]


def test_pipeline_bubble_is_the_plans_fraction_of_the_step():
    p = plan(load_config(PROXY, {"parallel.pp": 2, "train.global_batch_size": 8}), gpus=2, gpu="h200")
    s, f = p.speed, p.pipeline["bubble_fraction"]
    per_step = ("fsdp", "fsdp_copies", "replicated", "optimizer", "casts", "bubble", "grad_accumulate")
    # the idle of the loss's and optimizer's host work comes once per step, not with each stage's micro batch
    busy = sum(v for k, v in s.parts_s.items() if k not in per_step) - H200_MEASURED["idle_s_per_step"][0]
    assert s.parts_s["bubble"] == pytest.approx(busy * f / (1 - f))


def test_gpu_kinds_carry_their_sources_and_refuse_unknown_names():
    for kind in GPU_KINDS.values():
        assert set(kind.sources) >= {"bf16_tflops", "fp8_tflops", "hbm_tb_s", "nvlink_gb_s", "ib_gb_s", "memory_gb"}
        assert all("http" in src for src in kind.sources.values())
    assert gpu_kind("NVIDIA H200").memory_gb == 141.0
    with pytest.raises(ConfigError, match=r"gpu='a100': unknown GPU kind; choose one of \['h100', 'h200'\]"):
        plan(load_config("tiny"), gpu="a100")


def test_plan_text_and_session_show_the_prediction():
    from moelab.run.session import Session

    p = plan(load_config("tiny"), gpu="h100")
    assert "speed (predicted)" in str(p) and "tokens/s/GPU" in str(p) and "speed (predicted)" in p._repr_html_()
    assert p.gpu_memory_gb == 80.0 and p.gpu_memory_source == "H100 SXM 80GB"
    assert any(a.startswith("speed on H100") for a in p.assumptions)
    assert plan(load_config("tiny")).speed is None and "speed" not in str(plan(load_config("tiny")))
    line = Session("tiny").plan(gpus=1, gpu="h200").speed.line()
    assert "tokens/s/GPU" in line and "MFU" in line and "GPU-hours per billion tokens" in line


def test_what_the_model_times_as_something_else_is_said():
    assert speed(PROXY).unmodelled == []
    windows = speed("gpt-oss-20b-proxy", **{"backend.attention": "eager"})
    assert any("eager attention" in u for u in windows.unmodelled)
    mla = plan(load_config("deepseek-v3-proxy"), gpu="h200")
    assert mla.speed.extrapolated and any(a.startswith("speed, extrapolated: MLA") for a in mla.assumptions)


def test_hiding_communication_bounds_the_step_from_above():
    one = speed(PROXY)  # one GPU: nothing to hide
    assert one.comm_hidden_tokens_per_s_per_gpu == pytest.approx(one.tokens_per_s_per_gpu)
    s = plan(load_config("deepseek-v3", FITS_256), gpus=256, gpu="h100").speed
    exposed = sum(s.parts_s[k] for k in COMM_PARTS)
    comm = exposed + sum(s.hidden_s.values())
    compute = sum(s.parts_s[k] for k in ("dense_matmul", "expert_matmul", "attention", "elementwise", "head_loss",
                                         "fp8_quant"))
    bound_step = s.step_s - exposed + max(0.0, comm - compute)
    assert s.comm_hidden_tokens_per_s_per_gpu == pytest.approx(s.tokens_per_s_per_gpu * s.step_s / bound_step)
    assert s.comm_hidden_tokens_per_s_per_gpu > s.tokens_per_s_per_gpu


def test_sonic_records_before_moelabs_tiles_are_planned_with_quacks_default_config():
    # the routed experts' GEMMs at the ratio of their day's tiles (rates.SONIC_MEASURED); nothing else moves
    from moelab.planner.rates import SONIC_MEASURED

    cfg = load_config(PROXY, {**BF16, "train.compile": True, "backend.experts": "sonic"})
    now, then = (plan(cfg, gpu="h200", sonic_tiles=t).speed for t in ("moelab", "quack"))
    ratio = SONIC_MEASURED["expert_matmul_ratio_quack_tiles"][0] / SONIC_MEASURED["expert_matmul_ratio"][0]
    assert then.parts_s["expert_matmul"] == pytest.approx(now.parts_s["expert_matmul"] * ratio, rel=1e-9)
    assert {k: v for k, v in then.parts_s.items() if k != "expert_matmul"} == pytest.approx(
        {k: v for k, v in now.parts_s.items() if k != "expert_matmul"})
    grouped = load_config(PROXY, {**BF16, "train.compile": True, "backend.experts": "grouped_mm"})
    assert plan(grouped, gpu="h200", sonic_tiles="quack").speed.parts_s == plan(grouped, gpu="h200").speed.parts_s
    assert planner_options({"date": "2026-12-06T07:00:00Z"})["sonic_tiles"] == "quack"
    assert "sonic_tiles" not in planner_options({"date": "2026-12-06T07:54:05Z"})  # issue 41 call 14
    with pytest.raises(ConfigError, match="sonic_tiles='auto'.*moelab, quack"):
        plan(cfg, sonic_tiles="auto")


def test_sonic_on_one_gpu_accumulates_only_the_gradients_outside_the_routed_experts():
    # SonicMoE's weight-gradient GEMMs add into the routed experts' .grad: the accumulation pass moves the rest;
    # with several ranks (a process group up) autograd accumulates all of it again
    from moelab.planner.flops import count_params

    gbs16 = {**BF16, "train.global_batch_size": 16, "train.compile": True}
    cfg = load_config(PROXY, gbs16)
    grouped, sonic = (speed(PROXY, **{**gbs16, "backend.experts": e}) for e in ("grouped_mm", "sonic"))
    experts = count_params(cfg.model).experts_total * 2  # bf16 gradients
    passes = cfg.train.global_batch_size // cfg.train.micro_batch_size - 1
    moved = 3 * passes * experts  # read the gradient and the new term, write the sum
    assert grouped.parts_s["grad_accumulate"] - sonic.parts_s["grad_accumulate"] == pytest.approx(
        moved / (H200_MEASURED["grad_accumulate_tb_s"][0] * 1e12), rel=1e-9)
    # records measured before af73383 (autograd added them) are planned as that code ran
    then = plan(load_config(PROXY, {**gbs16, "backend.experts": "sonic"}), gpu="h200", sonic_wgrad="autograd").speed
    assert then.parts_s["grad_accumulate"] == pytest.approx(grouped.parts_s["grad_accumulate"])
    assert planner_options({"date": "2026-12-06T00:36:39Z"})["sonic_wgrad"] == "autograd"
    assert "sonic_wgrad" not in planner_options({"date": "2026-12-06T04:00:00Z"})
    with pytest.raises(ConfigError, match="sonic_wgrad='cuda'.*gemm, autograd"):
        plan(cfg, sonic_wgrad="cuda")
    two = {**gbs16, "parallel.pp": 2}
    grouped, sonic = (speed(PROXY, gpus=2, **{**two, "backend.experts": e}) for e in ("grouped_mm", "sonic"))
    assert sonic.parts_s["grad_accumulate"] == pytest.approx(grouped.parts_s["grad_accumulate"])


def test_one_gpu_accumulates_neither_the_embedding_nor_the_full_loss_head():
    # moelab.backends.into_grad: their backward adds a later micro batch's gradient into .grad; the chunked loss's
    # head and a tied weight under it still go through autograd; a record before cba26db is planned as that code ran
    gbs16 = {**BF16, "train.global_batch_size": 16, "train.compile": True}
    cfg = load_config(PROXY, {**gbs16, "backend.loss": "full"})
    V, D = cfg.model.vocab_size, cfg.model.hidden_size
    passes, rate = 16 // cfg.train.micro_batch_size - 1, H200_MEASURED["grad_accumulate_tb_s"][0] * 1e12

    def accumulate(loss="full", tied=False, **kw):
        c = load_config(PROXY, {**gbs16, "backend.loss": loss, "model.tie_embeddings": tied})
        return plan(c, gpu="h200", **kw).speed.parts_s["grad_accumulate"]
    for loss, tied, weights in (("full", False, 2), ("chunked", False, 1), ("full", True, 1), ("chunked", True, 0)):
        moved = 3 * passes * weights * V * D * 2  # bf16: read the gradient and the new term, write the sum
        assert accumulate(loss, tied, into_grad="autograd") - accumulate(loss, tied) == pytest.approx(
            moved / rate, rel=1e-9), (loss, tied)
    assert planner_options({"date": "2026-12-06T10:00:00Z"})["into_grad"] == "autograd"
    assert "into_grad" not in planner_options({"date": "2026-12-06T11:05:00Z"})  # issue 41 call 21
    with pytest.raises(ConfigError, match="into_grad='yes'.*moelab, autograd"):
        plan(cfg, into_grad="yes")
    two = load_config(PROXY, {**gbs16, "backend.loss": "full", "parallel.pp": 2})
    assert plan(two, gpus=2, gpu="h200").speed.parts_s["grad_accumulate"] == pytest.approx(
        plan(two, gpus=2, gpu="h200", into_grad="autograd").speed.parts_s["grad_accumulate"])


def test_the_experts_gradient_norm_in_their_gemms_saves_its_share_of_the_norms_pass():
    # one GPU, one micro batch, SonicMoE: the norm's pass no longer reads the experts' gradients (their GEMMs sum the
    # squares at NORM_EPILOGUE of that pass's time); with more micro batches, another experts backend or the norm
    # of before 3187545 nothing moves; records before d255f7c, or timed with the pass, are planned with it
    from moelab.planner.rates import GRAD_NORM_MEASURED, NORM_EPILOGUE

    one = load_config(PROXY, {**BF16, "train.compile": True, "backend.experts": "sonic",
                              "train.global_batch_size": 2, "train.micro_batch_size": 2})
    for gpu in ("h100", "h200"):
        now, then = (plan(one, gpu=gpu, expert_norm=n).speed.parts_s for n in ("gemm", "pass"))
        saved = (1 - NORM_EPILOGUE[0]) * count_params(one.model).experts_total * 2 / (GRAD_NORM_MEASURED[gpu][0] * 1e12)
        assert then["optimizer"] - now["optimizer"] == pytest.approx(saved, rel=1e-9)
        assert {k: v for k, v in then.items() if k != "optimizer"} == pytest.approx(
            {k: v for k, v in now.items() if k != "optimizer"})
    for other in ({"train.global_batch_size": 16}, {"backend.experts": "grouped_mm"}):
        cfg = one.replace(**other)
        assert plan(cfg, gpu="h100").speed.parts_s == plan(cfg, gpu="h100", expert_norm="pass").speed.parts_s
    assert (plan(one, gpu="h100", grad_norm="torch").speed.parts_s
            == plan(one, gpu="h100", grad_norm="torch", expert_norm="pass").speed.parts_s)
    assert planner_options({"date": "2026-12-06T17:20:00Z"})["expert_norm"] == "pass"  # issue 41 call 26
    assert "expert_norm" not in planner_options({"date": "2026-12-06T17:53:00Z"})  # call 28's default
    assert planner_options({"date": "2026-12-07T16:00:00Z", "norm_in_gemms": False}) == {"expert_norm": "pass"}
    with pytest.raises(ConfigError, match="expert_norm='fast'.*gemm, pass"):
        plan(one, gpu="h100", expert_norm="fast")


def test_clipping_multiply_is_a_pass_over_the_gradients_unless_the_triton_adamw_takes_it():
    # train.grad_clip > 0: the Triton AdamW before fb2903b (or timed with the pass) read and wrote every gradient once
    # more at torch's slow pass's measured rate; today's Triton AdamW multiplies inside its update, and beside torch's
    # AdamW the pass runs at the fast foreach rate (grad_norm.scale_grads)
    from moelab.planner.rates import rates

    cfg = load_config(PROXY, {**BF16, "train.compile": True, "train.global_batch_size": 2,
                              "train.micro_batch_size": 2, "train.grad_clip": 1.0})
    for gpu in ("h100", "h200"):
        now, then = (plan(cfg, gpu=gpu, clip_multiply=c) for c in ("update", "pass"))
        grads = now.memory["gradients"]
        extra = then.speed.parts_s["optimizer"] - now.speed.parts_s["optimizer"]
        assert extra == pytest.approx(2 * grads / rates(gpu_kind(gpu), False).clip_pass, rel=1e-9)
        unclipped = plan(cfg.replace(**{"train.grad_clip": 0.0}), gpu=gpu)
        assert unclipped.speed.parts_s == pytest.approx(now.speed.parts_s)
        assert plan(cfg.replace(**{"train.grad_clip": 0.0}), gpu=gpu, clip_multiply="pass").speed.parts_s == (
            pytest.approx(now.speed.parts_s))  # nothing to multiply without clipping
        torch_adamw = cfg.replace(**{"train.optimizer": "adamw"})
        unclipped_torch = plan(torch_adamw.replace(**{"train.grad_clip": 0.0}), gpu=gpu).speed.parts_s["optimizer"]
        r = rates(gpu_kind(gpu), False)
        for c, rate in (("update", r.clip_foreach), ("pass", r.clip_pass)):
            assert (plan(torch_adamw, gpu=gpu, clip_multiply=c).speed.parts_s["optimizer"] - unclipped_torch
                    == pytest.approx(2 * grads / rate, rel=1e-9))
        assert r.clip_foreach > 2 * r.clip_pass
    assert planner_options({"date": "2026-12-07T10:26:33Z"})["clip_multiply"] == "pass"  # issue 41 call 38
    assert "clip_multiply" not in planner_options({"date": "2026-12-07T16:00:00Z"})
    with pytest.raises(ConfigError, match="clip_multiply='fused'.*update, pass"):
        plan(cfg, gpu="h100", clip_multiply="fused")


def test_the_full_loss_kernel_is_planned_at_its_measured_rate_and_holds_one_buffer_of_logits():
    # backend.loss=full: the in-place kernel's three passes over the bf16 logits at LOSS_KERNEL_MEASURED's rate and
    # one [T, V] buffer (the gradient written over the logits); records before 56f5afa, or timed with the compiled
    # loss beside it, are planned with that loss and its two buffers; tensor parallelism keeps the sharded loss
    from moelab.planner.rates import LOSS_KERNEL_MEASURED

    cfg = load_config(PROXY, {**BF16, "train.compile": True, "backend.loss": "full", "train.global_batch_size": 2,
                              "train.micro_batch_size": 2})
    T, V = 2 * cfg.train.seq_len, cfg.model.vocab_size
    for gpu in ("h100", "h200"):
        now, then = plan(cfg, gpu=gpu), plan(cfg, gpu=gpu, full_loss="compiled")
        head = now.speed.parts_s["head_loss"] - 3 * 2 * T * V / (_measured(LOSS_KERNEL_MEASURED, gpu) * 1e12)
        assert head == pytest.approx(then.speed.parts_s["head_loss"] - T * V * _loss_full_s(gpu), rel=1e-9)
        assert then.memory["logits"] - now.memory["logits"] == T * V * 2
        assert (now.full_loss, then.full_loss, now.loss) == ("kernel", "compiled", "full")
    chunked = cfg.replace(**{"backend.loss": "chunked"})
    assert plan(chunked, gpu="h100").speed.parts_s == plan(chunked, gpu="h100", full_loss="compiled").speed.parts_s
    assert planner_options({"date": "2026-12-06T17:53:00Z"})["full_loss"] == "compiled"  # issue 41 call 28
    assert "full_loss" not in planner_options({"date": "2026-12-06T21:10:00Z"})
    with pytest.raises(ConfigError, match="full_loss='fast'.*kernel, compiled"):
        plan(cfg, gpu="h100", full_loss="fast")


def _measured(table: dict, gpu: str) -> float:
    """TB/s of a per-kind measured table on `gpu` (rates._measured_tb_s: measured there, else carried by HBM)."""
    from moelab.planner.gpus import GPU_KINDS

    if gpu in table:
        return table[gpu][0]
    first = "h200" if "h200" in table else next(iter(table))
    return table[first][0] * GPU_KINDS[gpu].hbm_tb_s / GPU_KINDS[first].hbm_tb_s


def _loss_full_s(gpu: str) -> float:
    from moelab.planner.gpus import GPU_KINDS
    from moelab.planner.rates import H200_MEASURED

    return H200_MEASURED["loss_full_s"][0] * GPU_KINDS["h200"].hbm_tb_s / GPU_KINDS[gpu].hbm_tb_s


def test_records_before_the_triton_norm_are_planned_with_torchs():
    # the Triton AdamW's step with the gradient norm of its day: torch's foreach norm before 3187545 (the H200
    # profile of that code, HBM-scaled), moelab.backends.grad_norm since (measured on each kind); nothing else moves
    from moelab.planner.rates import H200_MEASURED as H

    cfg = load_config(PROXY, {**BF16, "train.compile": True, "train.optimizer": "adamw_triton"})
    for gpu in ("h100", "h200"):
        now, then = (plan(cfg, gpu=gpu, grad_norm=n).speed for n in ("triton", "torch"))
        hbm = GPU_KINDS[gpu].hbm_tb_s / GPU_KINDS["h200"].hbm_tb_s
        mem = plan(cfg, gpu=gpu).memory
        assert then.parts_s["optimizer"] == pytest.approx(
            2 * (2 * mem["gradients"] + mem["optimizer"]) / (H["adamw_triton_tb_s"][0] * 1e12 * hbm), rel=1e-9)
        assert now.parts_s["optimizer"] == pytest.approx(optimizer_s(gpu, cfg), rel=1e-9)
        assert {k: v for k, v in then.parts_s.items() if k != "optimizer"} == pytest.approx(
            {k: v for k, v in now.parts_s.items() if k != "optimizer"})
    torch_adamw = load_config(PROXY, {**BF16, "train.optimizer": "adamw"})
    assert plan(torch_adamw, gpu="h200", grad_norm="torch").speed.parts_s == plan(torch_adamw, gpu="h200").speed.parts_s
    assert planner_options({"date": "2026-12-06T07:54:05Z"})["grad_norm"] == "torch"  # issue 41 call 14
    assert "grad_norm" not in planner_options({"date": "2026-12-06T08:10:00Z"})
    with pytest.raises(ConfigError, match="grad_norm='fast'.*triton, torch"):
        plan(cfg, grad_norm="fast")
