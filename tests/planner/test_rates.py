"""The step-time model's kernel rates (moelab.planner.rates.H200_MEASURED) are the H200 records: each one derived
again here from its file in gallery/results/, so a figure typed by hand that drifts from its record fails."""
import json
from pathlib import Path

import pytest

from moelab.config import load_config
from moelab.planner.flops import attention_flops_per_token, count_params
from moelab.planner.gpus import GPU_KINDS
from moelab.planner.rates import H200_MEASURED, rates
from moelab.planner.speed import layer_flops

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "gallery/results"
T = 8192  # tokens per micro batch of the profiles (micro batch 2 x seq 4096)


def record(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def kernels_ms(prof: dict, keep) -> float:
    return sum(k["ms"] for k in prof["top_kernels"] if keep(k["name"], k["category"]))


def rate(flop: float, ms: float) -> float:
    return flop / (ms * 1e-3) / 1e12


@pytest.fixture(scope="module")
def proxy():
    cfg = load_config("qwen3-moe-30b-a3b-proxy")
    return cfg.model, layer_flops(cfg.model)


def test_every_figure_names_a_record_that_exists():
    for key, (value, source) in H200_MEASURED.items():
        assert value > 0, key
        named = [w for w in source.replace(",", " ").split() if w.startswith("gallery/results/")]
        assert all((ROOT / w.rstrip(":)")).exists() for w in named), (key, source)


def test_bf16_rates_are_the_compiled_profile(proxy):
    mdl, fl = proxy
    prof = record("qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-compile-gbs2-f7ecd22.json")
    matmul = lambda name, cat: cat == "matmul"  # noqa: E731
    grouped_ms = kernels_ms(prof, lambda n, c: matmul(n, c) and "GroupProblemShape" in n)
    dense_ms = kernels_ms(prof, lambda n, c: matmul(n, c) and "GroupProblemShape" not in n)
    assert rate(T * 8 * fl["moe_experts"], grouped_ms) == pytest.approx(H200_MEASURED["grouped_tflops"][0], rel=2e-3)
    assert rate(T * (8 * fl["moe_dense"] + fl["head"]), dense_ms) == pytest.approx(
        H200_MEASURED["dense_tflops"][0], rel=2e-3)
    assert rate(T * attention_flops_per_token(mdl, 4096), prof["by_category_ms"]["attention"]) == pytest.approx(
        H200_MEASURED["attention_tflops"][0], rel=2e-3)
    params = count_params(mdl).total
    assert 16 * params / (prof["by_category_ms"]["optimizer"] * 1e-3) / 1e12 == pytest.approx(
        H200_MEASURED["adamw_tb_s"][0], rel=2e-3)
    # idle: a part per step and a part per layer and micro batch, from this profile (1 micro batch) and the same
    # step with 8 (global batch 16)
    eight = record("qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-compile-gbs16.json")
    per_step, per_layer = H200_MEASURED["idle_s_per_step"][0], H200_MEASURED["idle_s_per_layer"][0]
    assert per_step + 8 * per_layer == pytest.approx(prof["idle_ms"] * 1e-3, rel=1e-3)
    assert per_step + 8 * 8 * per_layer == pytest.approx(eight["idle_ms"] * 1e-3, rel=1e-3)
    # gradient accumulation: the vectorized add kernel the 8-micro-batch step adds, 7 times 3 x 2 B per parameter
    add = lambda r: kernels_ms(r, lambda n, c: n.startswith("void at::native::vectorized_elementwise_kernel<8, "  # noqa
                                                           "at::native::CUDAFunc"))
    params = count_params(mdl).total
    assert add(prof) == 0 < add(eight)
    assert 3 * 2 * params * 7 / (add(eight) * 1e-3) / 1e12 == pytest.approx(
        H200_MEASURED["grad_accumulate_tb_s"][0], rel=5e-3)
    loss_ms = kernels_ms(prof, lambda n, c: "log_softmax" in n)
    assert H200_MEASURED["loss_full_s"][0] * T * mdl.vocab_size == pytest.approx(loss_ms * 1e-3, rel=1e-3)
    cats = prof["by_category_ms"]
    assert H200_MEASURED["elementwise_s"][0] * T * mdl.hidden_size * 8 == pytest.approx(
        (cats["elementwise"] - loss_ms + cats["other"]) * 1e-3, rel=1e-3)
    kernels = record("backends-experts-kernels.json")["kernels"]["grouped_mm"]
    assert H200_MEASURED["grouped_balanced_gain"][0] == pytest.approx(
        kernels["balanced"]["tflops"] / kernels["skewed_dirichlet2"]["tflops"], rel=1e-3)


def test_the_chunked_loss_and_the_triton_adamw_are_the_second_profile(proxy):
    """The chunked loss's kernels and the slower head GEMMs: the categories' growth from the full-loss profile to
    the chunked-loss profile (the full loss's own kernels taken out); the Triton AdamW: its optimizer category."""
    mdl, fl = proxy
    full = record("qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-compile-gbs2-f7ecd22.json")
    chunked = record("qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-compile-gbs2-default-5ad9062.json")
    assert (chunked["loss"].split()[0], chunked["optimizer"]) == ("chunked", "TritonAdamW")
    a, b = full["by_category_ms"], chunked["by_category_ms"]
    full_loss = kernels_ms(full, lambda n, c: "log_softmax" in n)
    grown = (b["elementwise"] - (a["elementwise"] - full_loss)) + (b["permute"] - a["permute"])
    assert H200_MEASURED["loss_chunked_s"][0] * T * mdl.vocab_size == pytest.approx(grown * 1e-3, rel=1e-3)
    head_s = T * fl["head"] / (H200_MEASURED["dense_tflops"][0] * 1e12)
    assert H200_MEASURED["chunked_head_factor"][0] == pytest.approx(
        1 + (b["matmul"] - a["matmul"]) * 1e-3 / head_s, rel=1e-3)
    params = count_params(mdl).total  # the Triton AdamW with torch's gradient norm (the code before 3187545)
    assert 16 * params / (b["optimizer"] * 1e-3) / 1e12 == pytest.approx(H200_MEASURED["adamw_triton_tb_s"][0],
                                                                       rel=2e-3)


def test_the_triton_adamw_and_norm_are_each_kinds_profile(proxy):
    """TritonAdamW's kernel and the Triton gradient norm's pass, each from its kernel in one-micro-batch profiles: on
    the H200 both from issue 41 call 17; on the H100 AdamW from call 31 (today's blocks) and the norm from call 21
    (its last profile with the norm over every gradient); another kind carries the H200's by the HBM ratio."""
    from moelab.planner.gpus import GPUKind
    from moelab.planner.rates import ADAMW_MEASURED, GRAD_NORM_MEASURED

    mdl, _ = proxy
    params = count_params(mdl).total
    for kind, table, name, kernel, nbytes in (
            ("h200", ADAMW_MEASURED, "h200-issue41-call17", "adamw_kernel", 14),
            ("h100", ADAMW_MEASURED, "h100-issue41-call31", "adamw_kernel", 14),
            ("h200", GRAD_NORM_MEASURED, "h200-issue41-call17", "sumsq_kernel", 2),
            ("h100", GRAD_NORM_MEASURED, "h100-issue41-call21", "sumsq_kernel", 2)):
        prof = record(f"qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-compile-gbs2-{name}.json")
        assert (prof["optimizer"], prof["global_batch_size"]) == ("TritonAdamW", 2)
        assert prof["gpu_name"].startswith({"h200": "NVIDIA H200", "h100": "NVIDIA H100"}[kind])
        ms = kernels_ms(prof, lambda n, c: n == kernel)
        assert table[kind][0] == pytest.approx(nbytes * params / (ms * 1e-3) / 1e12, rel=2e-3), (kind, kernel)
        assert name in table[kind][1]
    for kind in ("h100", "h200"):
        r = rates(GPU_KINDS[kind], balanced=False)
        assert (r.optimizer["adamw_triton"], r.grad_norm) == (ADAMW_MEASURED[kind][0] * 1e12,
                                                              GRAD_NORM_MEASURED[kind][0] * 1e12)
    other = GPUKind("half an H200", memory_gb=80, bf16_tflops=989.5, fp8_tflops=1979, hbm_tb_s=2.4, nvlink_gb_s=450,
                    ib_gb_s=50, gpus_per_node=8, sources={})
    assert rates(other, balanced=False).optimizer["adamw_triton"] == pytest.approx(
        ADAMW_MEASURED["h200"][0] * 1e12 / 2)


def test_the_full_loss_kernel_is_its_checks_default_on_the_h100_and_carried_by_hbm_elsewhere():
    """backend.loss=full's in-place kernel: two reads of the bf16 logits and one write, at the time issue 41 call
    29's check measured for the kernel's default block and warps; the H200 carries it by the HBM ratio."""
    from moelab.backends import loss_kernel
    from moelab.planner.rates import LOSS_KERNEL_MEASURED

    check = record("qwen3-moe-30b-a3b-proxy--moelab--loss-kernel-check-h100-issue41-call29.json")
    assert check["ok"] and check["gpu_name"] == "NVIDIA H100 80GB HBM3"
    assert check["default_block_and_warps"] == f"{loss_kernel.BLOCK}x{loss_kernel.WARPS}"  # still today's kernel
    ms = check["ms_loss_kernel_by_block_and_warps"][check["default_block_and_warps"]]
    T, V = check["shape"]["T"], check["shape"]["V"]
    assert LOSS_KERNEL_MEASURED["h100"][0] == pytest.approx(3 * 2 * T * V / (ms * 1e-3) / 1e12, rel=1e-4)
    assert rates(GPU_KINDS["h200"], balanced=False).loss_kernel == pytest.approx(
        LOSS_KERNEL_MEASURED["h100"][0] * 1e12 * GPU_KINDS["h200"].hbm_tb_s / GPU_KINDS["h100"].hbm_tb_s)


def test_clipping_passes_are_the_clip_checks_on_the_h100():
    """Clipping's multiply as a pass: torch's (fp32 factor, slow path: call 41) and grad_norm.scale_grads' (the factor
    in the gradients' dtype: call 43), each gradient read and written, on the checks' expert weight; both checks
    found the values bitwise as torch's."""
    from moelab.planner.rates import CLIP_FOREACH_MEASURED, CLIP_PASS_MEASURED

    for table, name, key in ((CLIP_PASS_MEASURED, "call41", "multiply_pass_ms"),
                             (CLIP_FOREACH_MEASURED, "call43", "scale_grads_ms")):
        check = record(f"qwen3-moe-30b-a3b-proxy--moelab--clip-check-h100-issue41-{name}.json")
        assert check["ok"] and check["gpu_name"] == "NVIDIA H100 80GB HBM3"
        t = check["timing"]
        assert table["h100"][0] == pytest.approx(2 * 2 * t["elements"] / (t[key] * 1e-3) / 1e12, rel=1e-4)
    assert record("qwen3-moe-30b-a3b-proxy--moelab--clip-check-h100-issue41-call43.json")["scale_grads_equal"] == {
        "bfloat16": True, "float16": True, "float32": True}


def test_fp8_rates_are_the_fp8_profile_and_kernel_check(proxy):
    mdl, fl = proxy
    prof = record("qwen3-moe-30b-a3b-proxy--moelab--profile-fp8-rowwise-compile-gbs2-5fe5a16.json")
    check = record("qwen3-moe-30b-a3b-proxy--moelab--fp8-kernel-check-5fe5a16.json")
    assert prof["fp8"] == "rowwise" and check["shapes"]["tokens"] == T
    grouped_ms = kernels_ms(prof, lambda n, c: c == "matmul" and "GroupProblemShape" in n)
    assert rate(T * 8 * fl["moe_experts"], grouped_ms) == pytest.approx(H200_MEASURED["grouped_fp8_tflops"][0],
                                                                          rel=2e-3)
    router = 6 * mdl.hidden_size * mdl.moe.num_experts
    proj = T * 8 * (fl["moe_dense"] - router)  # the FP8 projections: attention q/k/v/o (no shared experts)
    assert rate(proj, kernels_ms(prof, lambda n, c: "qqtst" in n)) == pytest.approx(
        H200_MEASURED["dense_fp8_tflops"][0], rel=2e-3)
    times = check["fwd_bwd_ms"]
    gate_up = mdl.moe.num_experts * mdl.hidden_size * 2 * mdl.moe.expert_ffn_size
    weight_s = times["quantise one gate_up weight [E, D, 2F] (compiled), forward only"] * 1e-3 / gate_up
    assert H200_MEASURED["fp8_weight_quant_s"][0] == pytest.approx(weight_s, rel=1e-3)
    quant = lambda which: kernels_ms(prof, lambda n, c: n.startswith("triton") and which in n and "exp2" in n)  # noqa
    weights = 2 * 8 * count_params(load_config("qwen3-moe-30b-a3b-proxy").model).experts_total // 8 * weight_s
    per_row = (quant("_scaled_grouped_mm") * 1e-3 - weights) / (T * mdl.moe.top_k * mdl.hidden_size * 8)
    assert H200_MEASURED["fp8_expert_quant_s"][0] == pytest.approx(per_row, rel=2e-3)
    assert H200_MEASURED["fp8_dense_quant_s"][0] * T * mdl.hidden_size * 8 == pytest.approx(
        quant("_scaled_mm_") * 1e-3, rel=2e-3)
    assert H200_MEASURED["fp8_head_factor"][0] == pytest.approx(
        times["lm_head fp8 compiled"] / times["lm_head bf16 compiled"], rel=1e-6)


def test_rates_move_with_the_datasheet_ratios():
    h100, h200 = (rates(GPU_KINDS[k], balanced=False) for k in ("h100", "h200"))
    hbm = GPU_KINDS["h200"].hbm_tb_s / GPU_KINDS["h100"].hbm_tb_s
    assert h100.dense == h200.dense and h100.grouped_fp8 == h200.grouped_fp8  # the same BF16 and FP8 peaks
    assert h100.mem == pytest.approx(hbm * h200.mem) and h100.copy == pytest.approx(h200.copy / hbm)
    assert h100.optimizer["adamw_triton"] > h100.optimizer["adamw"]
    assert rates(GPU_KINDS["h200"], balanced=True).grouped > h200.grouped


def test_the_fsdp_copy_rate_is_the_cp2_profiles_chunk_cat():
    """The reduce-scatter copy-in (chunk_cat) of the CP=2 profile: every parameter's bf16 gradient read and its
    fp32 copy written (6 B per element) on the 2-rank mesh, one micro batch."""
    from moelab.planner.plan import plan

    text = (RESULTS / "logs/qwen3-moe-30b-a3b-proxy--moelab--profile-cp2-seq8192-eager.txt").read_text()
    assert "parallel.cp=2" in text.splitlines()[0] and "train.param_dtype=bfloat16" in text.splitlines()[0]
    row = [x for x in text.splitlines() if x.startswith("void at::native::detail::chunk_cat_cuda_kernel")][0]
    ms = float([c for c in row.split() if c.endswith("ms")][0].removesuffix("ms"))
    p = plan(load_config("qwen3-moe-30b-a3b-proxy", {"train.dtype": "bfloat16", "train.param_dtype": "bfloat16",
                                                     "parallel.cp": 2, "train.seq_len": 8192,
                                                     "train.global_batch_size": 2}), gpus=2)
    assert p.micro_batches_per_step == 1
    assert p.comm["fsdp_reduce_copied_bytes_per_step"] / (ms * 1e-3) / 1e12 == pytest.approx(
        H200_MEASURED["reduce_copy_tb_s"][0], rel=2e-3)


def test_the_grouped_gemm_shape_table_is_the_h100_record():
    from moelab.planner.rates import GROUPED_FORWARD_TFLOPS, GROUPED_SHAPES

    shapes = json.loads((ROOT / GROUPED_SHAPES).read_text())["shapes"]
    assert len(shapes) == len(GROUPED_FORWARD_TFLOPS)
    for s in shapes.values():
        key = (s["hidden"], s["expert_ffn"], s["rows"] // s["experts"])
        both = 1 / ((2 / 3) / s["gate_up_bf16_tflops"] + (1 / 3) / s["down_bf16_tflops"])
        assert GROUPED_FORWARD_TFLOPS[key] == pytest.approx(both, rel=1e-4), key


def test_sonic_ratios_are_the_h100_profiles():
    # backend.experts=sonic against torch's grouped path: compiled steps on H100s, the grouped path's from issue 41
    # call 11; SonicMoE's GEMMs with moelab's tiles (call 18) and with QuACK's default config (call 11)
    from moelab.planner.rates import SONIC_MEASURED

    tiled = record("qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-compile-gbs2-h100-issue41-call18.json")
    sonic = record("qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-compile-gbs2-h100-issue41-call11.json")
    base = record("qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-grouped_mm-compile-gbs2-h100-issue41-call11.json")
    assert sonic["experts"] == tiled["experts"] == "sonic" and base["experts"] == "grouped_mm"
    assert tiled["gpu_name"] == sonic["gpu_name"] == base["gpu_name"]
    grouped = kernels_ms(base, lambda n, c: c == "matmul" and "GemmUniversal" in n)
    for key, prof in (("expert_matmul_ratio", tiled), ("expert_matmul_ratio_quack_tiles", sonic)):
        quack = kernels_ms(prof, lambda n, c: c == "matmul" and "quackgemm" in n)
        assert SONIC_MEASURED[key][0] == pytest.approx(quack / grouped, rel=1e-3), key
    assert SONIC_MEASURED["expert_matmul_ratio"][0] < SONIC_MEASURED["expert_matmul_ratio_quack_tiles"][0]
    assert SONIC_MEASURED["permute_ratio"][0] == pytest.approx(
        sonic["by_category_ms"]["permute"] / base["by_category_ms"]["permute"], rel=1e-3)
    for key, (value, source) in SONIC_MEASURED.items():
        named = [w for w in source.replace(",", " ").split() if w.startswith("gallery/results/")]
        assert named and all((ROOT / w.rstrip(":)")).exists() for w in named), (key, source)
