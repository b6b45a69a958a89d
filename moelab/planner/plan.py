"""The analytic planner: parameters, FLOPs, memory per GPU, communication and a fits/does-not-fit verdict for a
config on a number of GPUs, from arithmetic alone (no torch.distributed, no GPU: plans a 671B model on a laptop).

    p = plan(load_config("qwen3-moe-30b-a3b"), gpus=8)
    print(p)                       # a text table; in Jupyter the object renders as an HTML table
    p.to_dict()["memory_per_gpu_bytes"]

What it assumes (also listed in ``Plan.assumptions`` so that every printed plan says it):
- Parameter counts and FLOPs come from moelab.planner.flops (``count_params``, ``flops_per_token``, FLOPS_CONVENTION).
- Training state per parameter: fp32 master weights (4 B; under FSDP2 mixed precision the sharded fp32
  parameters are the master copy), fp32 gradients (4 B; reduce dtype fp32), AdamW m and v in fp32 (8 B);
  train.optimizer_state=bf16_moments keeps m and v in bf16 (4 B); with train.param_dtype=bfloat16 all three
  are bf16 (2 + 2 + 4 B) and there is no fp32 master copy (moelab.planner.states).
  With train.dtype=bfloat16 the compute copies are bf16: FSDP2 all-gathers one layer at a time (plus one
  prefetched), a single unsharded rank with fp32 weights keeps autocast's bf16 copy of every weight.
- TP (parallel.tp, sequence parallel): a rank holds a tp-th of the dense weights, FSDP2 shards that over the
  fsdp*cp ranks; a tp-th of each block's activations with the all-gathered inputs of attention, a dense MLP and
  column/row shared experts whole (a MoE layer routes its sequence shard: tp_gathered_sublayers), and a tp-th
  of the logits (vocabulary-parallel head); its collectives: tp_traffic.
- Expert exchange: the rows the dispatcher that runs sends per token, by link (moelab.planner.dispatch; flat,
  hierarchical across nodes, DeepEP), 4 exchanges per MoE layer and micro batch, 6 under full recompute.
- A plan that does not fit names a setting that fits (moelab.planner.fixes) and predicts no speed.
- Sharding: dense parameters over the fsdp*cp*tp ranks of a pipeline stage; experts over ep, then over the
  expert-FSDP mesh efsdp = fsdp*cp*tp/ep; layers over pp*vp virtual stages as the pipeline splits them
  (balancing matmul cost, the LM head counted on the last stage; moelab.planner.stages.stage_layers), the
  embedding on the first stage, the final norm and LM head on the last.
- Activations per micro batch are counted tensor by tensor from what autograd keeps in moelab.model, eager or
  as torch.compile's partitioner keeps it (train.compile), for the router that runs (a learned one keeps its
  scores and what its weights' gradient reads: the expert outputs under EP), EP's exchange, CP's gathered keys,
  and LoRA's frozen matmuls (whose inputs are not kept) (moelab.planner.saved); "full" checkpointing keeps
  each block's input and recomputes one block at a time; "selective" keeps matmul outputs and the router's,
  recomputing the rest one block at a time (moelab.planner.recompute).
- train.fp8 with several micro batches per step keeps an e4m3 cache of every local expert weight (two
  operands, 2 B per parameter; moelab.planner.fp8).
- Pipelines hold several micro batches in flight: 1F1B min(m, pp - rank); interleaved Megatron's warm-up
  (2*(pp - rank - 1) + (vp - 1)*pp + 1 chunk micro batches); GPipe all m. What checkpointing keeps is held
  for each of them; the recompute working set is one block's, once (one backward runs at a time).
- The peak is the sum of every term when a rank runs several micro batches per step (full gradients sit next
  to the activations from the second one on); with one micro batch per step it is the other terms plus the
  larger of gradients and activations + logits (gradients grow in backward as activations are freed).
- The verdict keeps 5% of the GPU's memory for the CUDA context, NCCL buffers and allocator fragmentation.
- A start from a checkpoint (train.init_from) has a second peak while loading, the weights plus the largest
  tensor slice (host: 12 B per element of it; moelab.planner.loading): ``loading``; the larger peak counts.
"""
from __future__ import annotations

import dataclasses
import html
import math
from dataclasses import dataclass, field

from moelab.config import Config, ConfigError
from moelab.layout.dims import ParallelDims, grad_sync, hierarchical_dispatch
from moelab.planner.comm import (_replication_comm, check_one_rank, dispatch_ranks_per_token, fsdp_traffic,
                                 fsdp_units, wrapped)
from moelab.planner.flops import FLOPS_CONVENTION, block_params, count_params, flops_per_token
from moelab.planner.loading import loading_bytes
from moelab.planner.dispatch import exchange_rows
from moelab.planner.fixes import fitting_change, set_text
from moelab.planner.loss import logits_bytes, loss_assumption
from moelab.planner.lora import lora_params
from moelab.planner.fp8 import fp8_cache_bytes
from moelab.planner.gathered import gathered_params, held_unsharded
from moelab.layout.shapes import layer_window
from moelab.planner.gpus import gpu_kind
from moelab.planner.speed import (CLIP_MULTIPLY, EXPERT_NORM, FULL_LOSS, GRAD_NORM, INTO_GRAD, SONIC_TILES, SONIC_WGRAD,
                                  predict as predict_speed)
from moelab.planner.recompute import layer_activations, selective_kept_per_token
from moelab.planner.saved import LOCAL_WEIGHTING, saved_per_token
from moelab.planner.stages import split_layers
from moelab.planner.states import describe as describe_states, state_bytes
from moelab.planner.units import GiB, bytes_text as _bytes, count_text as _num, flop_text as _flop

DEFAULT_GPU_MEMORY_GB = 80.0  # an H100 80GB, the reference table's GPU
RESERVE = 0.05  # share of GPU memory kept for the CUDA context, NCCL buffers and fragmentation

MEMORY_TERMS = ("parameters", "gradients", "optimizer", "gathered_params", "held_unsharded", "fp8_weights",
                "activations", "logits", "dispatcher")
# how the table names each memory term ("parameters" there is a count; the memory they take is "weights")
MEMORY_LABELS = {"parameters": "weights", "gradients": "gradients", "optimizer": "optimizer state",
                 "gathered_params": "gathered weights", "held_unsharded": "unsharded between micro batches",
                 "fp8_weights": "FP8 expert weights", "activations": "activations", "logits": "logits",
                 "dispatcher": "dispatcher buffers"}
