"""The kernel rates the step-time model (moelab.planner.speed) computes at: measured on this project's H200 (each
figure with the record it comes from; tests/planner/test_rates.py derives every one again from its file), and
carried to another GPU kind by the ratio of the datasheet figures (moelab.planner.gpus), but for TritonAdamW, measured
on the H100 and the H200 (ADAMW_MEASURED, GRAD_NORM_MEASURED); torch-free.

    r = rates(gpu_kind("h100"), balanced=True)
    r.dense / 1e12                     # 761.5: H100 and H200 share the BF16 peak
    r.optimizer["adamw_triton"]        # bytes/s of the Triton AdamW's kernel (its gradient norm: r.grad_norm)

The profiles are single compiled steps of the Qwen3-30B-A3B proxy (8 layers, 8,192 tokens per micro batch,
learned router, bf16 parameters and moments) with their kernels summed by category and name:
- _PROFILE (commit f7ecd22): the full loss, torch's fused AdamW;
- _PROFILE_CHUNKED (5ad9062): the same step with the fused chunked loss and the Triton AdamW (torch's gradient norm,
  the code before 3187545);
- _PROFILE_FP8 (5fe5a16): train.fp8=rowwise (full loss, torch's AdamW); its top 40 kernels leave 1.7 ms of
  the matmul category unnamed, which no FP8 figure here counts.
"""
from __future__ import annotations

from dataclasses import dataclass

from moelab.planner.gpus import GPU_KINDS, GPUKind

_RESULTS = "gallery/results/"
_PROFILE = _RESULTS + "qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-compile-gbs2-f7ecd22.json"
_PROFILE_CHUNKED = _RESULTS + "qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-compile-gbs2-default-5ad9062.json"
_PROFILE_FP8 = _RESULTS + "qwen3-moe-30b-a3b-proxy--moelab--profile-fp8-rowwise-compile-gbs2-5fe5a16.json"
_FP8_CHECK = _RESULTS + "qwen3-moe-30b-a3b-proxy--moelab--fp8-kernel-check-5fe5a16.json"
_KERNELS = _RESULTS + "backends-experts-kernels.json"
_PROFILE_CP2 = _RESULTS + "logs/qwen3-moe-30b-a3b-proxy--moelab--profile-cp2-seq8192-eager.txt"
# the same compiled step at global batch 16 (8 micro batches, commit 9e0dd92): what grows with micro batches
_PROFILE_GBS16 = _RESULTS + "qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-compile-gbs16.json"
_MACHINE = "../shared/notes/gpu-machine.md (nvidia-h200-x2, 2026-11-30)"
# the proxy's shapes the per-element figures divide by: tokens per micro batch, hidden, layers, top_k, vocabulary,
# and the elements of one layer's expert weights (gate|up E x D x 2F, down E x F x D)
_T, _D, _L, _K, _V = 8192, 2048, 8, 8, 151936
_GATE_UP, _EXPERT_WEIGHTS = 128 * 2048 * 1536, 3 * 128 * 2048 * 768
# FLOPs of one micro batch of the proxy (moelab.planner.flops): routed experts, the FP8 projections (attention
# q/k/v/o: 6 x 18.87 M per token and layer), the LM head
_EXPERT_FLOP, _PROJ_FLOP, _HEAD_FLOP = 14.84e12, 6 * 18_874_368 * _T * _L, 6 * 2048 * _V * _T

