"""The step-time model (moelab.planner.speed): its parts add up to the step and to the figures it reports, each
term moves the way its cause says, its kernel rates are the ones the H200 records hold, and it shows in the plan
and on the command line. No test asserts a speed as a target."""
import json
from pathlib import Path

import pytest

from moelab.cli import main
from moelab.config import ConfigError, load_config
from moelab.planner.flops import attention_flops_per_token
from moelab.planner.gpus import GPU_KINDS, gpu_kind
from moelab.planner.plan import plan
from moelab.planner.speed import EAGER_FACTOR, H200_MEASURED, layer_flops

ROOT = Path(__file__).resolve().parents[2]
PROXY = "qwen3-moe-30b-a3b-proxy"


def speed(name, gpus=None, gpu="h200", **over):
    return plan(load_config(name, over), gpus=gpus, gpu=gpu).speed


def test_the_parts_add_up_to_the_step_and_its_figures():
    p = plan(load_config("deepseek-v3"), gpus=256, gpu="h100")
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


def test_doubling_the_tokens_doubles_the_matmuls_and_leaves_the_optimizer():
    one = speed(PROXY, **{"train.micro_batch_size": 2, "train.global_batch_size": 2})
    two = speed(PROXY, **{"train.micro_batch_size": 4, "train.global_batch_size": 4})
    for term in ("dense_matmul", "expert_matmul", "attention", "elementwise"):
        assert two.parts_s[term] == pytest.approx(2 * one.parts_s[term]), term
    assert two.parts_s["optimizer"] == pytest.approx(one.parts_s["optimizer"])
    assert two.tokens_per_s_per_gpu > one.tokens_per_s_per_gpu  # the optimizer is amortised over more tokens


def test_the_matmul_terms_follow_the_flops_count():
    s = speed(PROXY, **{"train.compile": True})
    cfg = load_config(PROXY)
    fl, T = layer_flops(cfg.model), 2 * 4096
    assert s.parts_s["expert_matmul"] == pytest.approx(T * 8 * fl["moe_experts"] / (H200_MEASURED["grouped_tflops"][0] * 1e12))
    assert s.parts_s["attention"] == pytest.approx(
        T * attention_flops_per_token(cfg.model, 4096) / (H200_MEASURED["attention_tflops"][0] * 1e12))
    # the pieces are the planner's count: 8 MoE blocks + the LM head = 6 x activated parameters
    assert 8 * (fl["moe_dense"] + fl["moe_experts"]) + fl["head"] == pytest.approx(
        plan(cfg).flops_per_token - attention_flops_per_token(cfg.model, 4096))


def test_ep_across_nodes_raises_the_all_to_all():
    base = {"parallel.fsdp": 16, "train.global_batch_size": 64, "train.micro_batch_size": 4}
    in_node = speed("qwen3-moe-30b-a3b", gpus=16, gpu="h100", **base, **{"parallel.ep": 8})
    across = speed("qwen3-moe-30b-a3b", gpus=16, gpu="h100", **base, **{"parallel.ep": 16})
    assert across.parts_s["all_to_all"] > 1.5 * in_node.parts_s["all_to_all"]
    assert any("47% of its all-to-all partners on the same node" in a for a in across.assumptions)  # 7 of 15


def test_fsdp_across_nodes_is_slower_than_within_one():
    within = speed("gpt-oss-20b", gpus=8, gpu="h100", **{"parallel.fsdp": 8, "train.global_batch_size": 64})
    across = speed("gpt-oss-20b", gpus=16, gpu="h100", **{"parallel.fsdp": 16, "train.global_batch_size": 128})
    assert across.parts_s["fsdp"] > within.parts_s["fsdp"]