_TERM_HELP = {
    "parameters": "shard more: more GPUs (parallel.fsdp), a larger parallel.ep, or a larger parallel.pp",
    "gradients": "shard more: more GPUs (parallel.fsdp), a larger parallel.ep, or a larger parallel.pp",
    "optimizer": "shard more: more GPUs (parallel.fsdp), a larger parallel.ep, or a larger parallel.pp",
    "gathered_params": "a larger parallel.ep (fewer local experts gathered per layer) or more layers per stage",
    "fp8_weights": "a larger parallel.ep or parallel.pp (fewer local experts to cache), or train.fp8=off",
    "held_unsharded": "set parallel.fsdp_grad_sync=micro_batch (pp = 1: reduce-scatter every micro batch), or hold "
                      "less per rank: a larger parallel.ep or parallel.pp",
    "activations": "set train.activation_checkpointing=full, lower train.micro_batch_size or train.seq_len, "
                   "or use parallel.cp",
    "logits": "lower train.micro_batch_size or train.seq_len (logits are micro batch x sequence x vocabulary), "
              "or use parallel.cp",
    "dispatcher": "lower train.micro_batch_size (the all-to-all buffers hold tokens x top_k rows)",
}


@dataclass
class Plan:
    """The planner's answer for one config on one layout. Byte figures are per GPU, for the pipeline rank that
    needs the most memory (``stage``); ``memory`` is the breakdown of ``memory_per_gpu_bytes``.

        p = plan(load_config("tiny")); p.fits, p.memory["activations"], print(p)
    """
    name: str
    gpus: int
    layout: dict
    dtype: str
    activation_checkpointing: str
    seq_len: int
    micro_batch_size: int
    global_batch_size: int
    micro_batches_per_step: int
    total_params: int
    activated_params: int
    flops_per_token: float
    flops_convention: str
    params_per_gpu: int
    stage: int
    stage_layers: list
    stage_params: list
    memory: dict
    memory_per_gpu_bytes: int
    activations_per_micro_batch: dict
    activation_bytes_per_token_per_layer: dict
    comm: dict
    pipeline: dict
    gpu_memory_gb: float
    gpu_memory_source: str
    fits: bool
    biggest_term: str
    verdict: str
    assumptions: list = field(default_factory=list)
    loading: dict | None = None  # train.init_from: the peak while loading (moelab.planner.loading)
    placing_bytes: int = 0  # DDP / replicated experts: the stage allocated whole (experts by EP) before wrapping
    trained_params: int = 0  # parameters with gradients and optimizer state (fewer than total_params under LoRA)
    speed: object = None  # the predicted step on a GPU kind (moelab.planner.speed.Speed), with plan(..., gpu=)
    # when FSDP2 reduces gradients: "micro_batch" (every one) or "step" (the last; moelab.layout.dims.grad_sync)
    fsdp_grad_sync: str = "micro_batch"
    # who adds backend.experts=sonic's expert gradients into .grad on one GPU: "gemm" (its weight-gradient GEMMs,
    # moelab.backends.sonic) or "autograd" (the code before af73383; planned for records measured with it)
    sonic_wgrad: str = "gemm"
    # backend.experts=sonic's GEMM tiles: "moelab" (moelab.backends.sonic.TILES) or "quack" (QuACK's default config,
    # the code before 756805e; planned for records measured with it)
    sonic_tiles: str = "moelab"
    # who adds the token embedding's and the full loss's head's gradients into .grad on one GPU: "moelab" (their
    # backward, moelab.backends.into_grad) or "autograd" (the code before cba26db; planned for records measured with it)
    into_grad: str = "moelab"
    # the gradient norm beside the Triton AdamW: "triton" (moelab.backends.grad_norm) or "torch" (torch's foreach
    # norm, the code before 3187545; planned for records measured with it)
    grad_norm: str = "triton"
    # the experts' gradient norm on one GPU, one micro batch, backend.experts=sonic: "gemm" (their GEMMs' epilogue,
    # moelab.backends.sonic_squares) or "pass" (the norm's pass, the code before d255f7c; planned for records of it)
    expert_norm: str = "gemm"
    # backend.loss=full's loss: "kernel" (the in-place kernel, moelab.backends.loss_kernel: the logits' gradient
    # written over them) or "compiled" (the compiled loss, the code before 56f5afa; planned for records measured with it)
    full_loss: str = "kernel"
    # gradient clipping's multiply: "update" (today's: in the Triton AdamW's update, TritonAdamW.clip_in_step;
    # beside torch's AdamW a pass on torch's fast foreach path, grad_norm.scale_grads) or "pass" (torch's multiply
    # with its fp32 factor, the code before fb2903b; planned for records measured with it)
    clip_multiply: str = "update"
    loss: str = ""  # backend.loss as planned (auto resolved for the GPU)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ views
    def _rows(self) -> list[tuple[str, str]]:
        """(label, text) rows: sizes in the unit that suits them (a tiny model reads in KiB and MFLOP)."""
        L = self.layout
        rows = [
            ("config", self.name),
            ("GPUs / layout", f"{self.gpus}  [TP {L['tp']}, PP {L['pp']}, CP {L['cp']}, EP {L['ep']}, VP {L['vp']}, "
                              f"FSDP {L['fsdp']}]  expert-FSDP {L['efsdp']}"),
            ("parameters", f"{_num(self.total_params)} total, {_num(self.activated_params)} activated per token"
                           + (f", {_num(self.trained_params)} trained (LoRA)" if self.trained_params < self.total_params
                              else "")),
            ("FLOPs per token", f"{_flop(self.flops_per_token)} at seq {self.seq_len} ({self.flops_convention})"),
            ("batch", f"global {self.global_batch_size} x seq {self.seq_len}, micro batch {self.micro_batch_size}, "
                      f"{self.micro_batches_per_step} micro batches per rank per step"),
            ("parameters per GPU", f"{_num(self.params_per_gpu)} (pipeline rank {self.stage})"),
            ("memory per GPU", f"{_bytes(self.memory_per_gpu_bytes)} of {self.gpu_memory_gb:.1f} GiB "
                               f"({self.gpu_memory_source})"),
        ]
        rows += [(f"  {MEMORY_LABELS[term]}", _bytes(self.memory[term])) for term in MEMORY_TERMS]
        if self.placing_bytes:
            rows.append(("  while placing", f"{_bytes(self.placing_bytes)} (dense weights whole, experts split by "
                                            f"EP, before DDP / FSDP2 wrap them)"))
        if self.loading:
            rows.append(("  while loading", f"{_bytes(self.loading['device_bytes'])} (weights + the largest slice), "
                                            f"host {_bytes(self.loading['host_bytes'])} per rank"))
        a = self.activations_per_micro_batch
        rows.append(("activations / micro batch", f"none {_bytes(a['none'])}, selective {_bytes(a['selective'])}, "
                                                  f"full {_bytes(a['full'])} (using: {self.activation_checkpointing})"))
        c = self.comm
        rows += [
            ("all-to-all per MoE layer", f"{_bytes(c['all_to_all_bytes_per_moe_layer'])} fwd+bwd per micro batch"),
            ("comm per step per GPU", f"all-to-all {_bytes(c['all_to_all_bytes_per_step'])}, FSDP all-gather "
                                      f"{_bytes(c['fsdp_all_gather_bytes_per_step'])}, reduce-scatter "
                                      f"{_bytes(c['fsdp_reduce_scatter_bytes_per_step'])}, pipeline "
                                      f"{_bytes(c['pipeline_send_bytes_per_step'])}, cp "
                                      f"{_bytes(c['cp_bytes_per_step'])}"),
        ]
        if c["fsdp_all_gathers_per_step"] or c["fsdp_reduce_scatters_per_step"]:
            rows.append(("FSDP2 as scheduled", f"{c['fsdp_all_gathers_per_step']} all-gathers "
                                               f"({_bytes(c['fsdp_all_gather_bytes_per_step'])}), "
                                               f"{c['fsdp_reduce_scatters_per_step']} reduce-scatters "
                                               f"({_bytes(c['fsdp_reduce_scatter_bytes_per_step'])}) per step, "
                                               "gradients reduced "
                                               + ("once per step" if self.fsdp_grad_sync == "step"
                                                  else "every micro batch")))
        if c.get("ddp_all_reduce_bytes_per_step") or c.get("expert_grad_bytes_per_step"):
            rows.append(("replicated grads per step", f"DDP all-reduce {_bytes(c['ddp_all_reduce_bytes_per_step'])}, "
                                                      f"experts {_bytes(c['expert_grad_bytes_per_step'])}"))
        if self.layout["pp"] > 1:
            pl = self.pipeline
            rows.append(("pipeline", f"{pl['schedule']}, bubble {100 * pl['bubble_fraction']:.1f}%, "
                                     f"{self.pipeline['in_flight_micro_batches']:g} micro batches in flight on rank "
                                     f"{self.stage}"))
        rows.append(("verdict", self.verdict))
        if not self.fits:
            rows.append(("speed (predicted)", "none: the layout does not fit; plan the change the verdict names"))
        if self.speed:
            rows += [("speed (predicted)", self.speed.line()), ("  step parts", self.speed.breakdown()),
                     ("  bound", self.speed.bound_line())]
        rows += [("assumes" if i == 0 else "", text) for i, text in enumerate(self.assumptions)]
        return rows

    def __str__(self) -> str:
        rows = self._rows()
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

    def _repr_html_(self) -> str:
        color = "#1a7f37" if self.fits else "#cf222e"
        body = "".join(
            f"<tr><td style='text-align:left;padding:1px 8px'>{html.escape(k.strip())}</td>"
            f"<td style='text-align:left;padding:1px 8px"
            + (f";color:{color};font-weight:bold" if k == "verdict" else "")
            + f"'>{html.escape(v)}</td></tr>"
            for k, v in self._rows())
        return f"<table style='font-size:12px'>{body}</table>"