H200_MEASURED = {
    # dense GEMM kernels (nvjet / cuBLAS names) 29.97 ms for 22.82 TFLOP of dense matmuls
    "dense_tflops": (761.5, _PROFILE + ": the non-grouped matmul kernels of top_kernels"),
    # the grouped GEMM kernels (cutlass GroupProblemShape) 26.32 ms for 14.84 TFLOP, learned (skewed) routing
    "grouped_tflops": (564.0, _PROFILE + ": the grouped matmul kernels (GroupProblemShape) of top_kernels"),
    # balanced routing is faster by the ratio the experts-kernel check measured (466 / 410 TFLOP/s)
    "grouped_balanced_gain": (466.1 / 409.6, _KERNELS + ": grouped_mm balanced / skewed_dirichlet2 tflops"),
    "attention_tflops": (452.6, _PROFILE + ": category attention 14.58 ms for 6.60 TFLOP (causal, fwd + bwd)"),
    # seconds per element: elementwise (less the log_softmax / nll_loss kernels) + other over T x hidden x
    # layers; permute over T x top_k x hidden x MoE layers; idle per layer and micro batch
    "elementwise_s": ((11.785 - 3.129 + 1.245) * 1e-3 / (_T * _D * _L), _PROFILE + ": categories elementwise "
                      "(less the log_softmax / nll_loss kernels, 3.13 ms) + other"),
    "permute_s": (5.958e-3 / (_T * _K * _D * _L), _PROFILE + ": category permute"),
    # idle (launch gaps, host synchronisations): a part per step (the loss's and optimizer's host work) and a part
    # per layer and micro batch, from two profiles of one step with 1 and 8 micro batches: 9.018 = s + 8 x and
    # 27.629 = s + 64 x ms (the one-micro-batch profile alone put all of it on the layers: 1.13 ms, 3.4x too much
    # for a step of many micro batches)
    "idle_s_per_layer": ((27.629 - 9.018) * 1e-3 / (64 - _L), _PROFILE + " and " + _PROFILE_GBS16 + ": idle_ms "
                         "9.018 (1 micro batch) and 27.629 (8), per layer and micro batch"),
    "idle_s_per_step": ((9.018 - _L * (27.629 - 9.018) / (64 - _L)) * 1e-3, _PROFILE + " and " + _PROFILE_GBS16
                        + ": idle_ms, what is left of the one-micro-batch step's idle"),
    # autograd's gradient accumulation from the second micro batch on (.grad += new: 3 x 2 B per bf16 parameter),
    # the vectorized add kernel (CUDAFunctor_add) the 8-micro-batch profile has and the one-micro-batch one has not
    "grad_accumulate_tb_s": (3 * 2 * 5.607297e9 * 7 / 54.1654e-3 / 1e12, _PROFILE_GBS16 + ": top_kernels "
                             "vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add...> 54.17 ms over 7 "
                             "accumulations"),
    # the loss (backend.loss), seconds per token x vocabulary element: the full loss's log_softmax / nll_loss
    # kernels; the chunked loss's own kernels (its logsumexp / scatter-add kernel, filed under permute, and its
    # gradient casts and fills under elementwise: the categories' growth between the two profiles once the full
    # loss's kernels are taken out), and its LM-head GEMMs slower than the full loss's by the matmul category's
    # growth (chunks of the head, the weight gradient accumulated over chunks)
    "loss_full_s": (3.129e-3 / (_T * _V), _PROFILE + ": the log_softmax / nll_loss kernels of top_kernels"),
    "loss_chunked_s": (((10.809 - (11.785 - 3.129)) + (9.302 - 5.958)) * 1e-3 / (_T * _V),
                       _PROFILE_CHUNKED + " against " + _PROFILE + ": categories elementwise and permute"),
    "chunked_head_factor": (1 + (59.894 - 56.452) * 1e-3 / (_HEAD_FLOP / 761.5e12),
                            _PROFILE_CHUNKED + " against " + _PROFILE + ": category matmul, over the LM head's "
                            "time at the dense rate"),
    # the optimizer step + gradient norm, bytes per second: reads p, g, m, v, writes p, m, v, the norm reads g
    # (16 B per bf16 parameter with bf16 moments) for the proxy's 5.61 B parameters
    "adamw_tb_s": (16 * 5.607e9 / 33.966e-3 / 1e12, _PROFILE + ": category optimizer 33.97 ms (torch's fused "
                   "AdamW + gradient norm)"),
    # the Triton AdamW with torch's gradient norm (the code before 3187545: Plan.grad_norm; ADAMW_MEASURED and
    # GRAD_NORM_MEASURED since)
    "adamw_triton_tb_s": (16 * 5.607e9 / 23.901e-3 / 1e12, _PROFILE_CHUNKED + ": category optimizer 23.90 ms "
                          "(TritonAdamW + torch's gradient norm)"),
    # FP8 (train.fp8=rowwise): the experts' forward and dgrad GEMM in e4m3 and wgrad in bf16, 10.89 + 11.15 ms
    "grouped_fp8_tflops": (_EXPERT_FLOP / (10.8886 + 11.1503) / 1e9, _PROFILE_FP8 + ": the grouped GEMM kernels "
                           "(GroupProblemShape: the scaled one, MainloopSm90Array, and torch's bf16 wgrad)"),
    # the projections' three e4m3 GEMMs (nvjet ...qqtst... kernels) 5.41 ms
    "dense_fp8_tflops": (_PROJ_FLOP / 5.4094 / 1e9, _PROFILE_FP8 + ": the e4m3 GEMM kernels (nvjet qq) of "
                         "top_kernels, for the attention projections"),
    # quantising one expert weight element (amax, scale, cast): one gate_up weight [E, D, 2F] 0.572 ms
    "fp8_weight_quant_s": (0.57248e-3 / _GATE_UP, _FP8_CHECK + ": fwd_bwd_ms 'quantise one gate_up weight'"),
    # the quantisation kernels fused into the scaled grouped GEMMs' inputs (names _scaled_grouped_mm ... exp2),
    # 25.56 ms, less the weights' two e4m3 copies (forward and dgrad scalings) per layer; per routed row x hidden
    "fp8_expert_quant_s": ((25.5561e-3 - 2 * _L * _EXPERT_WEIGHTS * 0.57248e-3 / _GATE_UP) / (_T * _K * _D * _L),
                           _PROFILE_FP8 + ": the _scaled_grouped_mm quantisation kernels of top_kernels, less "
                           "the expert weights' share (" + _FP8_CHECK + ")"),
    # the projections' quantisation kernels (names _scaled_mm ... exp2) per token x hidden x layer
    "fp8_dense_quant_s": (2.6885e-3 / (_T * _D * _L), _PROFILE_FP8 + ": the _scaled_mm quantisation kernels of "
                          "top_kernels"),
    # the FP8 LM head (train.fp8=rowwise_lm_head) against bf16, fwd + bwd with its quantisation, compiled
    "fp8_head_factor": (21.512208 / 20.897952, _FP8_CHECK + ": fwd_bwd_ms 'lm_head fp8 compiled' / 'lm_head "
                        "bf16 compiled'"),
    "copy_tb_s": (3.5, "../shared/notes/gpu-machine.md: gathering 65,536 rows of 2048 bf16 by index, 3.5 TB/s"),
    # FSDP2's reduce-scatter copy-in (chunk_cat: bf16 gradients read, fp32 written, 6 B per element) of the proxy's
    # 5.61 B parameters under CP=2 (every unit on the 2-rank mesh, one micro batch), 16.52 ms
    "reduce_copy_tb_s": (6 * 5.607297e9 / 16.520e-3 / 1e12, _PROFILE_CP2 + ": the chunk_cat_cuda_kernel row"),
    "nvlink_gb_s": (300.0, _MACHINE + ": all_to_all_single 512 MiB 294 GB/s leaving each GPU, all_reduce bus "
                    "bandwidth 301 GB/s"),
    "exchange_s": (0.29e-3, _MACHINE + ": the MoE exchange with counts and the device-to-host copy 1.20 ms "
                   "against 0.91 ms for the bare all_to_all_single of the same bytes"),
}
# Fabric figures not measured here, from published collective benchmarks (value, source):
_DEEPEP = ("DeepEP README (github.com/deepseek-ai/DeepEP), 'Normal kernels with NVLink and RDMA forwarding', "
           "H800 with one CX7 InfiniBand 400 Gb/s NIC per GPU (~50 GB/s), DeepSeek-V3 pre-training setting")
