"""The one layout validator: can this config run on this many ranks, and with which mesh shapes.

    dims = ParallelDims.build(load_config("tiny", ["parallel.ep=2"]), world_size=4)
    dims.fsdp, dims.ep              # 4, 2 (fsdp=-1 filled in from the world size)
    dims.layout                     # the resolved ParallelConfig the trainer and the planner use
    dims.coords(3)                  # Coords(pp=0, dp=3, cp=0, ep=1, efsdp=1, tp=0)
    dims.world_shape                # (pp, dp, cp, tp): the shape of the ranks' DeviceMesh (moelab.parallel.mesh)

Like torchtitan's ParallelDims, one object holds the validation and the shapes derived from it. Everything
the ranks would reject is rejected here, before anything is submitted: the planner, Session.submit, the
`moelab` command and the trainer all build one. Every error is a ConfigError naming the field, the value and
the fix. Torch-free (only moelab.config), so it imports anywhere.

Rank order (innermost last): rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank: tensor-parallel
peers are neighbours (one node). Within a pipeline stage the dp*cp*tp ranks are numbered
s = (dp_rank * cp + cp_rank) * tp + tp_rank; expert parallelism carves them as s = efsdp_rank * ep + ep_rank, so
EP peers are neighbours (one node when ep <= GPUs per node), borrowed from the TP ranks first, then the CP ranks
and then the data-parallel ranks (torchtitan's and NeMo's convention: the MoE layer takes the sequence-parallel
tokens, so a TP rank routes its own share like a data-parallel rank).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moelab.config import Config, ConfigError, ParallelConfig
from moelab.config.rules import _divisors, _fail


@dataclass(frozen=True)
class Coords:
    """This rank's position: pipeline stage, data-parallel index, context-parallel index, EP index and
    expert-FSDP index (the last two within the stage's dp*cp*tp ranks) and tensor-parallel index.

        ParallelDims.build(cfg, 4).coords(1)    # Coords(pp=0, dp=1, cp=0, ep=1, efsdp=0, tp=0) with ep=2
    """
    pp: int
    dp: int
    cp: int
    ep: int
    efsdp: int
    tp: int = 0


def _batch_fixes(gbs: int, mbs: int, dp: int) -> str:
    """What makes the global batch split evenly: a larger global batch, a smaller micro batch, fewer ranks."""
    need = mbs * dp
    fixes = [f"set train.global_batch_size={-(-gbs // need) * need}"]
    if gbs % dp == 0:
        fixes.append(f"train.micro_batch_size={max(d for d in _divisors(gbs // dp) if d <= mbs)}")
    fewer = [d for d in _divisors(gbs // mbs) if d < dp] if gbs % mbs == 0 else []
    if fewer:
        fixes.append(f"{max(fewer)} data-parallel ranks (fewer GPUs, or more of them in parallel.pp/cp)")
    return ", or ".join(fixes)


def _fsdp_degree(p: ParallelConfig, world_size: int) -> int:
    """The data-parallel (FSDP) degree: what tp*pp*cp leaves of the world size (parallel.fsdp=-1) or the given
    parallel.fsdp, checked to fill the world size exactly."""
    rest = p.tp * p.pp * p.cp
    if world_size % rest:
        _fail("parallel", f"tp={p.tp} pp={p.pp} cp={p.cp}",
              f"tp*pp*cp={rest} must divide the world size {world_size}")
    fsdp = world_size // rest if p.fsdp == -1 else p.fsdp
    if p.tp * p.pp * p.cp * fsdp != world_size:
        _fail("parallel.fsdp", p.fsdp, f"tp*pp*cp*fsdp = {rest * fsdp} but the world size is {world_size}; "
              f"set parallel.fsdp={world_size // rest} or -1")
    return fsdp


@dataclass(frozen=True)
class ParallelDims:
    """A validated layout on `world_size` ranks (build it with ParallelDims.build) and its mesh shapes.

        dims = ParallelDims.build(cfg, world_size=8)     # ConfigError if the ranks could not run it
        dims.dp, dims.num_stages, dims.n_microbatches    # data-parallel ranks, pp*vp, micro batches per dp rank
    """
    layout: ParallelConfig
    world_size: int
    n_microbatches: int  # micro batches per data-parallel rank and step

    @classmethod
    def build(cls, cfg: Config, world_size: int) -> "ParallelDims":
        p, t = cfg.parallel, cfg.train
        fsdp = _fsdp_degree(p, world_size)
        if (fsdp * p.cp * p.tp) % p.ep:
            _fail("parallel.ep", p.ep, f"must divide fsdp*cp*tp={fsdp * p.cp * p.tp} (EP groups are carved from "
                  f"the non-pipeline ranks); try ep in {_divisors(fsdp * p.cp * p.tp)}")
        if p.tp > 1:
            _check_tp_divides(cfg, p.tp)
        dp = fsdp
        if t.global_batch_size % (t.micro_batch_size * dp):
            _fail("train.global_batch_size", t.global_batch_size,
                  f"must be a multiple of micro_batch_size*dp = {t.micro_batch_size}*{dp} = "
                  f"{t.micro_batch_size * dp}; {_batch_fixes(t.global_batch_size, t.micro_batch_size, dp)}")
        if p.cp > 1 and t.seq_len % (2 * p.cp):
            _fail("train.seq_len", t.seq_len,
                  f"must be a multiple of 2*cp={2 * p.cp} for load-balanced causal sharding")
        if p.pp > 1 and cfg.model.num_layers < p.pp * p.vp:
            _fail("parallel.pp", p.pp, f"pp*vp={p.pp * p.vp} stages need at least that many layers "
                  f"(model.num_layers={cfg.model.num_layers})")
        n_micro = t.global_batch_size // (t.micro_batch_size * dp)
        if p.pp > 1 and (n_micro < p.pp or (p.vp > 1 and n_micro % p.pp)):
            _fail("train.global_batch_size", t.global_batch_size,
                  f"gives {n_micro} micro batches per data-parallel rank; the pipeline schedule needs at least "
                  f"pp={p.pp}" + (" and a multiple of it (interleaved)" if p.vp > 1 else "")
                  + "; raise global_batch_size or lower micro_batch_size")
        if cfg.train.expert_grad_compression != "none" and fsdp * p.cp * p.tp // p.ep == 1:
            _fail("train.expert_grad_compression", cfg.train.expert_grad_compression,
                  f"no rank shares this rank's experts (ep={p.ep} = the {fsdp * p.cp * p.tp} data-parallel ranks), "
                  f"so there is no gradient exchange to compress; set it to none or lower parallel.ep")
        if p.pp > 1 and cfg.model.pad_token_id >= 0:
            _fail("model.pad_token_id", cfg.model.pad_token_id, "padding masks are not carried through pipeline "
                  "stages; set model.pad_token_id=-1 or parallel.pp=1")
        if p.pp > 1 and cfg.model.tie_embeddings:
            _fail("model.tie_embeddings", True, "the embedding and the head live on different pipeline stages; "
                  "set model.tie_embeddings=false or parallel.pp=1")
        # what the ranks cannot run yet (a valid layout otherwise; the planner could estimate it)
        if p.vp > 1 and p.pp_schedule != "interleaved_1f1b":
            _fail("parallel.pp_schedule", p.pp_schedule, f"runs one stage per rank; with parallel.vp={p.vp} "
                  f"virtual stages use interleaved_1f1b")
        if p.cp > 1 and p.pp > 1:
            raise ConfigError(f"parallel.cp={p.cp} with parallel.pp={p.pp}: context parallelism does not "
                              f"compose with pipeline stages yet; use one of them")
        check_nodes(p, world_size)
        return cls(dataclasses.replace(p, fsdp=fsdp), world_size, n_micro)

    # ------------------------------------------------------------------ sizes
    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.fsdp

    @property
    def fsdp(self) -> int:
        return self.layout.fsdp

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def vp(self) -> int:
        return self.layout.vp

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def num_stages(self) -> int:
        return self.layout.pp * self.layout.vp

    # ------------------------------------------------------------------ mesh shapes
    @property
    def world_shape(self) -> tuple[int, int, int, int]:
        """("pp", "dp", "cp", "tp"): every rank."""
        return self.pp, self.dp, self.cp, self.tp

    @property
    def dense_shape(self) -> tuple[int, int, int]:
        """("pp", "dp_cp", "tp"): FSDP2 shards dense parameters over a stage's dp*cp ranks, on top of TP's shards
        (the 2-D mesh FSDP2 takes for DTensor parameters)."""
        return self.pp, self.dp * self.cp, self.tp

    @property
    def expert_shape(self) -> tuple[int, int, int]:
        """("pp", "efsdp", "ep"): EP peers innermost, expert-FSDP over the ranks that hold the same experts."""
        return self.pp, self.dp * self.cp * self.tp // self.ep, self.ep

    @property
    def token_shape(self) -> tuple[int, int, int]:
        """("pp", "dp", "cp_tp"): the ranks that share one data-parallel rank's sequences (each holds a share of
        the tokens: CP's chunks, TP's sequence-parallel shards); the routers' loss means are taken over them."""
        return self.pp, self.dp, self.cp * self.tp

    def coords(self, rank: int) -> Coords:
        return coords_of(self.layout, rank)