# ---------------------------------------------------------------------- inputs
def default_world(cfg: Config) -> int:
    """The smallest world the layout names: tp*pp*cp*fsdp, with fsdp=-1 read as the least that holds ep."""
    p = cfg.parallel
    fsdp = p.fsdp if p.fsdp != -1 else p.ep // math.gcd(p.ep, p.cp * p.tp)
    return p.tp * p.pp * p.cp * fsdp


def gpu_memory(gpu_memory_gb: float | None) -> tuple[float, str]:
    """(GiB, where the figure came from): given, else the current CUDA device, else an 80 GB H100."""
    if gpu_memory_gb is not None:
        if gpu_memory_gb <= 0:
            raise ConfigError(f"gpu_memory_gb={gpu_memory_gb!r}: must be > 0")
        return float(gpu_memory_gb), "given"
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            return props.total_memory / GiB, f"the current CUDA device, {props.name}"
    except Exception:  # no usable CUDA: plan for the reference GPU
        pass
    return DEFAULT_GPU_MEMORY_GB, "default: an 80 GB H100, the reference table's GPU; no CUDA device here"


def _peak(mem: dict, micro_batches: int) -> int:
    """Peak bytes of one rank. From the second micro batch of a step on, full gradients sit next to a micro
    batch's activations, so all terms add up; with one micro batch per step, gradients grow during backward
    as activations are freed, so the peak is the larger of the two sides."""
    if micro_batches > 1:
        return sum(mem.values())
    rest = sum(v for k, v in mem.items() if k not in ("gradients", "activations", "logits"))
    return rest + max(mem["gradients"], mem["activations"] + mem["logits"])


def _in_flight(p, rank: int, m: int) -> float:
    """Micro batches (in units of the rank's whole layer set) whose activations a pipeline rank holds at once."""
    if p.pp == 1:
        return 1.0
    if p.pp_schedule == "gpipe":
        return float(m)
    if p.pp_schedule == "interleaved_1f1b" and p.vp > 1:
        chunks = min(2 * (p.pp - rank - 1) + (p.vp - 1) * p.pp + 1, m * p.vp)
        return chunks / p.vp
    return float(min(m, p.pp - rank))


# ---------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class _Sizes:
    """What every part of the plan derives from the config and the validated layout."""
    cfg: Config
    p: object  # the resolved ParallelConfig
    world: int
    shard: int  # ranks sharing one pipeline stage (fsdp*cp*tp)
    efsdp: int  # ranks holding the same experts
    m: int  # micro batches per rank per step
    a: int  # compute dtype bytes
    pb: int  # stored parameter (and gradient) bytes
    mb: int  # AdamW's two moments, bytes per trained parameter (moelab.planner.states)
    T: int  # tokens of one micro batch on one rank
    one_rank: str = "plain"  # FSDP2 on one-rank meshes, by the code planned (moelab.planner.comm.FSDP_ONE_RANK)
    weighting: str = "experts"  # where the local dispatcher weights, by the code planned (planner.saved)
    g: int = 8  # GPUs per node (the GPU kind's, or parallel.ranks_per_node)
    full_loss: str = "kernel"  # backend.loss=full's loss, by the code planned (Plan.full_loss)