PUBLISHED = {
    # the inter-node share of an expert exchange, once per destination node over each GPU's own 400 Gb/s NIC:
    # internode EP64 dispatch 46 GB/s, combine 45 GB/s of ~50 GB/s (EP32 44 / 47, EP16 43 / 43)
    "ib_fraction": ((46 + 45) / 2 / 50, _DEEPEP + ": internode EP64 dispatch 46, combine 45 GB/s (RDMA)"),
    # NVLink 4 inside a node: the all-to-all this project timed on two H200s (the same NVLink 4 as the H100's,
    # H200_MEASURED['nvlink_gb_s']) reached 294-334 GB/s leaving each GPU; DeepEP's intranode kernels reach
    # 153 / 158 GB/s of the H800's ~160 GB/s, the same 0.96 share a tuned kernel gets, NCCL's all_to_all 0.65-0.74
    "nvlink_deepep_fraction": (155.5 / 160, _DEEPEP + ": intranode EP8 dispatch 153, combine 158 GB/s (NVLink)"),
}
# The routed experts' forward grouped GEMMs at the reference rows' shapes on one H100 (bf16, balanced rows):
# (hidden, expert width, rows per local expert) -> TFLOP/s of gate|up and down together (time-weighted 2:1).
# The model keeps the profile's rate (the proxy's shape) and names the measured ratio where a config's shape has
# one (moelab.planner.speed.extrapolated): a shape factor from forward GEMMs alone is not what a step's
# forward + backward GEMMs reach (wgrad runs at other shapes).
GROUPED_SHAPES = _RESULTS + "grouped-gemm-shapes-h100.json"
GROUPED_FORWARD_TFLOPS = {  # GROUPED_SHAPES: shapes.<name>.gate_up_bf16_tflops / down_bf16_tflops
    (2048, 768, 512): 1 / ((2 / 3) / 613.33 + (1 / 3) / 526.43),   # the Qwen3 proxy (the profile's shape)
    (2048, 768, 8192): 1 / ((2 / 3) / 682.46 + (1 / 3) / 613.80),  # Qwen3-30B-A3B, 8 GPUs
    (7168, 2048, 8192): 1 / ((2 / 3) / 691.48 + (1 / 3) / 695.75),  # DeepSeek-V3, EP 64
    (7168, 2048, 2730): 1 / ((2 / 3) / 759.36 + (1 / 3) / 718.63),  # Kimi-K2, EP 32
    (2880, 2880, 16384): 1 / ((2 / 3) / 587.98 + (1 / 3) / 544.03),  # GPT-OSS-120B, EP 64
    (2880, 2880, 8192): 1 / ((2 / 3) / 676.68 + (1 / 3) / 633.59),  # GPT-OSS-20B, EP 8
}
# backend.experts=sonic (SonicMoE's kernels, which `auto` takes where installed) against torch's grouped GEMM path,
# as ratios of H100 profiles of the same compiled step at global batch 2 (one micro batch, learned router): its
# CuTe-DSL GEMMs (quackgemm kernels: the gathers and SwiGLU inside) over torch's grouped GEMM kernels, with moelab's
# tiles (moelab.backends.sonic.TILES, issue 41 call 18) and with QuACK's default config (call 11, the code before
# 756805e: Plan.sonic_tiles), and its permute category (the token_gather_sum of dx, what is left of the row moves)
# over the grouped path's (dispatch, combine and their backward); the grouped path's profile is call 11's; ratios
# carried onto the H200 figures above
_SONIC = _RESULTS + "qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-compile-gbs2-h100-issue41-call11.json"
_SONIC_TILED = _RESULTS + "qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-compile-gbs2-h100-issue41-call18.json"
_SONIC_BASE = (_RESULTS
               + "qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-grouped_mm-compile-gbs2-h100-issue41-call11.json")