def test_h100_against_h200_scales_memory_bound_terms_by_hbm_only():
    h100, h200 = speed(PROXY, gpu="h100"), speed(PROXY, gpu="h200")
    ratio = GPU_KINDS["h200"].hbm_tb_s / GPU_KINDS["h100"].hbm_tb_s
    assert h100.parts_s["optimizer"] == pytest.approx(ratio * h200.parts_s["optimizer"])
    assert h100.parts_s["elementwise"] == pytest.approx(ratio * h200.parts_s["elementwise"])
    assert h100.parts_s["dense_matmul"] == pytest.approx(h200.parts_s["dense_matmul"])  # the same BF16 peak
    assert h100.gpu == "H100 SXM 80GB" and h100.tokens_per_s_per_gpu < h200.tokens_per_s_per_gpu


def test_compile_and_overlap_change_only_their_terms():
    eager, compiled = speed(PROXY), speed(PROXY, **{"train.compile": True})
    assert eager.parts_s["elementwise"] == pytest.approx(EAGER_FACTOR * compiled.parts_s["elementwise"])
    assert eager.parts_s["dense_matmul"] == compiled.parts_s["dense_matmul"]
    over = {"parallel.ep": 2, "parallel.fsdp": 2, "train.global_batch_size": 4}
    plain = speed(PROXY, gpus=2, **over)
    hidden = speed(PROXY, gpus=2, **over, **{"parallel.ep_overlap": True})
    assert plain.parts_s["all_to_all"] / 2 <= hidden.parts_s["all_to_all"] < plain.parts_s["all_to_all"]


def test_pipeline_bubble_is_the_plans_fraction_of_the_step():
    p = plan(load_config(PROXY, {"parallel.pp": 2, "train.global_batch_size": 8}), gpus=2, gpu="h200")
    s, f = p.speed, p.pipeline["bubble_fraction"]
    busy = s.step_s - s.parts_s["bubble"] - s.parts_s["fsdp"] - s.parts_s["optimizer"] - s.parts_s["casts"]
    assert s.parts_s["bubble"] == pytest.approx(busy * f / (1 - f))


def test_the_rates_are_the_h200_records():
    """Re-derive the profile-based rates from the compiled profile record: they are measurements, not fits."""
    prof = json.loads((ROOT / "gallery/results/qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-compile-gbs2.json")
                      .read_text())
    cfg = load_config(PROXY)
    fl, T = layer_flops(cfg.model), 8192
    kernels = [k for k in prof["top_kernels"] if k["category"] == "matmul"]
    grouped_ms = sum(k["ms"] for k in kernels if "GroupProblemShape" in k["name"])
    dense_ms = sum(k["ms"] for k in kernels if "GroupProblemShape" not in k["name"])
    rate = lambda flop, ms: flop / (ms * 1e-3) / 1e12  # noqa: E731
    assert rate(T * 8 * fl["moe_experts"], grouped_ms) == pytest.approx(H200_MEASURED["grouped_tflops"][0], rel=2e-3)
    assert rate(T * (8 * fl["moe_dense"] + fl["head"]), dense_ms) == pytest.approx(
        H200_MEASURED["dense_tflops"][0], rel=2e-3)
    assert rate(T * attention_flops_per_token(cfg.model, 4096), prof["by_category_ms"]["attention"]) == \
        pytest.approx(H200_MEASURED["attention_tflops"][0], rel=2e-3)
    params = plan(cfg).total_params
    assert 16 * params / (prof["by_category_ms"]["optimizer"] * 1e-3) / 1e12 == pytest.approx(
        H200_MEASURED["optimizer_tb_s"][0], rel=2e-3)
    assert H200_MEASURED["idle_s_per_layer"][0] == pytest.approx(prof["idle_ms"] * 1e-3 / 8, rel=1e-3)
    kernels = json.loads((ROOT / "gallery/results/backends-experts-kernels.json").read_text())["kernels"]["grouped_mm"]
    assert H200_MEASURED["grouped_balanced_gain"][0] == pytest.approx(
        kernels["balanced"]["tflops"] / kernels["skewed_dirichlet2"]["tflops"], rel=1e-3)