def _sizes(cfg: Config, world: int, one_rank: str = "plain", weighting: str = "experts", g: int = 8,
           full_loss: str = "kernel") -> _Sizes:
    p = ParallelDims.build(cfg, world).layout
    t = cfg.train
    shard = p.fsdp * p.cp * p.tp
    return _Sizes(cfg, p, world, shard, shard // p.ep, t.global_batch_size // (t.micro_batch_size * p.fsdp),
                  2 if t.dtype == "bfloat16" else 4, state_bytes(t).weight, state_bytes(t).moments,
                  t.micro_batch_size * t.seq_len // p.cp, one_rank, weighting,
                  getattr(p, "ranks_per_node", 0) or g, full_loss)


def plan(cfg: Config, gpus: int | None = None, gpu_memory_gb: float | None = None, gpu: str | None = None, *,
         fsdp_one_rank: str = "plain", local_weighting: str = "experts", sonic_wgrad: str = "gemm",
         sonic_tiles: str = "moelab", into_grad: str = "moelab", grad_norm: str = "triton",
         expert_norm: str = "gemm", full_loss: str = "kernel", clip_multiply: str = "update",
         suggest: bool = True) -> Plan:
    """Plan `cfg` on `gpus` ranks (default: the world its layout names) against `gpu_memory_gb` per GPU:
    memory per pipeline rank (_memory), then communication (_communication), then the verdict (_verdict); with
    `gpu` ("h100", "h200": moelab.planner.gpus) also the predicted step time (moelab.planner.speed), and the
    kind's memory when `gpu_memory_gb` is not given. `fsdp_one_rank`: the code planned, "plain" (moelab's) or
    "wrapped" (before 6131a2c FSDP2 wrapped one-rank meshes too; moelab.planner.comm.FSDP_ONE_RANK), for
    records measured with old code (moelab.gallery.records.planner_options); `local_weighting` likewise: "experts"
    (moelab's) or "combine" (before a3f8c38; moelab.planner.saved.LOCAL_WEIGHTING); `sonic_wgrad` likewise: "gemm"
    (moelab's) or "autograd" (before af73383: Plan.sonic_wgrad); `sonic_tiles` likewise: "moelab" or "quack" (before
    756805e: Plan.sonic_tiles); `into_grad` likewise: "moelab" or "autograd" (before cba26db: Plan.into_grad);
    `grad_norm` likewise: "triton" or "torch" (before 3187545: Plan.grad_norm); `expert_norm` likewise: "gemm" or
    "pass" (before d255f7c: Plan.expert_norm); `full_loss` likewise: "kernel" or "compiled" (before 56f5afa:
    Plan.full_loss); `clip_multiply` likewise: "update" or "pass" (before fb2903b: Plan.clip_multiply). A plan that
    does not fit
    predicts no speed and, with `suggest`, names a setting that fits (moelab.planner.fixes).

        plan(load_config("qwen3-moe-30b-a3b"), gpus=8).fits
        plan(load_config("tiny"), gpu_memory_gb=0.001).verdict   # 'does not fit: ...'
    """
    if not isinstance(cfg, Config):
        from moelab.config import load_config

        cfg = load_config(cfg)
    world = gpus if gpus is not None else default_world(cfg)
    check_one_rank(fsdp_one_rank)
    for name, value, (now, then), commit in (("local_weighting", local_weighting, LOCAL_WEIGHTING, "a3f8c38"),
                                             ("sonic_wgrad", sonic_wgrad, SONIC_WGRAD, "af73383"),
                                             ("sonic_tiles", sonic_tiles, SONIC_TILES, "756805e"),
                                             ("into_grad", into_grad, INTO_GRAD, "cba26db"),
                                             ("grad_norm", grad_norm, GRAD_NORM, "3187545"),
                                             ("expert_norm", expert_norm, EXPERT_NORM, "d255f7c"),
                                             ("full_loss", full_loss, FULL_LOSS, "56f5afa"),
                                             ("clip_multiply", clip_multiply, CLIP_MULTIPLY, "fb2903b")):
        if value not in (now, then):
            raise ConfigError(f"{name}={value!r}: must be one of {now}, {then} ({now}: moelab's code; {then}: the "
                              f"code before {commit}, for records measured with it)")
    if world < 1:
        raise ConfigError(f"gpus={world!r}: must be >= 1")
    asked = cfg
    if cfg.backend.loss == "auto":  # planned as the loss the run will take (a GPU run: CUDA assumed)
        mem_gb = gpu_memory_gb if gpu_memory_gb or not gpu else gpu_kind(gpu).memory_gb
        cfg = cfg.replace(**{"backend.loss": resolve_loss(cfg, world, mem_gb)})
    kind = gpu_kind(gpu) if gpu else None
    z = _sizes(cfg, world, fsdp_one_rank, local_weighting, kind.gpus_per_node if kind else 8, full_loss)
    mdl, t, p = cfg.model, cfg.train, z.p
    ranks = split_layers(mdl, p.pp, p.vp)
    per_rank, logit_bytes = _memory(z, ranks)
    worst = max(per_rank, key=lambda x: x["total"])
    comm = _communication(z, worst)
    capacity_gb, source = gpu_memory(gpu_memory_gb if gpu_memory_gb or not kind else kind.memory_gb)
    source = kind.name if kind and gpu_memory_gb is None else source
    fits, biggest, verdict = _verdict(z, worst, capacity_gb)
    if not fits and suggest:
        verdict += _fix_text(asked, world, capacity_gb, biggest, dict(fsdp_one_rank=fsdp_one_rank,
                                                                      local_weighting=local_weighting,
                                                                      sonic_wgrad=sonic_wgrad,
                                                                      sonic_tiles=sonic_tiles,
                                                                      into_grad=into_grad, grad_norm=grad_norm,
                                                                      expert_norm=expert_norm,
                                                                      full_loss=full_loss,
                                                                      clip_multiply=clip_multiply))
    act_moe, act_dense = saved_per_token(cfg, True, z.a, weighting=z.weighting), saved_per_token(cfg, False, z.a)
    per_tok = {"attention": act_moe["attention"], "moe": act_moe["ffn"], "dense_ffn": act_dense["ffn"],
               "block_input": act_moe["input"], "logits": logit_bytes}
    counts = count_params(mdl)
    result = Plan(
        name=cfg.name, gpus=world, layout={**{k: getattr(p, k) for k in ("tp", "pp", "cp", "ep", "vp", "fsdp")},
                                          "efsdp": z.efsdp},
        dtype=t.dtype, activation_checkpointing=t.activation_checkpointing, seq_len=t.seq_len,
        micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size, micro_batches_per_step=z.m,
        total_params=counts.total, activated_params=counts.activated, flops_per_token=flops_per_token(mdl, t.seq_len),
        flops_convention=FLOPS_CONVENTION, params_per_gpu=worst["local"], stage=worst["rank"],
        stage_layers=[list(x) for x in ranks], stage_params=[x["dense"] + x["experts"] for x in per_rank],
        memory=dict(worst["mem"]), memory_per_gpu_bytes=worst["total"],
        activations_per_micro_batch=dict(worst["act"]), activation_bytes_per_token_per_layer=per_tok,
        comm=comm, pipeline={"schedule": p.pp_schedule if p.pp > 1 else "none", "stages": p.pp * p.vp,
                             "bubble_fraction": (p.pp - 1) / (p.vp * z.m + p.pp - 1) if p.pp > 1 else 0.0,
                             "in_flight_micro_batches": worst["flight"]},
        gpu_memory_gb=capacity_gb, gpu_memory_source=source, fits=fits, biggest_term=biggest, verdict=verdict,
        assumptions=_assumptions(cfg, p, z.shard, z.efsdp, z.m, z.one_rank, z.full_loss) + (
            ["routing weights applied at combine, the expert outputs kept for their gradient, as the code before "
             "a3f8c38 did (local_weighting=combine)"] if z.weighting == "combine" else []), loading=worst["loading"],
        placing_bytes=worst["placing"], trained_params=_trained_params(cfg, counts.total),
        fsdp_grad_sync=grad_sync(p), sonic_wgrad=sonic_wgrad, sonic_tiles=sonic_tiles, into_grad=into_grad,
        grad_norm=grad_norm, expert_norm=expert_norm, full_loss=full_loss, clip_multiply=clip_multiply,
        loss=cfg.backend.loss)
    if p.ep > 1:
        result.assumptions.append(_exchange_line(comm))
    if kind and fits:  # a layout that does not fit has no speed to predict
        result.speed = predict_speed(cfg, result, kind)
        result.assumptions += result.speed.assumptions
    return result