SONIC_MEASURED = {
    "expert_matmul_ratio": ((19.405 + 5.413 + 3.906) / (12.310 + 8.579 + 8.135),
                            _SONIC_TILED + " against " + _SONIC_BASE + ": the quackgemm kernels of top_kernels over "
                            "the grouped GEMM kernels (enable_3x_kernel_for_sm9x GemmUniversal)"),
    "expert_matmul_ratio_quack_tiles": ((20.108 + 6.151 + 5.895) / (12.310 + 8.579 + 8.135),
                                        _SONIC + " against " + _SONIC_BASE + ": the same kernels, QuACK's default "
                                        "config for every GEMM"),
    "permute_ratio": (2.62 / 12.37, _SONIC + " against " + _SONIC_BASE + ": category permute"),
}
# TritonAdamW's kernel alone, bytes per second: reads p, g, m, v and writes p, m, v (14 B per bf16 parameter with
# bf16 moments, the proxy's 5.61 B parameters), from the adamw kernel of one-micro-batch compiled profiles on each GPU
# kind measured (moelab's sonic step): the H200's of its day's blocks (4096 x 8), the H100's of today's (1024 x 4,
# since issue 41 call 30); a kind not measured carries the H200's by the HBM ratio. The gradient norm's pass beside
# it is GRAD_NORM_MEASURED's.
_OPT_H200 = _RESULTS + "qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-compile-gbs2-h200-issue41-call17.json"
_OPT_H100 = _RESULTS + "qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-compile-gbs2-h100-issue41-call21.json"
_ADAMW_H100 = _RESULTS + "qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-compile-gbs2-h100-issue41-call31.json"
ADAMW_MEASURED = {
    "h200": (14 * 5.607e9 / 19.4567e-3 / 1e12, _OPT_H200 + ": top_kernels adamw_kernel 19.46 ms"),
    "h100": (14 * 5.607e9 / 25.7503e-3 / 1e12, _ADAMW_H100 + ": top_kernels adamw_kernel 25.75 ms"),
}
# The gradient norm's own pass (moelab.backends.grad_norm's sumsq kernel, bf16 gradients read once) on each kind
# measured, from the same profiles; and what summing the experts' gradient squares in their weight-gradient GEMMs'
# epilogue costs against that pass over the same two gradients (moelab.backends.sonic_squares: issue 41 call 28's
# check, one MoE layer at the Qwen3 proxy's shape on an H100: +0.137 ms on a 4.346 ms forward + backward, against
# the pass's 0.460 ms)
_SQ_CHECK = _RESULTS + "qwen3-moe-30b-a3b-proxy--moelab--sonic-squares-check-h100-issue41-call28.json"
GRAD_NORM_MEASURED = {
    "h200": (2 * 5.607e9 / (2.8042e-3) / 1e12, _OPT_H200 + ": top_kernels sumsq_kernel 2.80 ms over 11.2 GB"),
    "h100": (2 * 5.607e9 / (3.8219e-3) / 1e12, _OPT_H100 + ": top_kernels sumsq_kernel 3.82 ms over 11.2 GB"),
}
NORM_EPILOGUE = ((4.4830 - 4.3460) / 0.4600, _SQ_CHECK + ": ms_fwd_bwd_with_squares - ms_fwd_bwd_plain over "
                 "ms_norm_pass_of_the_two_gradients")
