"""The planner's terms for replicated weights and once-per-rank dispatch (issue 25's features): the bytes
replicated parts exchange, and the EP ranks a token reaches (what FSDP2 still gathers: moelab.planner.gathered).

    dispatch_ranks_per_token(MoEConfig(num_experts=64, top_k=8), ep=8)   # 5.43
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from moelab.config import Config, ConfigError


def _replication_comm(cfg: Config, p, dense_sh: float, exp_sh: float, efsdp: int, n_moe: int) -> dict:
    """Bytes one rank sends per step for replicated weights: DDP's ring all-reduce of fp32 dense gradients (once
    per step), and the replicated experts' exchange: a ring all-reduce, or with 1-bit compression an all-gather
    of packed signs and one fp32 scale per expert and stacked tensor (moelab.parallel.compression)."""
    frac = (lambda n: 2 * (n - 1) / n if n > 1 else 0.0)
    ddp = int(frac(p.fsdp * p.cp) * dense_sh * 4) if p.data_parallel == "ddp" else 0
    expert = 0
    if p.expert_dp == "replicate" and efsdp > 1:
        if cfg.train.expert_grad_compression == "sign":
            scales = n_moe * 2 * (cfg.model.moe.num_experts // p.ep)  # gate|up and down of each local expert
            expert = int((efsdp - 1) * (exp_sh / 8 + 4 * scales))
        else:
            expert = int(frac(efsdp) * exp_sh * 4)
    return {"ddp_all_reduce_bytes_per_step": ddp, "expert_grad_bytes_per_step": expert}


def dispatch_ranks_per_token(moe, ep: int) -> float:
    """EP ranks one token's top_k experts sit on, expected under balanced (uniform) routing: ep blocks of E/ep
    experts, K distinct experts, so ep * (1 - C(E - E/ep, K) / C(E, K)). Node-limited routing
    (moe.max_routed_ranks = M over moe.routing_ranks blocks) draws the K from M blocks: with one block per EP rank
    M * (1 - C((M - 1) X, K) / C(M X, K)), X = E/ep; with several blocks per rank at most min(M, the unlimited
    figure; up to 3% low, as the router's chosen blocks hold the best scores and share the K more evenly). A share
    (ep - 1)/ep of them are other ranks. Used for dispatchers that send a token once per rank.

        dispatch_ranks_per_token(MoEConfig(num_experts=64, top_k=8), ep=8)                          # 5.43
        dispatch_ranks_per_token(MoEConfig(num_experts=64, top_k=8, routing_ranks=8, max_routed_ranks=2), 8)  # 2.0
    """
    E, K = moe.num_experts, moe.top_k
    if ep <= 1:
        return 1.0
    free = ep * (1 - math.comb(E - E // ep, K) / math.comb(E, K))
    M = moe.max_routed_ranks
    if not M:
        return free
    if moe.routing_ranks == ep:
        X = E // ep
        return M * (1 - math.comb((M - 1) * X, K) / math.comb(M * X, K))
    return min(float(M), free)


# ------------------------------------------------------------------------------------------------- FSDP2
# What FSDP2 does with a unit whose mesh has one rank, by moelab's code (the planner option `fsdp_one_rank`):
# "plain", the code since 6131a2c (moelab.parallel.fsdp: left plain unless FSDP2's mixed precision is the bf16
# cast, moelab.layout.dims.fsdp_wraps), what every plan counts unless asked; "wrapped", the code before it, which
# sent every unit through fully_shard whatever its mesh (data_parallel=fsdp: each block, the root and under EP
# each block's experts; DDP runs: the experts), so a one-rank unit still had its gathered copy and its unsharded
# gradient. Only the gallery's memory table asks for "wrapped", to plan records measured with that code
# (moelab.gallery.records.CODE_BEFORE).
FSDP_ONE_RANK = ("plain", "wrapped")


def check_one_rank(one_rank: str) -> str:
    """`one_rank` if it is one of FSDP_ONE_RANK, else a ConfigError naming it and the choices."""
    if one_rank not in FSDP_ONE_RANK:
        raise ConfigError(f"fsdp_one_rank={one_rank!r}: must be one of {', '.join(FSDP_ONE_RANK)} (plain: "
                          "moelab's code; wrapped: the code before 6131a2c, for records measured with it)")
    return one_rank


def wrapped(cfg: Config, p, shard: int, efsdp: int, one_rank: str = "plain") -> tuple[bool, bool]:
    """(dense weights, experts) wrapped by FSDP2 (DTensors gathered per unit), as moelab.parallel.fsdp does it;
    `shard`: ranks of the dense mesh, `efsdp`: of the expert mesh; `one_rank`: what the code does with a
    one-rank mesh (FSDP_ONE_RANK; "wrapped" plans the code from before 6131a2c).

        wrapped(cfg, layout, shard=2, efsdp=1)                       # bf16 parameters: (True, False)
        wrapped(cfg, layout, shard=2, efsdp=1, one_rank="wrapped")   # (True, True)
    """
    from moelab.layout.dims import fsdp_wraps

    every = one_rank == "wrapped"  # the code before 6131a2c: every unit, whatever its mesh
    dense_on = p.data_parallel == "fsdp" and (every or fsdp_wraps(shard, cfg))
    if p.data_parallel == "ddp":  # DDP runs wrap the experts on their own, on two or more ranks
        experts_on = p.expert_dp == "fsdp" and (every or efsdp > 1)
    elif p.ep == 1 and p.tp == 1:  # the experts are part of their block's unit
        experts_on = p.expert_dp == "fsdp" and dense_on
    else:  # their own unit on the expert-FSDP mesh
        experts_on = p.expert_dp == "fsdp" and (every or fsdp_wraps(efsdp, cfg))
    return dense_on, experts_on


@dataclass(frozen=True)
class FSDPUnit:
    """One kind of FSDP2 unit on a pipeline rank (moelab.parallel.fsdp wraps it), and how often the schedule
    gathers and reduces it (fsdp_counts).

        FSDPUnit("blocks", count=7, params=9_000_000, ranks=8, gathers_per_micro_batch=2, reduce_scatters_per_step=4)
    """
    name: str  # "blocks", "last block", "root", "experts", "last experts"; under TP "moe layers", "shared experts"
    count: int  # units of this kind on the rank
    params: int  # parameters of one unit on this rank before FSDP2 shards it (experts: this EP rank's)
    ranks: int  # its FSDP2 mesh
    gathers_per_micro_batch: float
    reduce_scatters_per_step: float


def fsdp_bytes(params: int, ranks: int, gathers_per_micro_batch: float, reduce_scatters_per_step: float,
               micro_batches: int, compute_bytes: int, reduce_bytes: int) -> dict:
    """THE count of FSDP2's traffic for `params` parameters sharded over `ranks`, per step: bytes one rank sends
    (all-gather in the compute dtype, reduce-scatter in the reduce dtype: (ranks - 1)/ranks of the unit each
    time) and bytes FSDP2 copies on the compute stream: each gather's copy-out reads and writes the whole unit
    (gather_copied), each reduce-scatter's copy-in, chunk_cat, reads the gradient and writes it in the reduce
    dtype (reduce_copied). (The gather's copy-in of the shard runs on its own stream.)

        fsdp_bytes(10**9, 8, gathers_per_micro_batch=2, reduce_scatters_per_step=4, micro_batches=4,
                   compute_bytes=2, reduce_bytes=4)["all_gather"]      # 2 x 4 x 2 GB x 7/8 = 14 GB
    """
    share = (ranks - 1) / ranks
    gathers = gathers_per_micro_batch * micro_batches
    return {"all_gather": int(params * compute_bytes * share * gathers),
            "reduce_scatter": int(params * reduce_bytes * share * reduce_scatters_per_step),
            "gather_copied": int(params * 2 * compute_bytes * gathers),
            "reduce_copied": int(params * (compute_bytes + reduce_bytes) * reduce_scatters_per_step)}


def fsdp_counts(cfg: Config, p, m: int, policy: str, last: bool, rank: int = 0, twice: bool = False
                ) -> tuple[float, float]:
    """(all-gathers per micro batch, reduce-scatters per step) of one FSDP2 unit as moelab's schedule runs it:
    `policy` its reshard_after_forward setting (moelab.layout.dims.reshard_after_forward; "root": FSDP2's root,
    kept gathered unless parallel.reshard_after_forward=always), `last` the stage's last block, `rank` the
    pipeline rank, `twice`: entered twice per micro batch (the experts under parallel.ep_overlap: two unshards
    in forward, two reduce-scatters in backward).

    - pp = 1, parallel.fsdp_grad_sync=micro_batch (the default): every micro batch reduce-scatters; a unit
      resharded after forward is gathered in forward and again in backward, one kept gathered only in forward
      (resharded after backward). fsdp_grad_sync=step: one reduce-scatter after the last backward; the unit
      stays gathered between micro batches, so it is gathered once, plus once per backward if it reshards
      after forward.
    - pp > 1 (moelab.planner.schedule): the stages reduce once, after their last backward. 1F1B and GPipe keep
      the blocks gathered through the step (one gather), or, resharding after each forward, gather m + 1 times
      (every backward that follows a forward gathers again); interleaved 1F1B gathers a stage each time it comes
      back into the three stages the schedule keeps gathered.
    """
    from moelab.layout.dims import grad_sync, reshard_after_forward
    from moelab.planner.schedule import interleaved_gathers

    entries = 2.0 if twice else 1.0
    reshards = (cfg.parallel.reshard_after_forward == "always" if policy == "root"
                else reshard_after_forward(policy, p.pp, last))
    if p.pp == 1 and grad_sync(p) == "micro_batch":
        return entries * (2.0 if reshards else 1.0), entries * m
    if p.pp == 1:  # parallel.fsdp_grad_sync=step: gathered from the first forward to the last backward
        return entries * (1.0 + m * reshards) / m, entries
    per_step = m + 1.0 if reshards else 1.0
    if p.vp > 1 and p.pp_schedule != "gpipe":
        held = interleaved_gathers(p.pp, p.vp, m, rank)
        per_step = max(per_step, sum(held.values()) / len(held))
    return entries * per_step / m, entries


def fsdp_units(cfg: Config, p, pieces, moe_layers: list[bool], first: bool, last: bool, shard: int, efsdp: int,
               m: int, rank: int = 0, one_rank: str = "plain") -> list[FSDPUnit]:
    """The FSDP2 units of a pipeline rank holding blocks `moe_layers` (True: MoE), the embedding when `first`, the
    LM head when `last` (moelab.parallel.fsdp.apply_fsdp; one-rank meshes left plain by
    moelab.layout.dims.fsdp_wraps; DDP runs wrap only the experts, on two or more ranks, resharding by
    parallel.expert_reshard_after_forward); `one_rank`: wrapped() for code that wrapped one-rank meshes too."""
    dense_on, experts_on = wrapped(cfg, p, shard, efsdp, one_rank)
    experts_own = experts_on and (p.ep > 1 or p.tp > 1 or p.data_parallel == "ddp")  # a unit of their own
    in_block = p.ep == 1 and p.tp == 1 and p.expert_dp == "fsdp"  # the experts are part of their block's unit
    apart = pieces.tp_replicated + pieces.tp_shared  # under TP: the MoE layer's own units (tp_moe_units)
    size = [(pieces.moe_layer - (0 if in_block else pieces.moe_experts) - apart if moe else pieces.dense_layer)
            for moe in moe_layers]
    units = []

    def add(name, count, params, ranks, policy, is_last, twice=False):
        if count and params:
            units.append(FSDPUnit(name, count, params, ranks,
                                  *fsdp_counts(cfg, p, m, policy, is_last, rank, twice)))

    if dense_on and moe_layers:
        add("blocks", len(size) - 1, sum(size[:-1]) // max(len(size) - 1, 1), shard, p.reshard_after_forward, False)
        add("last block", 1, size[-1], shard, p.reshard_after_forward, True)
    if dense_on:
        add("root", 1, pieces.embedding * first + pieces.head * last, shard, "root", False)
    n_moe, ends_moe = sum(moe_layers), int(bool(moe_layers) and moe_layers[-1])
    if experts_own and n_moe:
        policy = p.expert_reshard_after_forward  # DDP runs too (their experts are units of their own)
        twice = p.ep_overlap
        add("experts", n_moe - ends_moe, pieces.moe_experts // p.ep, efsdp, policy, False, twice)
        add("last experts", ends_moe, pieces.moe_experts // p.ep, efsdp, policy, True, twice)
    for name, params, ranks, on in tp_moe_units(cfg, p, pieces, shard, dense_on):
        add(name, (n_moe - ends_moe) * on, params, ranks, p.reshard_after_forward, False)
        add(f"last {name}", ends_moe * on, params, ranks, p.reshard_after_forward, True)
    return units


def tp_moe_units(cfg: Config, p, pieces, shard: int, dense_on: bool) -> list[tuple[str, int, int, bool]]:
    """(name, parameters, ranks, wrapped) of a MoE layer's FSDP2 units under TP besides its experts
    (moelab.parallel.fsdp): the router with replicated shared experts, whole, over the dp*cp*tp ranks that route;
    column/row shared experts' TP share over the dense mesh (`shard` = dp*cp ranks)."""
    from moelab.layout.dims import fsdp_wraps

    if p.tp == 1:
        return []
    return [("moe layers", pieces.tp_replicated * p.tp, shard * p.tp, fsdp_wraps(shard * p.tp, cfg)),
            ("shared experts", pieces.tp_shared, shard, dense_on)]


def fsdp_traffic(cfg: Config, units: list[FSDPUnit], m: int, compute_bytes: int) -> dict:
    """Per step for the rank: all-gather and reduce-scatter bytes sent, bytes copied, and one row per unit kind
    (what plan()'s comm reports and moelab.planner.speed times)."""
    reduce_bytes = 2 if cfg.parallel.reduce_dtype == "bfloat16" else 4  # moelab.parallel.fsdp.mixed_precision
    rows, total = [], {"all_gather": 0, "reduce_scatter": 0, "gather_copied": 0, "reduce_copied": 0}
    for u in units:
        b = {k: u.count * v for k, v in fsdp_bytes(u.params, u.ranks, u.gathers_per_micro_batch,
                                                     u.reduce_scatters_per_step, m, compute_bytes,
                                                     reduce_bytes).items()}
        rows.append({**dataclasses.asdict(u), **{f"{k}_bytes_per_step": v for k, v in b.items()}})
        total = {k: total[k] + b[k] for k in total}
    sharded = [u for u in units if u.ranks > 1]  # a one-rank unit (a bf16 cast) issues no collective
    return {"fsdp_all_gathers_per_step": round(sum(u.count * u.gathers_per_micro_batch * m for u in sharded)),
            "fsdp_reduce_scatters_per_step": round(sum(u.count * u.reduce_scatters_per_step for u in sharded)),
            "fsdp_all_gather_bytes_per_step": total["all_gather"],
            "fsdp_reduce_scatter_bytes_per_step": total["reduce_scatter"],
            "fsdp_gather_copied_bytes_per_step": total["gather_copied"],
            "fsdp_reduce_copied_bytes_per_step": total["reduce_copied"], "fsdp_units": rows}