def _fix_text(cfg: Config, world: int, capacity_gb: float, biggest: str, kw: dict) -> str:
    """The verdict's last sentence for a plan that does not fit: a change that fits (moelab.planner.fixes)."""
    found = fitting_change(cfg, biggest, lambda c: plan(c, gpus=world, gpu_memory_gb=capacity_gb, suggest=False, **kw))
    if found is None:
        return "; no single setting tried fits (optimizer state, recompute, micro batch, ep, pp, tp): use more GPUs"
    change, fitted = found
    return f". Fits with {set_text(change)}: {_bytes(fitted.memory_per_gpu_bytes)} per GPU"


AUTO_FULL_SHARE = 0.85  # backend.loss=auto takes the full loss while its plan leaves 15% of the GPU free


def resolve_loss(cfg: Config, gpus: int, gpu_memory_gb: float | None = None, on_cuda: bool = True) -> str:
    """The loss backend.loss=auto stands for: the compiled full loss where its plan fits within AUTO_FULL_SHARE
    of the GPU's memory (on one H200 at the Qwen3 proxy's shapes it ran 5-6% faster than the chunked loss:
    gallery/results/*--lossfull-* against *--losschunked-*); where it does not, the one of the two that plans
    less; the fused chunked loss, which never holds the whole logits, when eager or on CPU. Any other setting is
    returned as it is.

        resolve_loss(load_config("qwen3-moe-30b-a3b-proxy", ["train.compile=true"]), gpus=1, gpu_memory_gb=141)
    """
    if cfg.backend.loss != "auto":
        return cfg.backend.loss
    if cfg.train.fp8 == "rowwise_lm_head":  # the FP8 head is the full loss's head GEMM
        return "full"
    if not (on_cuda and cfg.train.compile):
        return "chunked"
    full = plan(cfg.replace(**{"backend.loss": "full"}), gpus=gpus, gpu_memory_gb=gpu_memory_gb)
    if full.memory_per_gpu_bytes <= AUTO_FULL_SHARE * full.gpu_memory_gb * GiB:
        return "full"
    # short of memory: whichever holds less (the chunked loss's fp32 head gradient, V x D x 4 bytes, outweighs
    # the whole logits of a small micro batch at a large hidden size: Kimi-K2's 4,096 tokens x 163,840)
    chunked = plan(cfg.replace(**{"backend.loss": "chunked"}), gpus=gpus, gpu_memory_gb=gpu_memory_gb)
    return "full" if full.memory_per_gpu_bytes <= chunked.memory_per_gpu_bytes else "chunked"


def _trained_params(cfg: Config, total: int) -> int:
    lp, m = lora_params(cfg), cfg.model
    return total if lp is None else lp.on_rank(m.num_dense_layers, m.num_layers - m.num_dense_layers, 1, 1)[1]