# backend.loss=full's in-place kernel (moelab.backends.loss_kernel): two reads of the bf16 logits and one write of
# their gradient over them, bytes per second, at the Qwen3 proxy's 8,192 x 151,936 (issue 41 call 29's check, the
# kernel alone at its default block and warps); a kind not measured carries it by the HBM ratio
_LOSS_CHECK = _RESULTS + "qwen3-moe-30b-a3b-proxy--moelab--loss-kernel-check-h100-issue41-call29.json"
LOSS_KERNEL_MEASURED = {
    "h100": (3 * 2 * 8192 * 151936 / 2.4883e-3 / 1e12, _LOSS_CHECK + ": ms_loss_kernel_by_block_and_warps 8192x16 "
             "(default_block_and_warps) 2.488 ms"),
}
# Gradient clipping's multiply as its own pass (torch.nn.utils.clip_grads_with_norm_ with an fp32 factor: over bf16
# gradients torch's foreach multiply takes its per-tensor slow path), bytes read and written per second, measured on
# one expert weight of the Qwen3 proxy (402.7 M bf16 elements: 1.61 GB moved) by issue 41 call 41's clip check; a
# kind not measured carries it by the HBM ratio. The Triton AdamW does the multiply in its update (no pass).
_CLIP_CHECK = _RESULTS + "qwen3-moe-30b-a3b-proxy--moelab--clip-check-h100-issue41-call41.json"
CLIP_PASS_MEASURED = {
    "h100": (2 * 2 * 402653184 / 1.5521e-3 / 1e12, _CLIP_CHECK + ": timing multiply_pass_ms 1.552"),
}
# The same multiply since ccb44ef wherever the optimizer does not take the factor (torch's AdamW): the factor in the
# gradients' dtype keeps torch's foreach multiply on its fast path (moelab.backends.grad_norm.scale_grads, same
# values), measured on the same weight by issue 41 call 43's clip check
_CLIP_CHECK_43 = _RESULTS + "qwen3-moe-30b-a3b-proxy--moelab--clip-check-h100-issue41-call43.json"
CLIP_FOREACH_MEASURED = {
    "h100": (2 * 2 * 402653184 / 0.72216e-3 / 1e12, _CLIP_CHECK_43 + ": timing scale_grads_ms 0.722"),
}
# Without train.compile the elementwise, permute and loss work costs this many times the compiled figure: the
# eager and compiled steps of one call (fake gate, global batch 2: 195.3 and 137.3 ms, records
# ...--fake-gate-gbs2.json and ...--fake-gate-gbs2-compile.json) differ by 58.0 ms over the compiled 19.0 ms.
EAGER_FACTOR = 1 + (195.3 - 137.3) / (11.785 + 1.245 + 5.958)
H200 = GPU_KINDS["h200"]
# the records the rates come from: a prediction of one of them is not an independent check
CALIBRATION_RECORDS = ("qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-compile-gbs2-f7ecd22.json",
                       "qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-compile-gbs16.json",
                       "qwen3-moe-30b-a3b-proxy--moelab--fake-gate-gbs2.json",
                       "qwen3-moe-30b-a3b-proxy--moelab--fake-gate-gbs2-compile.json")