def coords_of(layout: ParallelConfig, rank: int) -> Coords:
    """Where `rank` sits in a resolved layout (see the rank order in the module docstring)."""
    dp, cp, ep, tp = layout.fsdp, layout.cp, layout.ep, layout.tp
    pp_rank, s = divmod(rank, dp * cp * tp)
    dp_rank, rest = divmod(s, cp * tp)
    cp_rank, tp_rank = divmod(rest, tp)
    efsdp_rank, ep_rank = divmod(s, ep)
    return Coords(pp_rank, dp_rank, cp_rank, ep_rank, efsdp_rank, tp_rank)


def _check_tp_divides(cfg: Config, tp: int) -> None:
    """What tensor parallelism splits over `tp` ranks must divide evenly (moelab.parallel.tensor), one rule each."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    shared = m.moe.expert_ffn_size * m.moe.num_shared_experts
    rules = [("model.num_heads", m.num_heads, "query heads are split over the TP ranks"),
             ("model.vocab_size", m.vocab_size, "the embedding and the LM head are split by vocabulary rows"),
             ("model.dense_ffn_size", m.dense_ffn_size if m.num_dense_layers else 0,
              "dense MLPs are split column/row-wise"),
             ("model.moe.num_shared_experts", shared, f"shared experts (width expert_ffn_size*num_shared_experts="
              f"{shared}) are split column/row-wise"),
             ("train.seq_len", t.seq_len // p.cp, "sequence parallelism splits each (CP-local) sequence of "
              f"seq_len/cp={t.seq_len // p.cp} tokens")]
    if m.attention == "gqa":
        rules.append(("model.num_kv_heads", m.num_kv_heads, "key/value heads are split over the TP ranks"))
    for name, value, why in rules:
        if value % tp:
            _fail("parallel.tp", tp, f"must divide {name}'s {value} ({why}); try tp in {_divisors(value)}")


def check_layout(cfg: Config, world_size: int) -> ParallelConfig:
    """The resolved layout for `world_size` ranks (ParallelDims.build(cfg, world_size).layout)."""
    return ParallelDims.build(cfg, world_size).layout


def fsdp_wraps(mesh_size: int, cfg: Config) -> bool:
    """Whether FSDP2 wraps a unit whose mesh has `mesh_size` ranks (moelab.parallel.fsdp; the planner counts the
    same): two or more ranks always; one rank (nothing to shard or reduce) only where FSDP2's mixed precision is
    the bf16 compute (train.dtype=bfloat16 over fp32 weights: its reshard frees each bf16 copy after forward,
    where a cast left to autograd would be kept until backward)."""
    return mesh_size > 1 or (cfg.train.dtype == "bfloat16" and cfg.train.param_dtype == "float32")


def reshard_after_forward(policy: str, pp: int, last: bool) -> bool:
    """FSDP2's reshard_after_forward for one unit under `policy` (parallel.reshard_after_forward or
    expert_reshard_after_forward): always, never, or default: torchtitan's rule, not for a stage's last block
    (backward needs it at once) and not under pipeline parallelism (each micro batch would gather again)."""
    if policy != "default":
        return policy == "always"
    return pp == 1 and not last


def grad_sync(p: ParallelConfig) -> str:
    """When FSDP2 reduce-scatters gradients under gradient accumulation (parallel.fsdp_grad_sync resolved):
    "micro_batch" (every micro batch's backward) or "step" (the last micro batch's only; the others accumulate
    unsharded gradients and keep their units gathered until the next forward). auto: micro_batch, except under
    pp > 1, where torch's pipeline schedule holds FSDP2's gradients to the step's last backward itself
    (PipelineStage.backward_maybe_with_nosync). The config refuses micro_batch under pp > 1."""
    if p.fsdp_grad_sync != "auto":
        return p.fsdp_grad_sync
    return "step" if p.pp > 1 else "micro_batch"


# ------------------------------------------------------------------ nodes (parallel.ranks_per_node, ep_dispatch)
def check_nodes(p: ParallelConfig, world_size: int, ranks_per_node: int | None = None) -> None:
    """How nodes split the ranks: `ranks_per_node` (default parallel.ranks_per_node; 0 = not known here, so
    nothing to check) must divide the world size, and an EP group must lie within one node or span whole
    nodes (every node of the group holding as many of its ranks), which the node-aware dispatcher needs."""
    rpn = p.ranks_per_node if ranks_per_node is None else ranks_per_node
    if rpn == 0:
        return
    field = "parallel.ranks_per_node"
    if world_size % rpn:
        _fail(field, rpn, f"must divide the world size {world_size} (every node runs as many ranks); try one of "
              f"{_divisors(world_size)}")
    if p.ep > rpn and p.ep % rpn:
        _fail(field, rpn, f"parallel.ep={p.ep} spans nodes of {rpn} ranks unevenly; ep must be a multiple of "
              f"ranks_per_node, or divide it")
    if p.ep < rpn and rpn % p.ep:
        _fail(field, rpn, f"an EP group of parallel.ep={p.ep} ranks would straddle two nodes of {rpn} ranks; "
              f"choose ep dividing {rpn} or a multiple of it")


def resolve_ranks_per_node(p: ParallelConfig, world_size: int, environ: dict) -> int:
    """Ranks per node: parallel.ranks_per_node, else the launcher's LOCAL_WORLD_SIZE (torchrun, moelab's local
    launcher), else SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE ("4" or "4(x2)"), else all ranks on one node.

        resolve_ranks_per_node(layout, 8, {"LOCAL_WORLD_SIZE": "4"})    # 4: two nodes of 4 ranks
    """
    if p.ranks_per_node:
        rpn = p.ranks_per_node
    else:
        raw = (environ.get("LOCAL_WORLD_SIZE") or environ.get("SLURM_NTASKS_PER_NODE")
               or environ.get("SLURM_TASKS_PER_NODE") or str(world_size))
        rpn = int(raw.split("(")[0].split(",")[0])
    check_nodes(p, world_size, rpn)
    return rpn


def ep_nodes(p: ParallelConfig, ranks_per_node: int) -> int:
    """How many nodes one EP group spans (1 when it lies within a node)."""
    return max(p.ep // ranks_per_node, 1)


def hierarchical_dispatch(p: ParallelConfig, ranks_per_node: int) -> bool:
    """Whether the EP dispatcher is the node-aware one: parallel.ep_dispatch=hierarchical, or auto with an EP
    group that spans nodes."""
    if p.ep == 1 or p.ep_dispatch == "flat":
        return False
    return p.ep_dispatch == "hierarchical" or ep_nodes(p, ranks_per_node) > 1