def _memory(z: _Sizes, ranks: list[list[int]]) -> tuple[list[dict], int]:
    """Per pipeline rank: its layers, parameters, activations and memory terms (bytes); and the logit bytes
    per token."""
    cfg, p, a = z.cfg, z.p, z.a
    mdl, t = cfg.model, cfg.train
    # TP: a rank holds a tp-th of the dense weights (FSDP2 shards that over the fsdp*cp ranks) and of the
    # micro batch's tokens in the sequence-parallel stream (tensor_parallel_pieces, tp_gathered_per_token)
    T, dense_mesh = z.T // p.tp, z.shard // p.tp
    pieces, lp = tensor_parallel_pieces(block_params(mdl), p.tp, cfg), lora_params(cfg)
    is_moe = [i >= mdl.num_dense_layers for i in range(mdl.num_layers)]

    def eager(i: int) -> bool:  # moelab.model.attention.causal_attention's choice of path for layer i
        b = cfg.backend.attention
        return b == "eager" or (b != "flex" and (bool(layer_window(mdl, i)) or mdl.attention_sinks))

    # autocast over fp32 weights on one rank (no FSDP2 casts): the residual stream stays fp32
    residual = 4 if z.world == 1 and t.dtype == "bfloat16" and t.param_dtype == "float32" else a
    acts = [saved_per_token(cfg, is_moe[i], a, eager(i), residual, z.weighting) for i in range(mdl.num_layers)]
    if p.tp > 1:  # what a rank keeps per token of its sequence shard: its share plus the gathered inputs' rest
        extra = (p.tp - 1) * tp_gathered_per_token(cfg, a)
        acts = [{**x, "attention": x["attention"] + extra,
                 "ffn": x["ffn"] + extra * (tp_gathered_sublayers(cfg, is_moe[i]) - 1)} for i, x in enumerate(acts)]
    # the loss's peak on the last stage (moelab.planner.loss: the whole logits, or one chunk of the fused loss),
    # vocabulary-parallel under TP: a tp-th of it
    logits_total = logits_bytes(cfg, z.T, a, z.full_loss) // p.tp
    logit_bytes = logits_total // max(T, 1)  # per token, as reported
    fused = [not eager(i) and cfg.backend.attention != "flex" for i in range(mdl.num_layers)]
    kept = [selective_kept_per_token(cfg, is_moe[i], a, fused[i]) for i in range(mdl.num_layers)]
    per_rank = []
    for r, layers in enumerate(ranks):
        n_moe = sum(is_moe[i] for i in layers)
        n_dense = len(layers) - n_moe
        experts = n_moe * pieces.moe_experts
        dense = (n_moe * (pieces.moe_layer - pieces.moe_experts) + n_dense * pieces.dense_layer
                 + (pieces.embedding if r == 0 else 0) + (pieces.head if r == p.pp - 1 else 0))
        dense_div = 1 if p.data_parallel == "ddp" else dense_mesh  # replicated dense weights are whole here
        expert_div = 1 if p.expert_dp == "replicate" else z.efsdp
        local = math.ceil(dense / dense_div) + math.ceil(experts / (p.ep * expert_div))
        # LoRA: the adapters are new parameters; only they (and a trained router) get gradients and AdamW state
        adapters, trained = lp.on_rank(n_dense, n_moe, dense_div, p.ep * expert_div) if lp else (0, local)
        local += adapters
        experts_sharded = z.world > 1 and wrapped(cfg, p, dense_mesh, z.efsdp, z.one_rank)[1]  # no FP8 cache
        units = []  # FSDP2's units (moelab.planner.comm) and what they gather (moelab.planner.gathered)
        if z.world > 1:
            held_moe = [is_moe[i] for i in layers]
            gathered = gathered_params(pieces, held_moe, r == 0, r == p.pp - 1, cfg, p, dense_mesh, z.efsdp, a,
                                       z.one_rank)
            units = fsdp_units(cfg, p, pieces, held_moe, r == 0, r == p.pp - 1, dense_mesh, z.efsdp, z.m, r,
                               z.one_rank)
        else:
            gathered = local * a if a < z.pb else 0  # autocast's bf16 copy of every fp32 weight
        # (held per micro batch in flight, the working set of the one block recomputed at a time)
        split = layer_activations(cfg, acts, kept, layers, T)
        if r == p.pp - 1:  # the final norm before the LM head is never checkpointed
            split = {k: (held + T * mdl.hidden_size * (4 + 2 * a), work) for k, (held, work) in split.items()}
        act = {k: held + work for k, (held, work) in split.items()}  # one micro batch
        flight = _in_flight(p, r, z.m)
        in_flight = {k: int(flight * held + work) for k, (held, work) in split.items()}
        mem = {
            "parameters": local * z.pb,
            "gradients": trained * z.pb,
            "optimizer": trained * z.mb,
            "gathered_params": gathered,
            "fp8_weights": fp8_cache_bytes(cfg, pieces, n_moe, p.ep, experts_sharded, z.m),
            # parallel.fsdp_grad_sync=step, and pp > 1 (torch's schedule): unsharded until the last backward
            "held_unsharded": held_unsharded(units, p, z.m, a, z.pb, gathered, trained=lp is None),
            "activations": in_flight[t.activation_checkpointing],
            "logits": logits_total if r == p.pp - 1 else 0,
            "dispatcher": 2 * T * mdl.moe.top_k * mdl.hidden_size * a if p.ep > 1 and n_moe else 0,
        }
        load = loading_bytes(cfg, pieces, r, p.pp, n_moe, n_dense, dense_div, expert_div, local, z.pb) \
            if t.init_from else None  # a start from a checkpoint: a second peak, before training
        # DDP or replicated experts (moelab.parallel.distributed.place_stage): the stage is allocated with its
        # dense weights whole and its experts split by EP only, then wrapped; FSDP2 alone wraps on the meta device
        replicated = (p.data_parallel, p.expert_dp) != ("fsdp", "fsdp")
        placing = (dense + math.ceil(experts / p.ep) + adapters) * z.pb if replicated and z.world > 1 else 0
        per_rank.append(dict(rank=r, layers=layers, n_moe=n_moe, dense=dense, experts=experts, local=local,
                             units=units, act=act, flight=flight, in_flight=in_flight, mem=mem, loading=load,
                             placing=placing,
                             total=max(_peak(mem, z.m), load["device_bytes"] if load else 0, placing)))
    return per_rank, logit_bytes