@dataclass(frozen=True)
class Rates:
    """H200_MEASURED carried to a GPU kind: compute rates by the BF16 (FP8) peak ratio, memory-bound terms by
    the HBM bandwidth ratio, NVLink by the NVLink ratio; InfiniBand (not measured here) at its datasheet rate
    times the share of it DeepEP's published internode figures reach (PUBLISHED). Idle gaps (host-side) do not
    scale.

        rates(gpu_kind("h200"), balanced=False).grouped / 1e12     # 564.0
    """
    dense: float  # FLOP/s
    grouped: float
    attention: float
    dense_fp8: float
    grouped_fp8: float
    mem: float  # HBM time scale: seconds per element of the H200 figures times this
    optimizer: dict  # bytes/s: adamw_triton its kernel alone; adamw, adamw_triton_torch_norm with their norm
    copy: float  # bytes/s
    reduce_copy: float  # bytes/s of FSDP2's reduce-scatter copy-in
    nvlink: float
    ib: float
    exchange_s: float
    idle_s_per_layer: float
    idle_s_per_step: float
    grad_accumulate: float  # bytes/s of autograd's gradient accumulation (read both, write one)
    grad_norm: float  # bytes/s of the gradient norm's own pass (GRAD_NORM_MEASURED)
    norm_epilogue: float  # the experts' squares in their GEMMs' epilogue, in units of that pass's time (NORM_EPILOGUE)
    loss_kernel: float  # bytes/s of the full loss's in-place kernel: two reads of the logits and one write
    clip_pass: float  # bytes/s of clipping's multiply as its own pass: each gradient read and written
    clip_foreach: float  # the same pass with the factor in the gradients' dtype (grad_norm.scale_grads)

    def per_element(self, key: str) -> float:
        """Seconds per element of a memory-bound H200_MEASURED figure (elementwise_s, loss_full_s, ...) here."""
        return H200_MEASURED[key][0] * self.mem