def test_gpu_kinds_carry_their_sources_and_refuse_unknown_names():
    for kind in GPU_KINDS.values():
        assert set(kind.sources) >= {"bf16_tflops", "fp8_tflops", "hbm_tb_s", "nvlink_gb_s", "ib_gb_s", "memory_gb"}
        assert all("http" in src for src in kind.sources.values())
    assert gpu_kind("NVIDIA H200").memory_gb == 141.0
    with pytest.raises(ConfigError, match=r"gpu='a100': unknown GPU kind; choose one of \['h100', 'h200'\]"):
        plan(load_config("tiny"), gpu="a100")


def test_plan_text_json_and_cli_show_the_prediction(capsys):
    p = plan(load_config("tiny"), gpu="h100")
    assert "speed (predicted)" in str(p) and "tokens/s/GPU" in str(p)
    assert p.gpu_memory_gb == 80.0 and p.gpu_memory_source == "H100 SXM 80GB"
    assert any(a.startswith("speed on H100") for a in p.assumptions)
    assert plan(load_config("tiny")).speed is None and "speed" not in str(plan(load_config("tiny")))
    assert main(["plan", "deepseek-v3", "--gpus", "256", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    line = [x for x in out.splitlines() if x.startswith("speed (predicted)")]
    assert line and "tokens/s/GPU" in line[0] and "on 256 x H100 SXM 80GB" in line[0]
    assert "all-to-all" in [x for x in out.splitlines() if "step parts" in x][0]
    assert main(["plan", "tiny", "--gpu", "h200", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["speed"]["tokens_per_s_per_gpu"] > 0 and set(d["speed"]["parts_s"]) >= {"optimizer", "attention"}


def test_fsdp_syncs_every_micro_batch_but_once_per_step_under_pp():
    """FSDP2 reduce-scatters every micro batch; torch.distributed.pipelining's stages keep their blocks gathered
    and sync gradients after the last micro batch only."""
    flat = [speed(PROXY, gpus=2, **{"parallel.fsdp": 2, "train.global_batch_size": g}) for g in (4, 8)]
    assert flat[1].parts_s["fsdp"] == pytest.approx(2 * flat[0].parts_s["fsdp"])
    piped = [speed(PROXY, gpus=4, **{"parallel.pp": 2, "parallel.fsdp": 2, "train.global_batch_size": g})
             for g in (8, 16)]
    assert piped[1].parts_s["fsdp"] == pytest.approx(piped[0].parts_s["fsdp"]) and piped[0].parts_s["fsdp"] > 0


def test_what_the_model_times_as_something_else_is_said():
    assert speed(PROXY).unmodelled == []
    fp8 = speed(PROXY, **{"train.fp8": "rowwise"})
    assert fp8.unmodelled and "train.fp8=rowwise" in fp8.unmodelled[0]
    assert any("not modelled: train.fp8=rowwise" in a for a in fp8.assumptions)
    windows = speed("gpt-oss-20b-proxy", **{"backend.attention": "eager"})
    assert any("eager attention" in u for u in windows.unmodelled)


def test_hiding_communication_bounds_the_step_from_above():
    one = speed(PROXY)  # one GPU: nothing to hide
    assert one.comm_hidden_tokens_per_s_per_gpu == pytest.approx(one.tokens_per_s_per_gpu)
    s = plan(load_config("deepseek-v3"), gpus=256, gpu="h100").speed
    comm = sum(s.parts_s[k] for k in ("all_to_all", "cp", "pipeline_send", "fsdp"))
    compute = sum(s.parts_s[k] for k in ("dense_matmul", "expert_matmul", "attention", "elementwise"))
    hidden_step = s.step_s - comm + max(0.0, comm - compute)
    assert s.comm_hidden_tokens_per_s_per_gpu == pytest.approx(s.tokens_per_s_per_gpu * s.step_s / hidden_step)
    assert s.comm_hidden_tokens_per_s_per_gpu > s.tokens_per_s_per_gpu