def tensor_parallel_pieces(pieces, tp: int, cfg: Config | None = None):
    """A block's parameters as one TP rank holds them: attention, dense MLPs, shared experts, the embedding and
    the LM head split tp ways (their norms, the router and replicated shared experts, FSDP2-sharded over tp times
    as many ranks, counted split too: the same bytes a rank stores); the routed experts are EP's, whole. With
    `cfg`, the MoE layer's units apart (tp_replicated, tp_shared: moelab.planner.comm.fsdp_units)."""
    if tp == 1:
        return pieces
    split = dataclasses.replace(pieces, embedding=pieces.embedding // tp, head=pieces.head // tp,
                                dense_layer=pieces.dense_layer // tp,
                                moe_layer=(pieces.moe_layer - pieces.moe_experts) // tp + pieces.moe_experts)
    if cfg is None:
        return split
    moe, d = cfg.model.moe, cfg.model.hidden_size
    router, shared = moe.num_experts * (d + moe.router_bias), 3 * d * moe.expert_ffn_size * moe.num_shared_experts
    column_row = cfg.parallel.tp_shared_experts == "column_row"
    return dataclasses.replace(split, tp_replicated=(router + shared * (not column_row)) // tp,
                               tp_shared=shared * column_row // tp)


def tp_gathered_per_token(cfg: Config, a: int) -> int:
    """Bytes per token of one all-gathered input a block keeps whole under TP's sequence parallelism: the norm
    output the attention projections read, and likewise the one the MLP (or the router and experts) reads."""
    return a * cfg.model.hidden_size


def _communication(z: _Sizes, worst: dict) -> dict:
    """Bytes sent per GPU, for the rank that needs the most memory."""
    p, a, T, m = z.p, z.a, z.T, z.m
    mdl, t = z.cfg.model, z.cfg.train
    # dispatch+combine, fwd+bwd (+ full recompute's rerun of the block; selective keeps what the dispatch
    # delivered and exchanges nothing again); the tokens of one rank: its sequence shard under TP
    passes = exchanges_per_moe_layer(t.activation_checkpointing)
    rows = _exchange(z)
    tok = T // p.tp
    row_bytes = passes * tok * mdl.hidden_size * a
    intra, inter = int(row_bytes * rows.intra), int(row_bytes * rows.inter)
    a2a_layer = intra + inter
    dense_sh, exp_sh = worst["dense"] / p.tp, worst["experts"] / p.ep
    pp_send = 2 * m * p.vp * T // p.tp * mdl.hidden_size * a if p.pp > 1 else 0  # TP: each rank its shard
    if mdl.attention == "mla":
        kv_tok = mdl.num_heads * (mdl.qk_nope_head_dim + mdl.qk_rope_head_dim + mdl.v_head_dim) * a
    else:
        kv_tok = 2 * mdl.num_kv_heads * mdl.head_dim * a
    cp_bytes = int(3 * (p.cp - 1) * T * kv_tok * len(worst["layers"]) * m) if p.cp > 1 else 0
    fanout = dispatch_ranks_per_token(mdl.moe, p.ep)
    # a dispatcher that sends each token once per destination rank (DeepEP): the fan-out, not top_k, counts
    once_layer = int(passes * tok * fanout * (p.ep - 1) / p.ep * mdl.hidden_size * a) if p.ep > 1 else 0
    return {"all_to_all_bytes_per_moe_layer": a2a_layer,
            "all_to_all_intra_node_bytes_per_moe_layer": intra,
            "all_to_all_inter_node_bytes_per_moe_layer": inter,
            "all_to_all_bytes_per_step": a2a_layer * worst["n_moe"] * m,
            "all_to_all_inter_node_bytes_per_step": inter * worst["n_moe"] * m,
            "exchanges_per_moe_layer": passes if p.ep > 1 else 0, "ep_dispatch": rows.dispatcher,
            "exchange_stages": rows.stages, "ranks_per_node": z.g,
            "dispatch_ranks_per_token": fanout,
            "once_per_rank_dispatch_bytes_per_step": once_layer * worst["n_moe"] * m,
            **tp_traffic(z, worst),
            **fsdp_traffic(z.cfg, worst["units"], m, a),  # FSDP2's units as scheduled (moelab.planner.comm)
            "pipeline_send_bytes_per_step": pp_send, "cp_bytes_per_step": cp_bytes,
            **_replication_comm(z.cfg, p, dense_sh, exp_sh, z.efsdp, worst["n_moe"])}


def exchanges_per_moe_layer(checkpointing: str) -> int:
    """Expert exchanges of one MoE layer per micro batch: dispatch and combine, forward and backward; full
    recompute reruns the block's forward with its dispatch and combine; selective keeps what the dispatch
    delivered (moelab.model.recompute), so it exchanges as often as no recompute."""
    return 4 + (2 if checkpointing == "full" else 0)


def _exchange(z: "_Sizes"):
    """Rows one token sends per exchange by link, for the dispatcher that runs (moelab.planner.dispatch)."""
    cfg, p = z.cfg, z.p
    if cfg.backend.dispatcher == "deepep":
        dispatcher = "deepep"
    else:
        dispatcher = "hierarchical" if hierarchical_dispatch(p, z.g) else "flat"
    return exchange_rows(cfg.model.moe, p.ep, z.g, dispatcher, cfg.backend.fake_balanced_gate,
                         cfg.backend.fake_gate_noise > 0)


def tp_gathered_sublayers(cfg: Config, moe: bool) -> int:
    """The sublayers of a block that all-gather their sequence-parallel input under TP (moelab.parallel.tensor):
    attention, and a dense MLP; a MoE layer routes its sequence shard as it is, and gathers its tokens only for
    column/row-parallel shared experts (parallel.tp_shared_experts=column_row)."""
    shared = cfg.model.moe.num_shared_experts > 0 and cfg.parallel.tp_shared_experts == "column_row"
    return 1 + (not moe or shared)


def tp_collectives_per_layer(checkpointing: str, gathered: int = 2) -> int:
    """Sequence-parallel collectives of one block per micro batch under TP, for its `gathered` sublayers
    (tp_gathered_sublayers): each an all-gather before and a reduce-scatter after, forward, and their transposes
    in backward (4); full recompute runs the forward's 2 again, but torch's checkpoint stops at the last tensor
    backward needs, so a block whose FFN is gathered (gathered == 2) does not rerun its final reduce-scatter;
    selective the all-gather of the norm it recomputes."""
    return gathered * (4 + {"full": 2, "selective": 1}.get(checkpointing, 0)) - (checkpointing == "full"
                                                                                  and gathered == 2)


def tp_traffic(z: "_Sizes", worst: dict) -> dict:
    """TP's collectives per step on the rank (parallel.tp > 1): per block the sequence-parallel all-gathers and
    reduce-scatters of the micro batch's hidden states (tp_collectives_per_layer), the vocabulary-parallel
    embedding's reduce-scatter (forward) and all-gather (backward) on the first stage, the LM head's all-gather and
    reduce-scatter on the last (the loss's per-token max and sum, 12 B a token, left out); each sends (tp - 1) / tp
    of T x hidden."""
    p, t = z.p, z.cfg.train
    if p.tp == 1:
        return {"tp_collectives_per_step": 0, "tp_bytes_per_step": 0, "tp_bytes_per_collective": 0}
    one = int(z.T * z.cfg.model.hidden_size * z.a * (p.tp - 1) / p.tp)
    ends = 2 * ((worst["rank"] == 0) + (worst["rank"] == p.pp - 1))
    moe = [i >= z.cfg.model.num_dense_layers for i in worst["layers"]]
    n = z.m * (sum(tp_collectives_per_layer(t.activation_checkpointing, tp_gathered_sublayers(z.cfg, x))
                   for x in moe) + ends)
    return {"tp_collectives_per_step": n, "tp_bytes_per_step": n * one, "tp_bytes_per_collective": one}


def _verdict(z: _Sizes, worst: dict, capacity_gb: float) -> tuple[bool, str, str]:
    """(fits, the biggest memory term, the verdict with what to change when it does not fit)."""
    usable = capacity_gb * GiB * (1 - RESERVE)
    total = worst["total"]
    biggest = max(MEMORY_TERMS, key=lambda k: worst["mem"][k])
    if total <= usable:
        return True, biggest, (f"fits: {_bytes(total)} of {capacity_gb:.1f} GiB per GPU "
                               f"({100 * total / (capacity_gb * GiB):.0f}%; the biggest term is "
                               f"{MEMORY_LABELS[biggest]}, {_bytes(worst['mem'][biggest])})")
    verdict = (f"does not fit: needs {_bytes(total)} per GPU but {capacity_gb:.1f} GiB x {1 - RESERVE:.2f} = "
               f"{_bytes(usable)} is usable; the biggest term is {MEMORY_LABELS[biggest]} "
               f"({_bytes(worst['mem'][biggest])}): {_TERM_HELP[biggest]}")
    if biggest == "activations" and z.cfg.train.activation_checkpointing != "full":
        verdict += f" (full checkpointing: activations {_bytes(worst['in_flight']['full'])})"
    return False, biggest, verdict


def _assumptions(cfg: Config, p, shard: int, efsdp: int, m: int, one_rank: str = "plain",
                 full_loss: str = "kernel") -> list[str]:
    t = cfg.train
    states = describe_states(t)
    if t.dtype != "bfloat16":
        compute = "compute dtype fp32"
    elif p.pp * shard > 1:  # a distributed run: FSDP2 wraps every block
        compute = "compute dtype bf16: FSDP2 gathers one block (+1 prefetched) in bf16, reduces gradients in fp32"
    elif getattr(t, "param_dtype", "float32") == "bfloat16":
        compute = "compute dtype bf16 on bf16 parameters"
    else:
        compute = ("compute dtype bf16 by autocast over fp32 weights: a bf16 copy of every weight is kept; the "
                   "residual stream stays fp32")
    out = [
        states,
        compute,
        (f"dense parameters split over tp = {p.tp} (FSDP2 shards each part over fsdp*cp = {shard // p.tp} ranks)"
         if p.tp > 1 else f"dense parameters sharded over fsdp*cp*tp = {shard} ranks")
        + f"; experts over ep = {p.ep} then expert-FSDP = {efsdp}",
        f"activations: what autograd keeps {'compiled (inductor recomputes pointwise work)' if t.compile else 'eager'}"
        f" for the {cfg.backend.router_kind} router (moelab.planner.saved); activation checkpointing: "
        f"{t.activation_checkpointing}",
        loss_assumption(cfg, full_loss),
        ("peak = sum of all terms (full gradients sit next to the activations from the second micro batch on)"
         if m > 1 else "peak = the other terms + max(gradients, activations + logits): one micro batch per step"),
        f"verdict keeps {int(100 * RESERVE)}% of GPU memory for the CUDA context, NCCL and fragmentation",
        "FSDP2 traffic per unit as the schedule runs it (moelab.planner.comm.fsdp_counts): without pp every micro "
        "batch reduce-scatters and a unit resharded after forward is gathered twice; under pp a stage reduces once "
        "per step and gathers once (1F1B) or each time interleaved 1F1B brings it back among its three gathered "
        "stages; blocks kept gathered after forward "
        f"(parallel.reshard_after_forward={p.reshard_after_forward}, experts "
        f"{p.expert_reshard_after_forward}) count in gathered weights; "
        + ("one-rank meshes are not wrapped" if one_rank == "plain" else
           "one-rank meshes wrapped too, as the code before 6131a2c did (fsdp_one_rank=wrapped)"),
        "FSDP2 as scheduled: a unit resharded after forward gathers again in backward; gradients reduce-scattered "
        + ("once per step (parallel.fsdp_grad_sync=step, or pp > 1): until then every unit's gradients and weights "
           "are held unsharded" if grad_sync(p) == "step" else "every micro batch (parallel.fsdp_grad_sync)"),
    ]
    if lora_params(cfg):
        out.append("LoRA (train.lora): gradients and AdamW state for the adapters (and a trained router) only; "
                   "frozen matmuls keep no input for backward")
    if t.fp8 != "off":
        out.append(f"train.fp8={t.fp8}: the expert weights' e4m3 cache (2 B per local expert parameter) with several "
                   "micro batches per step and experts not sharded by FSDP2; FP8 GEMMs keep bf16 inputs, as bf16 ones")
    if t.init_from:
        out.append("loading from train.init_from: weights + the largest tensor slice on the GPU, 12 B per element "
                   "of that slice on the host; the larger of this and the training peak counts")
    if p.tp > 1:
        out.append(f"TP {p.tp} with sequence parallelism: a rank keeps a tp-th of each block's activations plus "
                   "the all-gathered inputs of attention and a dense MLP whole, a tp-th of the logits "
                   "(vocabulary-parallel head and loss), routes its sequence shard's tokens; per block and micro "
                   "batch an all-gather and a reduce-scatter around attention and around a dense MLP (a MoE "
                   "layer's column/row shared experts too: parallel.tp_shared_experts), forward and backward "
                   "(tp_collectives_per_layer)")
    if p.ep > 1:
        out.append("expert exchange (moelab.planner.dispatch): balanced routing over the EP group's ranks; the "
                   "flat all-to-all sends one row per routed expert, the hierarchical dispatch a token once per "
                   "other node it reaches and top_k rows inside the node, DeepEP once per rank; "
                   + ("the fake gate's top_k consecutive experts counted exactly" if cfg.backend.fake_balanced_gate
                      else "a learned router's picks taken as uniform (node-limited routing: from topk_groups "
                           "nodes)"))
    return out


def _exchange_line(comm: dict) -> str:
    """What the plan counted for the expert exchange (the rows behind comm's bytes)."""
    n, tok = comm["exchanges_per_moe_layer"], comm["all_to_all_bytes_per_moe_layer"] or 1
    share = comm["all_to_all_inter_node_bytes_per_moe_layer"] / tok
    return (f"expert exchange: {comm['ep_dispatch']}, {n} per MoE layer and micro batch (dispatch and combine, "
            f"forward and backward{', and again in full recompute' if n == 6 else ''}), {100 * share:.0f}% of its "
            f"bytes between nodes of {comm['ranks_per_node']} GPUs")