def _measured_tb_s(table: dict, kind: GPUKind) -> float:
    """TB/s of a memory-bound pass on `kind` from `table` (ADAMW_MEASURED: TritonAdamW's kernel;
    GRAD_NORM_MEASURED: the norm's pass; LOSS_KERNEL_MEASURED: the full loss's kernel; CLIP_PASS_MEASURED and
    CLIP_FOREACH_MEASURED: clipping's multiply): measured there, else the
    first kind measured (the H200 where it was) by the HBM bandwidth ratio."""
    key = next((k for k, g in GPU_KINDS.items() if g == kind), None)
    if key in table:
        return table[key][0]
    measured = "h200" if "h200" in table else next(iter(table))
    return table[measured][0] * kind.hbm_tb_s / GPU_KINDS[measured].hbm_tb_s


def rates(kind: GPUKind, balanced: bool) -> Rates:
    """The rates on `kind`; `balanced`: the fake balanced gate's routing (the grouped GEMM's balanced gain)."""
    v = {k: x for k, (x, _) in H200_MEASURED.items()}
    flop = kind.bf16_tflops / H200.bf16_tflops * 1e12
    fp8 = kind.fp8_tflops / H200.fp8_tflops * 1e12
    gain = v["grouped_balanced_gain"] if balanced else 1.0
    hbm = kind.hbm_tb_s / H200.hbm_tb_s
    link = v["nvlink_gb_s"] * 1e9 / H200.nvlink_gb_s  # achieved bytes/s per datasheet GB/s
    return Rates(dense=v["dense_tflops"] * flop, attention=v["attention_tflops"] * flop,
                 grouped=v["grouped_tflops"] * flop * gain, dense_fp8=v["dense_fp8_tflops"] * fp8,
                 grouped_fp8=v["grouped_fp8_tflops"] * fp8 * gain, mem=1 / hbm,
                 optimizer={"adamw": v["adamw_tb_s"] * 1e12 * hbm,
                            "adamw_triton": _measured_tb_s(ADAMW_MEASURED, kind) * 1e12,
                            "adamw_triton_torch_norm": v["adamw_triton_tb_s"] * 1e12 * hbm},
                 copy=v["copy_tb_s"] * 1e12 * hbm, reduce_copy=v["reduce_copy_tb_s"] * 1e12 * hbm,
                 nvlink=kind.nvlink_gb_s * link, ib=kind.ib_gb_s * 1e9 * PUBLISHED["ib_fraction"][0],
                 exchange_s=v["exchange_s"], idle_s_per_layer=v["idle_s_per_layer"],
                 idle_s_per_step=v["idle_s_per_step"], grad_accumulate=v["grad_accumulate_tb_s"] * 1e12 * hbm,
                 grad_norm=_measured_tb_s(GRAD_NORM_MEASURED, kind) * 1e12, norm_epilogue=NORM_EPILOGUE[0],
                 loss_kernel=_measured_tb_s(LOSS_KERNEL_MEASURED, kind) * 1e12,
                 clip_pass=_measured_tb_s(CLIP_PASS_MEASURED, kind) * 1e12,
                 clip_foreach=_measured_tb_s(CLIP_FOREACH_MEASURED, kind) * 1e12)
