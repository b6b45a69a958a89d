"""The step-time model: how long one optimizer step of a planned config takes on a GPU kind, by part, how much of
each communication term moelab's schedule hides behind compute, and the throughput that follows (tokens/s/GPU,
TFLOPs/GPU, MFU, GPU-hours per billion tokens); torch-free.

    s = plan(load_config("deepseek-v3"), gpus=256, gpu="h100").speed
    s.tokens_per_s_per_gpu, s.bottleneck, s.parts_s["all_to_all"], s.hidden_s["fsdp"]
    print(s.line())

Compute, per pipeline rank and micro batch of T = micro batch x seq / cp tokens, at the rates of
moelab.planner.rates (measured on one H200, carried to the GPU kind by datasheet ratios):
- matmul FLOPs from moelab.planner.flops: dense (attention projections, dense FFNs, router, shared experts) at the
  dense rate, routed experts at the grouped-GEMM rate (balanced or learned routing), causal attention at the
  attention rate; elementwise work (norms, rotary, SwiGLU, residuals) per token x hidden x layer, the
  permutation per routed row x hidden, and the GPU's idle gaps per layer, at the times per element the
  compiled profile measured (x EAGER_FACTOR without train.compile).
- The LM head and loss (last stage), by backend.loss: full (logits, then the loss kernels: the in-place kernel's
  three passes over the logits at its measured bandwidth, moelab.backends.loss_kernel, or the compiled loss of the
  code before it) or chunked (its own kernels, the head's GEMMs in chunks); liger and cce are not modelled (timed
  as chunked, and said so).
- train.fp8: the experts' GEMMs (forward and dgrad e4m3, wgrad bf16) and the projections' (all three e4m3) at
  the rates the FP8 profile measured, plus its quantisation passes: the routed rows' and the projections'
  every micro batch, the expert weights' two e4m3 copies once per step (moelab.model.fp8_cache) or every micro
  batch where FSDP2 shards them; rowwise_lm_head: the head at the kernel check's FP8 / bf16 time.
- Recompute (train.activation_checkpointing): full reruns each block's forward (a third of its matmul FLOPs and,
  as assumed here, of its elementwise work) and its all-to-all; selective keeps the matmul and fused-attention
  outputs (moelab.model.recompute.SAVED_OPS) and what the dispatch delivered, so only the elementwise work and
  the eager attention path's scores run again (no exchange: issue 39).
- The optimizer reads p, g, m, v and writes p, m, v, the gradient norm reads g (2 x (parameter + gradient +
  state) bytes per trained parameter of the rank) at the measured bandwidth of train.optimizer's kernel (auto:
  the Triton AdamW, as on a CUDA machine with Triton); with train.grad_clip > 0, torch's AdamW also pays
  clipping's multiply (every gradient read and written at its measured rate), the Triton AdamW does it in its update;
  fp32 weights computing in bf16 on one GPU pay autocast's cast of every weight per micro batch.

Communication, and how much of it the schedule hides (Speed.hidden_s; parts_s holds what is exposed):
- Expert exchange: the plan's bytes per MoE layer by link (moelab.planner.dispatch: the flat all-to-all's row per
  routed expert, the hierarchical dispatch's copy per other node then rows inside the node, DeepEP's row per
  rank; 4 exchanges per layer and micro batch, 6 under full recompute); NVLink at the all-to-all rate measured
  here, InfiniBand at DeepEP's published internode share of the NIC (moelab.planner.rates.PUBLISHED); the flat
  exchange and DeepEP drive both links at once, the hierarchical one runs its collective between nodes and then
  the one inside; plus a fixed cost per collective (the counts' all-to-all and the device-to-host copy of the
  split sizes). The exchange blocks the compute that needs its rows: exposed, except with
  parallel.ep_overlap, where chunk 1's dispatch hides behind chunk 0's experts and chunk 0's combine behind
  chunk 1's, in each direction (moelab.parallel.expert_parallel).
- FSDP2 (moelab.planner.comm.fsdp_counts: what is gathered and reduced how often): all-gathers run on their own
  stream, each unit's issued as the previous unit computes (explicit prefetch, parallel.fsdp_prefetch=auto under
  EP; implicit otherwise, which under EP starts only after the dispatcher's host synchronisation, so the window
  is the experts' part of a block), and in backward one unit ahead; reduce-scatters run on their own stream
  behind the next unit's backward. Exposed: the first units' gathers of a pass (the root and first block, nothing
  computes before them), the last reduce-scatter (the root's, after the embedding's backward), and whatever
  exceeds the pass's compute. Under pp > 1 the stage reduces after its last backward and the compute stream
  waits for it (exposed), and its gathers are prefetched. The gathers' copy-out and the reduce-scatters' copy-in
  (chunk_cat, at the rate the CP=2 profile measured) run on the compute stream: exposed. Links: NVLink when the
  mesh fits in a node; across nodes NCCL runs one ring per NIC, so the node's InfiniBand links carry it together
  (at most NVLink's rate). DDP's bucketed all-reduce and the replicated experts' exchange run during the last
  micro batch's backward: hidden but for one layer's share.
- Pipeline: the slowest stage's micro batch sets the pace: step = m t + bubble, bubble = the plan's bubble
  fraction (pp - 1) / (vp m + pp - 1) of it; activations sent between stages on NVLink or InfiniBand, in line
  under 1F1B and GPipe (torch's single-stage schedules wait for each fused send / receive before computing),
  in flight under interleaved 1F1B (its runtime posts receives early and waits for sends at the end) but for
  the first receive and the last send.
- CP: the K/V all-gather and its gradient's all-reduce are in line with attention: exposed.
- TP (sequence parallel): a rank computes a tp-th of the micro batch; its all-gathers and reduce-scatters around
  attention and dense MLPs (moelab.planner.plan.tp_traffic) sit between the kernels that need them: exposed.
- Fixed costs: idle gaps per layer and micro batch and once per step (two profiles with 1 and 8 micro batches),
  and autograd's gradient accumulation from a step's second micro batch on (on one GPU without the token
  embedding's and the full loss's LM head's gradients: their backward adds them, moelab.backends.into_grad).
- Hidden communication costs compute nothing here (NCCL's share of the SMs and of HBM bandwidth is not
  modelled).
- backend.experts=sonic: the routed experts' GEMMs and row moves at torch's grouped path's figures times the ratios
  H100 profiles measured (rates.SONIC_MEASURED: moelab's tiles, or QuACK's default config for records of the code
  before them); on one GPU its GEMMs add the routed experts' gradients into .grad (no accumulation pass over them).
Not modelled: train.optimizer_overlap (one GPU: the step times its optimizer after the backward, as measured
within 1% of the overlapped step, gallery/perf-notes.md, issue 41 eighth step), async TP (collectives overlapped with the matmuls), kernel backends other than torch's grouped GEMM,
SonicMoE's and SDPA (te, grouped_gemm, triton_fused, flex), the liger / cce losses, shape-dependence of the rates
(all measured at the Qwen3-30B-A3B proxy's shapes).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from moelab.planner.flops import attention_flops_per_token, count_params
from moelab.planner.gpus import GPUKind, gpu_kind
from moelab.planner.loss import in_place
from moelab.planner.rates import (EAGER_FACTOR, GROUPED_FORWARD_TFLOPS, GROUPED_SHAPES, H200_MEASURED, PUBLISHED, Rates,
                                  SONIC_MEASURED, rates)

# Who adds backend.experts=sonic's routed-expert gradients into .grad on one GPU (Plan.sonic_wgrad): its weight-gradient
# GEMMs (moelab.backends.sonic, since af73383), or autograd's accumulation pass (the code before)
SONIC_WGRAD = ("gemm", "autograd")
# the tiles of backend.experts=sonic's GEMMs (Plan.sonic_tiles): moelab's (moelab.backends.sonic.TILES, since 756805e)
# or QuACK's default config for every GEMM (the code before)
SONIC_TILES = ("moelab", "quack")
# who adds the token embedding's and the full loss's LM head's gradients into .grad on one GPU (Plan.into_grad):
# their backward (moelab.backends.into_grad, since cba26db), or autograd's accumulation pass (the code before)
INTO_GRAD = ("moelab", "autograd")
# the gradient norm beside train.optimizer=adamw_triton (Plan.grad_norm): moelab's Triton pass (moelab.backends.grad_norm,
# since 3187545) or torch's foreach norm (the code before)
GRAD_NORM = ("triton", "torch")
# the experts' gradient norm on a one-GPU, one-micro-batch backend.experts=sonic step (Plan.expert_norm): summed by
# their weight-gradient GEMMs' epilogue (moelab.backends.sonic_squares, since d255f7c) or read by the norm's pass
EXPERT_NORM = ("gemm", "pass")
# backend.loss=full's loss kernels (Plan.full_loss): the in-place kernel (moelab.backends.loss_kernel, since 56f5afa)
# or the compiled loss (the code before, and the vocabulary-parallel loss under TP)
FULL_LOSS = ("kernel", "compiled")
# gradient clipping's multiply (train.grad_clip > 0, Plan.clip_multiply): "update" is today's code, in the Triton
# AdamW's update (TritonAdamW.clip_in_step, since fb2903b) and, beside torch's AdamW, a pass on torch's fast foreach
# path (grad_norm.scale_grads, since ccb44ef); "pass" is the code before, torch's multiply with its fp32 factor
CLIP_MULTIPLY = ("update", "pass")

COMM_PARTS = ("all_to_all", "tp", "cp", "pipeline_send", "fsdp", "fsdp_copies", "replicated")
COMPUTE_PARTS = ("dense_matmul", "expert_matmul", "attention", "elementwise", "head_loss", "fp8_quant")
PART_LABELS = {"dense_matmul": "dense matmuls", "expert_matmul": "expert matmuls", "attention": "attention",
               "elementwise": "elementwise/permute", "head_loss": "LM head + loss", "fp8_quant": "FP8 quantisation",
               "idle": "launch gaps", "all_to_all": "all-to-all", "cp": "CP K/V exchange",
               "pipeline_send": "pipeline send/recv", "bubble": "pipeline bubble", "fsdp": "FSDP gather/reduce",
               "fsdp_copies": "FSDP copy-in/out", "replicated": "DDP / replicated-expert all-reduce",
               "optimizer": "optimizer", "casts": "weight casts", "tp": "TP all-gather/reduce-scatter",
               "grad_accumulate": "gradient accumulation"}
_MODELLED_LOSSES = ("full", "chunked")


@dataclass
class Speed:
    """A predicted optimizer step on `gpus` GPUs of one kind: its time, its parts (seconds per step that add up
    to it: compute, and the communication left exposed by moelab's schedule), the communication it hides
    (hidden_s, not in the step), and the throughput that follows.

        s = plan(load_config("qwen3-moe-30b-a3b"), gpus=8, gpu="h100").speed
        s.line(); sum(s.parts_s.values()) == s.step_s; s.hidden_s["fsdp"]
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
    hidden_s: dict = field(default_factory=dict)  # communication hidden behind compute, seconds per step
    assumptions: list = field(default_factory=list)
    unmodelled: list = field(default_factory=list)  # what this config runs that the model times as something else
    settings: dict = field(default_factory=dict)  # the settings it modelled (loss, fp8, optimizer, compile)
    extrapolated: list = field(default_factory=list)  # kernels timed at a rate measured for another kind of shape
    # the same step if the schedule hid every communication term behind the compute (a bound, not moelab today)
    comm_hidden_tokens_per_s_per_gpu: float = 0.0
    recompute_s: float = 0.0  # of the step, the forward work activation checkpointing runs again

    def line(self) -> str:
        return (f"{self.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, {self.tflops_per_gpu:,.0f} TFLOPs/GPU, MFU "
                f"{100 * self.mfu:.0f}% on {self.gpus} x {self.gpu}; step {_secs(self.step_s)}, bottleneck "
                f"{PART_LABELS[self.bottleneck]}; {self.gpu_hours_per_billion_tokens:,.0f} GPU-hours per billion "
                "tokens")

    def bound_line(self) -> str:
        """Which term bounds the step, and the throughput if every communication term were hidden."""
        comm = sum(self.parts_s.get(k, 0.0) for k in COMM_PARTS)
        share = 100 * self.parts_s[self.bottleneck] / self.step_s
        return (f"{PART_LABELS[self.bottleneck]} bounds the step ({share:.0f}%); communication {_secs(comm)} exposed, {_secs(sum(self.hidden_s.values()))} hidden; with all of "
                f"it hidden {self.comm_hidden_tokens_per_s_per_gpu:,.0f} tokens/s/GPU "
                f"({self.comm_hidden_tokens_per_s_per_gpu / self.tokens_per_s_per_gpu:.2f}x)")

    def breakdown(self) -> str:
        parts = []
        for k, v in self.parts_s.items():
            hid = self.hidden_s.get(k, 0.0)
            if v > 0 or hid > 0:
                parts.append(f"{PART_LABELS[k]} {_secs(v)}" + (f" (+{_secs(hid)} hidden)" if hid > 0 else ""))
        return ", ".join(parts) + (f"; with all communication hidden {self.comm_hidden_tokens_per_s_per_gpu:,.0f} "
                                   "tokens/s/GPU")


def _secs(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{1e3 * s:.1f} ms"


def layer_flops(m) -> dict:
    """Matmul FLOPs per token (forward + backward, 6 x activated parameters) of each piece: a MoE block's dense
    matmuls (attention projections, router, shared experts) and routed experts, a dense block, the LM head, and
    the router alone (it stays bf16 under FP8)."""
    zero = count_params(dataclasses.replace(m, num_layers=0, num_dense_layers=0))
    moe = count_params(dataclasses.replace(m, num_layers=1, num_dense_layers=0))
    dense = count_params(dataclasses.replace(m, num_layers=1, num_dense_layers=1))
    routed = m.moe.top_k * moe.experts_total // m.moe.num_experts
    return {"moe_dense": 6 * (moe.activated - zero.activated - routed), "moe_experts": 6 * routed,
            "dense_layer": 6 * (dense.activated - zero.activated), "head": 6 * zero.activated,
            "router": 6 * m.hidden_size * m.moe.num_experts}


def predict(cfg, p, gpu: "str | GPUKind") -> Speed:
    """The step time of plan `p` (moelab.planner.plan.plan of `cfg`) on GPUs of kind `gpu`."""
    kind = gpu_kind(gpu)
    t, L = cfg.train, p.layout
    r = rates(kind, balanced=cfg.backend.fake_balanced_gate)
    m, g = p.micro_batches_per_step, kind.gpus_per_node
    # a ring collective spanning nodes runs one ring per NIC: each rank's bytes cross nodes on 1/g of the hops
    bw = lambda span: r.nvlink if span <= g or p.gpus <= g else min(r.nvlink, g * r.ib)  # noqa: E731
    ep = L["ep"]
    intra = (min(ep, g) - 1) / (ep - 1) if ep > 1 else 1.0
    per_rank = [_micro_batch(cfg, p, r, rank, layers) for rank, layers in enumerate(p.stage_layers)]
    slowest = max(per_rank, key=lambda x: sum(x["parts"].values()))
    mb_parts, hidden = slowest["parts"], {k: m * v for k, v in slowest["hidden"].items()}
    mb_parts["cp"] = p.comm["cp_bytes_per_step"] / m / bw(L["cp"])
    # stage neighbours are fsdp*cp*tp ranks apart: one NVLink or one InfiniBand link between them
    shard = L["fsdp"] * L["cp"] * L["tp"]
    mb_parts["pipeline_send"] = (p.comm["pipeline_send_bytes_per_step"] / m
                                 / (r.nvlink if L["pp"] * shard <= g or p.gpus <= g else r.ib))
    if L["vp"] > 1:  # the interleaved runtime posts receives early and waits for sends at the end: in flight
        send = mb_parts["pipeline_send"]  # behind other stages' compute but the first receive and the last send
        mb_parts["pipeline_send"] = min(send, 2 * send / m)
        hidden["pipeline_send"] = m * (send - mb_parts["pipeline_send"])
    # TP's sequence-parallel all-gathers and reduce-scatters sit between the kernels that need them: in line
    mb_parts["tp"] = p.comm["tp_bytes_per_step"] / m / bw(L["tp"])
    f = p.pipeline["bubble_fraction"]
    parts = {k: m * v for k, v in mb_parts.items()}
    parts["idle"] += r.idle_s_per_step  # the loss's and the optimizer's host work, once per step
    parts["bubble"] = m * sum(mb_parts.values()) * f / (1 - f)
    fsdp = _fsdp(cfg, p, r, bw, slowest)
    parts.update({"fsdp": fsdp["exposed"], "fsdp_copies": fsdp["copies"], "replicated": fsdp["replicated"]})
    hidden.update({"fsdp": fsdp["hidden"], "replicated": fsdp["replicated_hidden"]})
    passes, opt_kind = _memory_passes(cfg, p, r, m)
    parts.update(passes)
    step = sum(parts.values())
    comm = sum(parts[k] for k in COMM_PARTS) + sum(hidden.values())
    compute = sum(parts[k] for k in COMPUTE_PARTS)
    bound_step = step - sum(parts[k] for k in COMM_PARTS) + max(0.0, comm - compute)
    tokens = t.global_batch_size * t.seq_len / p.gpus / step
    tflops = tokens * p.flops_per_token / 1e12
    unmod = unmodelled(cfg)
    return Speed(gpu=kind.name, gpus=p.gpus, step_s=step, parts_s=parts, tokens_per_s_per_gpu=tokens,
                 tflops_per_gpu=tflops, mfu=tflops / kind.bf16_tflops, bottleneck=max(parts, key=parts.get),
                 gpu_hours_per_billion_tokens=1e9 / tokens / 3600, hidden_s={k: v for k, v in hidden.items() if v},
                 assumptions=_assumptions(cfg, kind, ep, intra, opt_kind, unmod), unmodelled=unmod,
                 settings={"loss": cfg.backend.loss, "fp8": t.fp8, "optimizer": opt_kind, "compile": t.compile,
                           "ep_dispatch": p.comm.get("ep_dispatch", "flat")},
                 extrapolated=extrapolated(cfg),
                 comm_hidden_tokens_per_s_per_gpu=tokens * step / bound_step,
                 recompute_s=m * slowest["recompute_s"] / (1 - f))


def _memory_passes(cfg, p, r: Rates, m: int) -> tuple[dict, str]:
    """The memory-bound passes of a step outside its `m` micro batches: ({"optimizer": the optimizer step,
    "grad_accumulate": adding later micro batches' gradients, "casts": on one GPU, parameters cast to a narrower
    compute dtype every micro batch} in seconds, the optimizer kind timed)."""
    t = cfg.train
    pb = 2 if t.param_dtype == "bfloat16" else 4
    mem = p.memory
    trained_bytes = mem["gradients"]  # a trained parameter's gradient is stored like the parameter
    opt_kind = "adamw" if t.optimizer == "adamw" else "adamw_triton"
    if opt_kind == "adamw_triton" and p.grad_norm == "triton":  # each kernel at its rate: AdamW reads p, g, m, v
        # and writes p, m, v; the norm's pass reads g
        passes = {"optimizer": (3 * trained_bytes + 2 * mem["optimizer"]) / r.optimizer[opt_kind]
                  + trained_bytes / r.grad_norm}
    else:  # torch's AdamW or torch's norm: the step with its norm at one measured rate (the same bytes)
        rate = r.optimizer["adamw_triton_torch_norm" if opt_kind == "adamw_triton" else opt_kind]
        passes = {"optimizer": 2 * (2 * trained_bytes + mem["optimizer"]) / rate}
    if (p.expert_norm == "gemm" and cfg.backend.experts == "sonic" and p.gpus == 1 and m == 1
            and not t.lora.rank and opt_kind == "adamw_triton" and p.grad_norm == "triton"):
        # the experts' gradients are not read by the norm's pass: their GEMMs summed the squares, at a fraction of it
        passes["optimizer"] -= (1 - r.norm_epilogue) * count_params(cfg.model).experts_total * pb / r.grad_norm
    if t.grad_clip > 0 and (opt_kind != "adamw_triton" or p.clip_multiply == "pass"):
        # clipping's multiply as a pass: each gradient read and written
        passes["optimizer"] += 2 * trained_bytes / (r.clip_pass if p.clip_multiply == "pass" else r.clip_foreach)
    passes["grad_accumulate"] = (m - 1) * 3 * _accumulated_bytes(cfg, p) / r.grad_accumulate
    a = 2 if t.dtype == "bfloat16" else 4
    passes["casts"] = m * mem["parameters"] / pb * (pb + a) / r.copy if a < pb and p.gpus == 1 else 0.0
    return passes, opt_kind


def _accumulated_bytes(cfg, p) -> float:
    """Gradient bytes autograd adds into from the second micro batch of a step on: the sharded gradients FSDP2's
    reduce-scatters return (and a plain rank's whole ones), or, reduced once per step, every wrapped unit's
    unsharded gradient in the reduce dtype (moelab.layout.dims.grad_sync); on one GPU with backend.experts=sonic,
    all but the routed experts'; on one GPU also without the token embedding's and (backend.loss=full) the LM head's,
    which their backward adds (moelab.backends.into_grad; Plan.into_grad)."""
    units = [u for u in p.comm.get("fsdp_units", []) if u["ranks"] > 1]
    if p.fsdp_grad_sync == "step" and units:
        return sum(u["count"] * u["params"] for u in units) * (2 if cfg.parallel.reduce_dtype == "bfloat16" else 4)
    if p.gpus > 1 or cfg.train.lora.rank:
        return p.memory["gradients"]
    pb, mdl = 2 if cfg.train.param_dtype == "bfloat16" else 4, cfg.model
    added = 0  # parameters whose backward adds into .grad itself
    if cfg.backend.experts == "sonic" and p.sonic_wgrad == "gemm":
        added += count_params(mdl).experts_total  # SonicMoE's weight-gradient GEMMs (moelab.backends.sonic)
    if p.into_grad == "moelab":  # the embedding's rows, and the full loss's head GEMM (moelab.backends.into_grad)
        full = cfg.backend.loss == "full"  # a tied weight: one gradient, added by its backward only with both
        added += mdl.vocab_size * mdl.hidden_size * (int(full) if mdl.tie_embeddings else 1 + int(full))
    return p.memory["gradients"] - added * pb


def _micro_batch(cfg, p, r: Rates, rank: int, layers: list[int]) -> dict:
    """One micro batch on pipeline rank `rank`: compute parts, exposed all-to-all, hidden all-to-all, and the
    forward / backward compute the FSDP overlap needs."""
    mdl, t, L = cfg.model, cfg.train, p.layout
    # a rank's share of the micro batch's work: its sequence shard (CP), and under TP a tp-th of every matmul,
    # attention head, routed row (the MoE layer routes each rank's sequence shard) and elementwise pass
    T = t.micro_batch_size * t.seq_len // L["cp"] / L["tp"]
    D, K, V = mdl.hidden_size, mdl.moe.top_k, mdl.vocab_size
    fl, ckpt = layer_flops(mdl), t.activation_checkpointing
    n_moe = sum(i >= mdl.num_dense_layers for i in layers)
    n_dense, last = len(layers) - n_moe, rank == L["pp"] - 1
    eager_attn = cfg.backend.attention == "eager" or (cfg.backend.attention != "flex" and (
        mdl.sliding_window or mdl.attention_sinks))
    rerun = 4 / 3  # a forward again: a third of the forward + backward work
    mm = rerun if ckpt == "full" else 1.0  # matmul outputs are kept under selective
    ew = rerun if ckpt != "none" else 1.0
    eager = 1.0 if t.compile else EAGER_FACTOR
    fp8 = t.fp8 != "off"
    dense_flops = n_moe * fl["moe_dense"] + n_dense * fl["dense_layer"]
    router = n_moe * fl["router"]
    attn_layer = attention_flops_per_token(mdl, t.seq_len) / mdl.num_layers  # the mean layer (windows averaged)
    # SonicMoE's experts (backend.experts=sonic): its GEMMs and what is left of the row moves, as measured against
    # torch's grouped path (rates.SONIC_MEASURED)
    sonic = {k: v for k, (v, _) in SONIC_MEASURED.items()} if cfg.backend.experts == "sonic" else {}
    if sonic and p.sonic_tiles == "quack":
        sonic["expert_matmul_ratio"] = sonic["expert_matmul_ratio_quack_tiles"]
    parts = {
        "dense_matmul": T * mm * (router / r.dense + (dense_flops - router) / (r.dense_fp8 if fp8 else r.dense)),
        "expert_matmul": T * mm * n_moe * fl["moe_experts"] / (r.grouped_fp8 if fp8 else r.grouped)
        * sonic.get("expert_matmul_ratio", 1.0),
        "attention": T * len(layers) * attn_layer * (rerun if ckpt == "full" or (ckpt == "selective" and eager_attn)
                                                     else 1.0) / r.attention,
        "elementwise": eager * ew * T * (len(layers) * D * r.per_element("elementwise_s") + n_moe * K * D
                                         * r.per_element("permute_s") * sonic.get("permute_ratio", 1.0)),
        "head_loss": _head_loss(cfg, r, T, fl["head"], V, p.full_loss) if last else 0.0,
        "fp8_quant": 0.0,
        "idle": len(layers) * r.idle_s_per_layer,
    }
    if fp8:
        cached = not any(u["name"].endswith("experts") or (L["ep"] == 1 and u["name"].endswith(("block", "blocks")))
                         for u in p.comm.get("fsdp_units", []))
        weights = 2 * n_moe * (count_params(dataclasses.replace(mdl, num_layers=1, num_dense_layers=0)).experts_total
                               // L["ep"]) * r.per_element("fp8_weight_quant_s")
        parts["fp8_quant"] = (eager * ew * T * (n_moe * K * D * r.per_element("fp8_expert_quant_s")
                                                + len(layers) * D * r.per_element("fp8_dense_quant_s"))
                              + weights / (p.micro_batches_per_step if cached else 1))
    # the expert all-to-all of each MoE layer: dispatch and combine, forward and backward, and again when the
    # recompute reruns the routed part
    a2a, hid = 0.0, 0.0
    if L["ep"] > 1 and n_moe:
        c = p.comm
        passes = c["exchanges_per_moe_layer"]
        over_nvlink = c["all_to_all_intra_node_bytes_per_moe_layer"] / passes / r.nvlink
        over_ib = c["all_to_all_inter_node_bytes_per_moe_layer"] / passes / r.ib
        # one exchange: NCCL's all_to_all (and DeepEP) drive both links at once; the hierarchical dispatch runs
        # its collective between nodes, then the one inside the node (each with its counts and host copy)
        x = over_nvlink + over_ib if c["ep_dispatch"] == "hierarchical" else max(over_nvlink, over_ib)
        a2a = n_moe * passes * (x + c["exchange_stages"] * r.exchange_s)
        if cfg.parallel.ep_overlap:  # per direction, two of the four half exchanges hide behind half the experts
            e_fwd = parts["expert_matmul"] / mm / 3 / n_moe
            windows = [e_fwd, 2 * e_fwd] + ([e_fwd] if ckpt == "full" else [0.0] if ckpt == "selective" else [])
            hid = n_moe * sum(2 * min(x / 2, w / 2) for w in windows)
            a2a -= hid
    parts["all_to_all"] = a2a
    compute = sum(parts[k] for k in COMPUTE_PARTS)
    # the recomputed forward: a quarter of each term the rerun multiplied by 4/3, and the all-to-all's extra passes
    rerun_terms = ["elementwise", "fp8_quant"] if ckpt != "none" else []
    rerun_terms += ["dense_matmul", "expert_matmul"] if ckpt == "full" else []
    rerun_terms += ["attention"] if ckpt == "full" or (ckpt == "selective" and eager_attn) else []
    again = sum(parts[k] for k in rerun_terms) / 4 + (a2a * 2 / 6 if ckpt == "full" else 0.0)
    return {"parts": parts, "hidden": {"all_to_all": hid}, "forward_s": compute / 3 / (mm if ckpt == "full" else 1),
            "backward_s": compute - compute / 3 / (mm if ckpt == "full" else 1),
            "experts_forward_s": parts["expert_matmul"] / mm / 3, "layers": len(layers), "recompute_s": again}


def _head_loss(cfg, r: Rates, T: int, head_flops: float, V: int, full_loss: str = "kernel") -> float:
    """The LM head's GEMMs and the loss kernels for one micro batch on the last stage (backend.loss; liger and
    cce, not modelled, as chunked; `full_loss`: Plan.full_loss)."""
    t = cfg.train
    head = T * head_flops / r.dense
    if t.fp8 == "rowwise_lm_head":
        head *= H200_MEASURED["fp8_head_factor"][0]
    eager = 1.0 if t.compile else EAGER_FACTOR
    if in_place(cfg, full_loss):  # two reads of the logits and one write
        return head + 3 * (2 if t.dtype == "bfloat16" else 4) * T * V / r.loss_kernel
    if cfg.backend.loss == "full":
        return head + eager * T * V * r.per_element("loss_full_s")
    return head * H200_MEASURED["chunked_head_factor"][0] + eager * T * V * r.per_element("loss_chunked_s")


def _fsdp(cfg, p, r: Rates, bw, mb: dict) -> dict:
    """FSDP2's collectives per step on the slowest rank: exposed and hidden seconds (module docstring), the
    copy-in / copy-out, and DDP / replicated-expert gradient exchanges."""
    L, m = p.layout, p.micro_batches_per_step
    exposed = hidden = copies = 0.0
    units = p.comm.get("fsdp_units", [])
    if units:
        # per unit row: seconds of one all-gather and of one reduce-scatter of one unit
        ag = {u["name"]: u["all_gather_bytes_per_step"] / max(u["count"] * u["gathers_per_micro_batch"] * m, 1e-12)
              / bw(u["ranks"]) for u in units}
        rs = {u["name"]: u["reduce_scatter_bytes_per_step"] / max(u["count"] * u["reduce_scatters_per_step"], 1e-12)
              / bw(u["ranks"]) for u in units}
        first = ag.get("root", 0.0) + ag.get("blocks", ag.get("last block", 0.0))
        first += ag.get("experts", ag.get("last experts", 0.0))
        total_ag = sum(u["all_gather_bytes_per_step"] / bw(u["ranks"]) for u in units)
        total_rs = sum(u["reduce_scatter_bytes_per_step"] / bw(u["ranks"]) for u in units)
        if L["pp"] == 1:
            prefetch = cfg.parallel.fsdp_prefetch
            explicit = prefetch == "explicit" or (prefetch == "auto" and L["ep"] > 1)
            window = mb["forward_s"] if explicit or L["ep"] == 1 else mb["experts_forward_s"]
            entries = {u["name"]: 2.0 if u["name"].endswith("experts") and cfg.parallel.ep_overlap else 1.0
                       for u in units}
            fwd = sum(u["count"] * entries[u["name"]] * ag[u["name"]] for u in units)  # one gather per entry
            bwd = total_ag / m - fwd + total_rs / m
            last_rs = rs.get("root", 0.0)
            per_mb = min(first, fwd) + max(0.0, fwd - first - window) + last_rs + max(0.0, bwd - last_rs
                                                                                    - mb["backward_s"])
            exposed = m * per_mb
        else:  # prefetched gathers but the first; the reduce after the last backward is waited for
            exposed = min(first, total_ag) + max(0.0, total_ag - first - m * (mb["forward_s"] + mb["backward_s"]))
            exposed += total_rs
        hidden = total_ag + total_rs - exposed
        copies = (p.comm["fsdp_gather_copied_bytes_per_step"] / r.copy
                  + p.comm["fsdp_reduce_copied_bytes_per_step"] / r.reduce_copy)
    rep = (p.comm.get("ddp_all_reduce_bytes_per_step", 0) + p.comm.get("expert_grad_bytes_per_step", 0)) / bw(
        L["fsdp"] * L["cp"])
    layer = 1 / max(mb["layers"], 1)  # the share of the backward after the last layer's gradients are ready
    rep_exposed = max(rep - mb["backward_s"] * (1 - layer), rep * layer) if rep else 0.0
    return {"exposed": exposed, "hidden": hidden, "copies": copies, "replicated": rep_exposed,
            "replicated_hidden": rep - rep_exposed}


def unmodelled(cfg) -> list[str]:
    """What `cfg` runs that the model times as something else (its rates are torch's grouped GEMM, SDPA, bf16 or
    moelab's rowwise FP8, and the full or chunked loss)."""
    m, b, out = cfg.model, cfg.backend, []
    if cfg.train.dtype != "bfloat16":
        out.append(f"train.dtype={cfg.train.dtype}: fp32 matmuls, timed at the bf16 rates")
    if b.loss not in _MODELLED_LOSSES:
        out.append(f"backend.loss={b.loss}: its kernels were not profiled here; timed as the chunked loss")
    if b.attention == "eager" or (b.attention != "flex" and (m.sliding_window or m.attention_sinks)):
        out.append("attention: sliding windows / sinks run moelab's eager attention (scores materialised), timed "
                   "at SDPA's rate")
    elif b.attention not in ("sdpa", "auto"):  # auto: FA4's kernels where installed, timed at SDPA's measured rate
        out.append(f"backend.attention={b.attention}: timed at SDPA's rate")
    if b.experts in ("loop", "grouped_gemm", "te", "triton_fused"):
        out.append(f"backend.experts={b.experts}: timed at torch's grouped GEMM rate")
    if b.dispatcher == "deepep":
        out.append("backend.dispatcher=deepep: its kernels timed as NCCL's all-to-all of the same bytes")
    if b.te_fp8 != "off":
        out.append(f"backend.te_fp8={b.te_fp8}: Transformer Engine's FP8 timed as bf16")
    return out


def extrapolated(cfg) -> list[str]:
    """Kernels of `cfg` the model times at a rate measured on another kind of shape (the rates come from the
    Qwen3-30B-A3B proxy: GQA attention with head dim 128)."""
    m, out = cfg.model, []
    if cfg.backend.experts == "sonic":
        out.append("backend.experts=sonic: torch's grouped-path figures times SonicMoE's ratios from one H100 "
                   "profile pair at the proxy's shape (rates.SONIC_MEASURED); its host gaps (graph breaks) as the "
                   "grouped path's")
    shape = grouped_shape_ratio(cfg)
    if shape:
        out.append(f"routed experts at the grouped rate of the Qwen3 proxy's profile; their forward GEMMs at this "
                   f"shape ran {shape:.2f}x the proxy's on an H100 ({GROUPED_SHAPES})")
    if m.attention == "mla":
        out.append(f"MLA attention (q/k head dim {m.qk_nope_head_dim + m.qk_rope_head_dim}, v {m.v_head_dim}) at "
                   "the rate SDPA reached on GQA with head dim 128")
    if cfg.parallel.cp > 1:
        out.append("CP attention (two query chunks per rank, each causal against the keys up to its end) at the rate "
                   "SDPA reached on whole sequences (the CP=2 profile, logs/...profile-cp2-seq8192-eager.txt, ran "
                   "FlashAttention-2's kernels there, not cuDNN's)")
    return out


def grouped_shape_ratio(cfg) -> float | None:
    """The measured forward grouped-GEMM rate at `cfg`'s expert shape over the proxy's (rates.GROUPED_FORWARD_TFLOPS:
    the same hidden and expert width, the nearest rows per local expert), or None where none was measured or the
    shape is the proxy's."""
    import math

    m, L, t = cfg.model, cfg.parallel, cfg.train
    rows = t.micro_batch_size * t.seq_len // L.cp // L.tp * m.moe.top_k * L.ep // m.moe.num_experts
    near = [k for k in GROUPED_FORWARD_TFLOPS if k[:2] == (m.hidden_size, m.moe.expert_ffn_size)]
    if not near or rows < 1:
        return None
    key = min(near, key=lambda k: abs(math.log(k[2] / rows)))
    proxy = GROUPED_FORWARD_TFLOPS[(2048, 768, 512)]
    return None if key == (2048, 768, 512) else GROUPED_FORWARD_TFLOPS[key] / proxy


def _assumptions(cfg, kind: GPUKind, ep: int, intra: float, opt_kind: str, unmod: list[str]) -> list[str]:
    v = {k: x for k, (x, _) in H200_MEASURED.items()}
    out = [f"speed on {kind.name}: kernel rates measured on one H200 (moelab.planner.rates.H200_MEASURED: dense "
           f"{v['dense_tflops']:.0f}, grouped {v['grouped_tflops']:.0f} (learned router), attention "
           f"{v['attention_tflops']:.0f} TFLOP/s; FP8 dense {v['dense_fp8_tflops']:.0f}, grouped "
           f"{v['grouped_fp8_tflops']:.0f}), scaled by the datasheet ratio (compute by the peak, memory-bound terms by "
           "HBM bandwidth, links by link bandwidth); optimizer " + opt_kind,
           "speed: overlap as moelab's schedule runs it: FSDP2 gathers prefetched and reduce-scatters behind the next "
           "unit's backward (the first gathers and the last reduce of a pass exposed; under pp the reduce after "
           "the last backward exposed), the expert all-to-all in line "
           + ("(parallel.ep_overlap: half of each direction's exchanges behind half the experts)"
              if cfg.parallel.ep_overlap else "(parallel.ep_overlap off)")
           + ", TP and CP in line, pipeline sends in line (1F1B) or in flight (interleaved); hidden communication "
           "slows no kernel; InfiniBand at DeepEP's published internode share of its 400 Gb/s NIC "
           f"({100 * PUBLISHED['ib_fraction'][0]:.0f}%)"]
    if ep > 1:
        out.append(f"speed: EP group of {ep} consecutive ranks over {kind.gpus_per_node}-GPU nodes: "
                   f"{100 * intra:.0f}% of its all-to-all partners on the same node")
    if cfg.train.activation_checkpointing != "none":
        out.append("speed: recompute reruns a forward: a third of the block's work and its expert exchange (full), "
                   "or its elementwise work only (selective keeps matmul and fused-attention outputs and what the "
                   "dispatch delivered)")
    return (out + [f"speed, extrapolated: {text}" for text in extrapolated(cfg)]
            + [f"speed, not modelled: {text}" for text in unmod])
