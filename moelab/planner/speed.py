"""The step-time model: how long one optimizer step of a planned config takes on a GPU kind, by part, and the
throughput that follows (tokens/s/GPU, TFLOPs/GPU, MFU, GPU-hours per billion tokens); torch-free.

    s = plan(load_config("deepseek-v3"), gpus=256, gpu="h100").speed
    s.tokens_per_s_per_gpu, s.bottleneck, s.parts_s["all_to_all"]
    print(s.line())

How (every rate comes from this project's measurements on one H200, H200_MEASURED, not from a datasheet):
- FLOPs per token and their split come from moelab.planner.flops (count_params on one-layer models: the dense
  matmuls of a block, its top_k routed experts; attention_flops_per_token), communication bytes from the plan
  (moelab.planner.plan._communication). Per pipeline rank, per micro batch of T = micro batch x seq / cp tokens:
  dense matmuls (attention projections, dense FFNs, router, shared experts, the LM head on the last stage) at
  the dense rate, routed experts at the grouped-GEMM rate (balanced or skewed routing), causal attention at the
  attention rate; elementwise work (norms, rotary, SwiGLU, residuals) per token x hidden x layer, the
  permutation per routed row x hidden, the loss per token x vocabulary, and the GPU's idle gaps per layer, each
  at the time per element the compiled profile measured (x EAGER_FACTOR without train.compile).
- The optimizer reads p, g, m, v and writes p, m, v, and the gradient norm reads g: 8 x parameter bytes per
  trained parameter of the rank, at the fused AdamW's measured bandwidth. fp32 parameters computing in bf16 pay
  one cast (read fp32, write bf16) of the rank's weights per micro batch.
- Expert all-to-all: the plan's bytes per MoE layer; the EP group is EP consecutive ranks (the expert mesh's
  innermost dimension) laid over 8-GPU nodes, so a share (min(ep, 8) - 1) / (ep - 1) of the other ranks is on
  the same node (NVLink) and the rest on others (InfiniBand); the two run at once (the slower counts), plus a
  fixed cost per exchange (the split sizes' all-to-all and device-to-host copy).
- FSDP all-gather / reduce-scatter: the plan's bytes, on NVLink when the stage's fsdp x cp ranks fit in a node;
  across nodes NCCL runs one ring per NIC, so the node's 8 InfiniBand links carry them together (at most
  NVLink's rate: min(NVLink, 8 x InfiniBand) per GPU); under pp > 1 once per step (torch.distributed.pipelining's stages keep the blocks gathered
  and sync gradients only after the last micro batch), so the plan's per-micro-batch bytes count once; plus
  FSDP2's copy-in / copy-out of the same bytes at HBM speed. DDP and replicated-expert gradients likewise.
- Pipeline: the slowest stage's micro batch time t sets the pace: step = m t + bubble, bubble = the plan's
  bubble fraction (pp - 1) / (vp m + pp - 1) of it; activations sent between stages on NVLink or InfiniBand.
- Overlap (the schedule moelab runs today): none. The EP=2 profile on two H200s (perf-notes, call 9) shows the
  NCCL kernels in line with compute (55.6 ms of NCCL for a step 42 ms longer than one GPU's), so every
  communication term adds to the step; parallel.ep_overlap hides at most half of the all-to-all behind the
  routed experts' matmuls (its chunk 0 dispatch and chunk 1 combine have nothing to hide behind).
- comm_hidden_tokens_per_s_per_gpu: the same step if every communication term hid behind the compute (the
  pipeline bubble left as it is): the bound a schedule that overlaps fully would reach with these rates.
- Another GPU kind: matmul and attention rates scale by the dense BF16 peak ratio, memory-bound terms by the
  HBM bandwidth ratio, NVLink by the NVLink ratio; InfiniBand (not measured here) at its datasheet rate times
  the efficiency NVLink reached here (measured / datasheet). Idle gaps (host-side) do not scale.
Not modelled: FP8 (train.fp8 is predicted as bf16), TP (refused by the layout check), kernel backends other
than torch's grouped GEMM and SDPA (te, grouped_gemm, flex), shape-dependence of the rates (all measured at
the Qwen3-30B-A3B proxy's shapes).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from moelab.planner.flops import attention_flops_per_token, count_params
from moelab.planner.gpus import GPU_KINDS, GPUKind, gpu_kind

_PROFILE = "gallery/results/qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-compile-gbs2.json"
_KERNELS = "gallery/results/backends-experts-kernels.json"
_MACHINE = "../shared/notes/gpu-machine.md (nvidia-h200-x2, 2026-11-30)"

# Rates measured on one H200 (torch 2.11, bf16), each with the record it comes from; tests/planner/test_speed.py
# derives the profile-based ones again from their files. The profile is one compiled step of the Qwen3-30B-A3B
# proxy (8 layers, 8,192 tokens per micro batch, learned router), its kernels summed by category and name.
H200_MEASURED = {
    # dense GEMM kernels (nvjet / cuBLAS names) 29.97 ms for 22.82 TFLOP of dense matmuls
    "dense_tflops": (761.5, _PROFILE + ": the non-grouped matmul kernels of top_kernels"),
    # the grouped GEMM kernels (cutlass GroupProblemShape) 26.32 ms for 14.84 TFLOP, learned (skewed) routing
    "grouped_tflops": (564.0, _PROFILE + ": the grouped matmul kernels (GroupProblemShape) of top_kernels"),
    # balanced routing is faster by the ratio the experts-kernel check measured (466 / 410 TFLOP/s)
    "grouped_balanced_gain": (466.1 / 409.6, _KERNELS + ": grouped_mm balanced / skewed_dirichlet2 tflops"),
    "attention_tflops": (452.6, _PROFILE + ": category attention 14.58 ms for 6.60 TFLOP (causal, fwd + bwd)"),
    # seconds per element: elementwise (less the loss) + other over T x hidden x layers; permute over
    # T x top_k x hidden x MoE layers; the loss kernels over T x vocabulary; idle per layer and micro batch
    "elementwise_s": ((11.785 - 3.129 + 1.245) * 1e-3 / (8192 * 2048 * 8), _PROFILE + ": categories elementwise "
                      "(less the log_softmax / nll_loss kernels, 3.13 ms) + other"),
    "permute_s": (5.958e-3 / (8192 * 8 * 2048 * 8), _PROFILE + ": category permute"),
    "loss_s": (3.129e-3 / (8192 * 151936), _PROFILE + ": the log_softmax / nll_loss kernels of top_kernels"),
    "idle_s_per_layer": (9.018e-3 / 8, _PROFILE + ": idle_ms (launch gaps, host synchronisations)"),
    "optimizer_tb_s": (16 * 5.607e9 / 34.0e-3 / 1e12, _PROFILE + ": category optimizer 34.0 ms (fused AdamW + "
                       "gradient norm) for 5.61 B bf16 parameters, 16 B each"),
    "copy_tb_s": (3.5, "../shared/notes/gpu-machine.md: gathering 65,536 rows of 2048 bf16 by index, 3.5 TB/s"),
    "nvlink_gb_s": (300.0, _MACHINE + ": all_to_all_single 512 MiB 294 GB/s leaving each GPU, all_reduce bus "
                    "bandwidth 301 GB/s"),
    "exchange_s": (0.29e-3, _MACHINE + ": the MoE exchange with counts and the device-to-host copy 1.20 ms "
                   "against 0.91 ms for the bare all_to_all_single of the same bytes"),
}
# Without train.compile the elementwise, permute and loss work costs this many times the compiled figure: the
# eager and compiled steps of one call (fake gate, global batch 2: 195.3 and 137.3 ms, records
# ...--fake-gate-gbs2.json and ...--fake-gate-gbs2-compile.json) differ by 58.0 ms over the compiled 19.0 ms.
EAGER_FACTOR = 1 + (195.3 - 137.3) / (11.785 + 1.245 + 5.958)
H200 = GPU_KINDS["h200"]

COMM_PARTS = ("all_to_all", "cp", "pipeline_send", "fsdp")
COMPUTE_PARTS = ("dense_matmul", "expert_matmul", "attention", "elementwise")
PART_LABELS = {"dense_matmul": "dense matmuls", "expert_matmul": "expert matmuls", "attention": "attention",
               "elementwise": "elementwise/permute/loss", "idle": "launch gaps", "all_to_all": "all-to-all",
               "cp": "CP K/V exchange", "pipeline_send": "pipeline send/recv", "bubble": "pipeline bubble",
               "fsdp": "FSDP gather/reduce", "optimizer": "optimizer", "casts": "weight casts"}


@dataclass
class Speed:
    """A predicted optimizer step on `gpus` GPUs of one kind: its time, its parts (seconds per step, as they add
    up: moelab overlaps none of them today), and the throughput that follows.

        s = plan(load_config("qwen3-moe-30b-a3b"), gpus=8, gpu="h100").speed
        s.line(); sum(s.parts_s.values()) == s.step_s
    """
    gpu: str
    gpus: int
    step_s: float
    parts_s: dict
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    mfu: float
    bottleneck: str
    gpu_hours_per_billion_tokens: float
    assumptions: list = field(default_factory=list)
    unmodelled: list = field(default_factory=list)  # what this config runs that the model times as something else
    # the same step if the schedule hid every communication term behind the compute (a bound, not moelab today)
    comm_hidden_tokens_per_s_per_gpu: float = 0.0

    def line(self) -> str:
        return (f"{self.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {self.tflops_per_gpu:,.0f} TFLOPs/GPU, MFU "
                f"{100 * self.mfu:.0f}% on {self.gpus} x {self.gpu}; step {_secs(self.step_s)}, bottleneck "
                f"{PART_LABELS[self.bottleneck]}; {self.gpu_hours_per_billion_tokens:,.0f} GPU-hours per billion tokens")

    def breakdown(self) -> str:
        return (", ".join(f"{PART_LABELS[k]} {_secs(v)}" for k, v in self.parts_s.items() if v > 0)
                + f"; with all communication hidden {self.comm_hidden_tokens_per_s_per_gpu:,.0f} tokens/s/GPU")


def _secs(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{1e3 * s:.1f} ms"


@dataclass(frozen=True)
class Rates:
    """H200_MEASURED carried to `kind` (module docstring: which ratio scales which rate).

        rates(gpu_kind("h100"), balanced=True).dense / 1e12     # 761.5: H100 and H200 share the BF16 peak
    """
    dense: float  # FLOP/s
    grouped: float
    attention: float
    mem: float  # HBM time scale: seconds per element of the H200 figures times this
    optimizer: float  # bytes/s
    copy: float
    nvlink: float
    ib: float
    exchange_s: float
    idle_s_per_layer: float


def rates(kind: GPUKind, balanced: bool) -> Rates:
    v = {k: x for k, (x, _) in H200_MEASURED.items()}
    flop = kind.bf16_tflops / H200.bf16_tflops * 1e12
    hbm = kind.hbm_tb_s / H200.hbm_tb_s
    nvlink = v["nvlink_gb_s"] * 1e9 * kind.nvlink_gb_s / H200.nvlink_gb_s
    return Rates(dense=v["dense_tflops"] * flop, attention=v["attention_tflops"] * flop,
                 grouped=v["grouped_tflops"] * flop * (v["grouped_balanced_gain"] if balanced else 1.0),
                 mem=1 / hbm, optimizer=v["optimizer_tb_s"] * 1e12 * hbm, copy=v["copy_tb_s"] * 1e12 * hbm,
                 nvlink=nvlink, ib=kind.ib_gb_s * 1e9 * v["nvlink_gb_s"] / H200.nvlink_gb_s,
                 exchange_s=v["exchange_s"], idle_s_per_layer=v["idle_s_per_layer"])


def layer_flops(m) -> dict:
    """Matmul FLOPs per token (forward + backward, 6 x activated parameters) of each piece: a MoE block's dense
    matmuls (attention projections, router, shared experts) and routed experts, a dense block, the LM head."""
    zero = count_params(dataclasses.replace(m, num_layers=0, num_dense_layers=0))
    moe = count_params(dataclasses.replace(m, num_layers=1, num_dense_layers=0))
    dense = count_params(dataclasses.replace(m, num_layers=1, num_dense_layers=1))
    routed = m.moe.top_k * moe.experts_total // m.moe.num_experts
    return {"moe_dense": 6 * (moe.activated - zero.activated - routed), "moe_experts": 6 * routed,
            "dense_layer": 6 * (dense.activated - zero.activated), "head": 6 * zero.activated}


def predict(cfg, p, gpu: "str | GPUKind") -> Speed:
    """The step time of plan `p` (moelab.planner.plan.plan of `cfg`) on GPUs of kind `gpu`."""
    kind = gpu_kind(gpu)
    mdl, t, L = cfg.model, cfg.train, p.layout
    r = rates(kind, balanced=cfg.backend.fake_balanced_gate)
    a = 2 if t.dtype == "bfloat16" else 4
    pb = 2 if t.param_dtype == "bfloat16" else 4
    m, g = p.micro_batches_per_step, kind.gpus_per_node
    T = t.micro_batch_size * t.seq_len // L["cp"]
    D, K, V = mdl.hidden_size, mdl.moe.top_k, mdl.vocab_size
    shard = L["fsdp"] * L["cp"] * L["tp"]
    fl = layer_flops(mdl)
    attn_layer = attention_flops_per_token(mdl, t.seq_len) / mdl.num_layers  # the mean layer (windows averaged)
    recompute = {"none": (1.0, 1.0), "selective": (1.0, 4 / 3), "full": (4 / 3, 4 / 3)}[t.activation_checkpointing]
    eager = 1.0 if t.compile else EAGER_FACTOR
    ew = {k: x * r.mem for k, (x, _) in H200_MEASURED.items() if k in ("elementwise_s", "permute_s", "loss_s")}
    # a ring collective spanning nodes runs one ring per NIC: each rank's bytes cross nodes on 1/g of the hops
    bw = lambda span: r.nvlink if span <= g or p.gpus <= g else min(r.nvlink, g * r.ib)  # noqa: E731

    # the expert all-to-all: a share of each rank's bytes stays on its node
    ep = L["ep"]
    intra = (min(ep, g) - 1) / (ep - 1) if ep > 1 else 1.0
    passes = 4 + (2 if t.activation_checkpointing == "full" else 0)
    a2a_layer = p.comm["all_to_all_bytes_per_moe_layer"]
    a2a_layer_s = (max(a2a_layer * intra / r.nvlink, a2a_layer * (1 - intra) / r.ib) + passes * r.exchange_s
                   if ep > 1 else 0.0)

    per_rank = []
    for rank, layers in enumerate(p.stage_layers):
        n_moe = sum(i >= mdl.num_dense_layers for i in layers)
        n_dense = len(layers) - n_moe
        last = rank == L["pp"] - 1
        dense_flops = n_moe * fl["moe_dense"] + n_dense * fl["dense_layer"] + (fl["head"] if last else 0)
        a2a = n_moe * a2a_layer_s
        expert = T * n_moe * fl["moe_experts"] * recompute[0] / r.grouped
        if cfg.parallel.ep_overlap:
            a2a -= min(a2a / 2, expert)
        parts = {
            "dense_matmul": T * dense_flops * recompute[0] / r.dense,
            "expert_matmul": expert,
            "attention": T * len(layers) * attn_layer * recompute[1] / r.attention,
            "elementwise": eager * T * (len(layers) * D * ew["elementwise_s"] * recompute[0]
                                        + n_moe * K * D * ew["permute_s"] * recompute[0]
                                        + (V * ew["loss_s"] if last else 0)),
            "idle": len(layers) * r.idle_s_per_layer,
            "all_to_all": a2a,
            "cp": p.comm["cp_bytes_per_step"] / m / bw(L["cp"]),
            # stage neighbours are `shard` ranks apart: one NVLink or one InfiniBand link between them
            "pipeline_send": p.comm["pipeline_send_bytes_per_step"] / m
            / (r.nvlink if L["pp"] * shard <= g or p.gpus <= g else r.ib),
        }
        per_rank.append(parts)
    slowest = max(per_rank, key=lambda x: sum(x.values()))
    mb_s = sum(slowest.values())
    f = p.pipeline["bubble_fraction"]
    # FSDP: under pp > 1 the stages gather once and reduce once per step
    ag, rs = p.comm["fsdp_all_gather_bytes_per_step"], p.comm["fsdp_reduce_scatter_bytes_per_step"]
    if L["pp"] > 1:
        ag, rs = ag / (2 * m), rs / m
    replicated = p.comm.get("ddp_all_reduce_bytes_per_step", 0) + p.comm.get("expert_grad_bytes_per_step", 0)
    fsdp = (ag + rs + replicated) / bw(shard) + 2 * (ag + rs) / r.copy
    trained = p.memory["gradients"] / pb
    local = p.memory["parameters"] / pb
    parts = {k: m * v for k, v in slowest.items()}
    parts.update({"bubble": m * mb_s * f / (1 - f), "fsdp": fsdp, "optimizer": trained * 8 * pb / r.optimizer,
                  "casts": m * local * (pb + a) / r.copy if a < pb else 0.0})
    step = sum(parts.values())
    comm, compute = (sum(parts[k] for k in keys) for keys in (COMM_PARTS, COMPUTE_PARTS))
    hidden_step = step - comm + max(0.0, comm - compute)
    tokens = t.global_batch_size * t.seq_len / p.gpus / step
    tflops = tokens * p.flops_per_token / 1e12
    return Speed(gpu=kind.name, gpus=p.gpus, step_s=step, parts_s=parts, tokens_per_s_per_gpu=tokens,
                 tflops_per_gpu=tflops, mfu=tflops / kind.bf16_tflops, bottleneck=max(parts, key=parts.get),
                 gpu_hours_per_billion_tokens=1e9 / tokens / 3600, assumptions=_assumptions(cfg, kind, ep, intra),
                 unmodelled=unmodelled(cfg), comm_hidden_tokens_per_s_per_gpu=tokens * step / hidden_step)


def unmodelled(cfg) -> list[str]:
    """What `cfg` runs that the model times as something else (its rates are torch's grouped GEMM, SDPA, bf16)."""
    m, b, out = cfg.model, cfg.backend, []
    if cfg.train.dtype != "bfloat16":
        out.append(f"train.dtype={cfg.train.dtype}: fp32 matmuls, timed at the bf16 rates")
    if cfg.train.fp8 != "off":
        out.append(f"train.fp8={cfg.train.fp8}: FP8 GEMMs and their quantisation, timed as bf16")
    if b.attention == "eager" or (b.attention != "flex" and (m.sliding_window or m.attention_sinks)):
        out.append("attention: sliding windows / sinks run moelab's eager attention (scores materialised), timed "
                   "at SDPA's rate")
    elif b.attention != "sdpa":
        out.append(f"backend.attention={b.attention}: timed at SDPA's rate")
    if b.experts in ("loop", "grouped_gemm", "te"):
        out.append(f"backend.experts={b.experts}: timed at torch's grouped GEMM rate")
    if b.dispatcher == "deepep":
        out.append("backend.dispatcher=deepep: its kernels timed as NCCL's all-to-all of the same bytes")
    return out


def _assumptions(cfg, kind: GPUKind, ep: int, intra: float) -> list[str]:
    out = [f"speed on {kind.name}: kernel rates measured on one H200 (moelab.planner.speed.H200_MEASURED: dense "
           f"{H200_MEASURED['dense_tflops'][0]:.0f}, grouped {H200_MEASURED['grouped_tflops'][0]:.0f} (learned "
           f"router), attention {H200_MEASURED['attention_tflops'][0]:.0f} TFLOP/s), scaled by the datasheet "
           "ratio (compute by the BF16 peak, memory-bound terms by HBM bandwidth, links by link bandwidth)",
           "speed: no communication overlaps compute (moelab's schedule as profiled on two H200s); "
           + ("parallel.ep_overlap hides up to half the all-to-all; " if cfg.parallel.ep_overlap else "")
           + "FSDP under pp > 1 gathers and reduces once per step; InfiniBand at the efficiency NVLink reached here"]
    if ep > 1:
        out.append(f"speed: EP group of {ep} consecutive ranks over {kind.gpus_per_node}-GPU nodes: "
                   f"{100 * intra:.0f}% of its all-to-all partners on the same node")
    return out + [f"speed, not modelled: {text}" for text in unmodelled(cfg)]
