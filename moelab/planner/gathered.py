"""The planner's FSDP2 terms for a distributed run: the units a rank holds (moelab.parallel.fsdp), what they keep
unsharded, and the collectives they issue per step.

    gathered_params(pieces, [True, True], first=True, last=True, cfg=cfg, p=layout, shard=2, efsdp=1, a=2)
    units = fsdp_units(pieces, [True, True], True, True, cfg, layout, shard=2, efsdp=1)
    held_unsharded(units, layout, m=4, a=2, pb=4, gathered=...); fsdp_collectives(units, layout, m=4, a=2)

- Units on one-rank meshes are not wrapped unless FSDP2 casts them to bf16 (moelab.layout.dims.fsdp_wraps):
  nothing is gathered for a plain one.
- Wrapped units: the biggest one twice in the compute dtype (the one computing and the one prefetched) and once
  in fp32 (its unsharded gradient before the reduce-scatter), as before; plus every further block kept gathered
  from its forward through its backward by reshard_after_forward=False (parallel.reshard_after_forward and
  expert_reshard_after_forward: torchtitan's default keeps the last block, and under pp > 1 every block, of a
  stage; the first held block is the one already counted as computing).
- Gradient sync once per step (parallel.fsdp_grad_sync=step, and always under pp > 1: moelab.layout.dims.grad_sync)
  with several micro batches: from the first backward to the last, every unit's gradient is held unsharded in
  the reduce dtype and its weights gathered in the compute dtype (``held_unsharded``: what that adds to the
  gathered term and to the sharded gradients, which exist only after the last reduce-scatter; one-rank units'
  gradients are those sharded gradients).
- Collectives per step and unit (``fsdp_collectives``, m micro batches; a unit resharding after forward gathers
  again in backward): micro_batch: m (1 + reshards) all-gathers and m reduce-scatters; step: 1 + m reshards
  all-gathers (the first forward, then each backward of a resharding unit) and one reduce-scatter.
"""
from __future__ import annotations

from dataclasses import dataclass

from moelab.config import Config
from moelab.layout.dims import fsdp_wraps, grad_sync, reshard_after_forward


@dataclass(frozen=True)
class Unit:
    """One FSDP2 unit of a rank: `params` elements sharded over `ranks`, resharded after forward or not (the
    root, the embedding with the final norm and head, stays gathered unless the policy is always).

        Unit(params=4096, ranks=2, reshards=True)
    """
    params: int
    ranks: int
    reshards: bool


def _wrapped(cfg: Config, p, shard: int, efsdp: int) -> tuple[bool, bool]:
    """(the blocks and the root are FSDP2 units, the experts are in one), as moelab.parallel.fsdp and
    moelab.parallel.replicate wrap them."""
    dense_on = p.data_parallel == "fsdp" and fsdp_wraps(shard, cfg)
    if p.data_parallel == "ddp":  # DDP runs wrap the experts on their own, on two or more ranks
        experts_on = p.expert_dp == "fsdp" and efsdp > 1
    elif p.ep == 1:  # the experts are part of their block's unit
        experts_on = p.expert_dp == "fsdp" and dense_on
    else:  # their own unit on the expert-FSDP mesh
        experts_on = p.expert_dp == "fsdp" and fsdp_wraps(efsdp, cfg)
    return dense_on, experts_on


def gathered_params(pieces, moe_layers: list[bool], first: bool, last: bool, cfg: Config, p, shard: int,
                    efsdp: int, a: int) -> int:
    """Bytes of gathered (and cast) weights on a rank holding blocks `moe_layers` (True: MoE), the embedding
    when `first`, the LM head when `last`; `shard`: ranks of the dense mesh, `efsdp`: of the expert mesh,
    `a`: compute dtype bytes."""
    dense_on, experts_on = _wrapped(cfg, p, shard, efsdp)
    dense_i = [(pieces.moe_layer - pieces.moe_experts if moe else pieces.dense_layer) * dense_on
               for moe in moe_layers]
    experts_i = [(pieces.moe_experts // p.ep if moe else 0) for moe in moe_layers]
    units = [d + e * experts_on for d, e in zip(dense_i, experts_i)]
    units += [pieces.embedding * dense_on] * first + [pieces.head * dense_on] * last
    biggest = max(units, default=0)
    n = len(moe_layers)
    # the experts' own policy where they are their own unit (ep > 1, and DDP runs' expert units)
    own = p.ep > 1 or p.data_parallel == "ddp"
    expert_policy = p.expert_reshard_after_forward if own else p.reshard_after_forward
    held = [d * (not reshard_after_forward(p.reshard_after_forward, p.pp, i == n - 1))
            + e * experts_on * (not reshard_after_forward(expert_policy, p.pp, i == n - 1))
            for i, (d, e) in enumerate(zip(dense_i, experts_i))]
    extra_held = sum(held) - max(held, default=0)
    return 2 * biggest * a + biggest * 4 + extra_held * a


def fsdp_units(pieces, moe_layers: list[bool], first: bool, last: bool, cfg: Config, p, shard: int,
               efsdp: int) -> list[Unit]:
    """The FSDP2 units of a rank holding blocks `moe_layers` (True: MoE), the embedding when `first`, the final
    norm and LM head when `last` (moelab.parallel.fsdp.apply_fsdp's order: each block's experts as their own
    unit under EP or DDP, each block, the root)."""
    dense_on, experts_on = _wrapped(cfg, p, shard, efsdp)
    own = p.ep > 1 or p.data_parallel == "ddp"  # the experts are a unit of their own
    expert_policy = p.expert_reshard_after_forward if own else p.reshard_after_forward
    units, n = [], len(moe_layers)
    for i, moe in enumerate(moe_layers):
        e = pieces.moe_experts // p.ep if moe and experts_on else 0
        if own and e:
            units.append(Unit(e, efsdp, reshard_after_forward(expert_policy, p.pp, i == n - 1)))
        if dense_on:
            d = pieces.moe_layer - pieces.moe_experts if moe else pieces.dense_layer
            units.append(Unit(d + (0 if own else e), shard,
                              reshard_after_forward(p.reshard_after_forward, p.pp, i == n - 1)))
    root = pieces.embedding * first + pieces.head * last
    if dense_on and root:
        units.append(Unit(root, shard, p.reshard_after_forward == "always"))
    return units


def _grad_bytes(p) -> int:
    """FSDP2 accumulates unsharded gradients, and reduce-scatters them, in the reduce dtype."""
    return 2 if p.reduce_dtype == "bfloat16" else 4


def held_unsharded(units: list[Unit], p, m: int, a: int, pb: int, gathered: int, trained: bool = True) -> int:
    """Bytes held unsharded between micro batches when gradients are reduced once per step (see the module
    docstring), beyond the `gathered` term and in place of the sharded gradients (`pb` bytes each, counted in the
    plan's gradients: they exist only after the last reduce-scatter); 0 when gradients are reduced every micro
    batch or there is one. `trained`=False (LoRA): the units' weights are frozen, their gradients not counted."""
    if grad_sync(p) != "step" or m == 1:
        return 0
    grads = sum(u.params * _grad_bytes(p) - -(-u.params // u.ranks) * pb for u in units if u.ranks > 1)
    return max(0, sum(u.params * a for u in units) + grads * trained - gathered)


def fsdp_collectives(units: list[Unit], p, m: int, a: int) -> dict:
    """FSDP2's collectives per step on a rank, over units of two or more ranks: calls and bytes sent
    ((ranks - 1) / ranks of a unit's elements, in the compute dtype gathered, in the reduce dtype reduced)."""
    step = grad_sync(p) == "step"
    out = {"fsdp_all_gathers_per_step": 0, "fsdp_reduce_scatters_per_step": 0,
           "fsdp_all_gather_bytes_scheduled": 0, "fsdp_reduce_scatter_bytes_scheduled": 0}
    for u in units:
        if u.ranks < 2:
            continue
        gathers = 1 + m * u.reshards if step else m * (1 + u.reshards)
        reduces = 1 if step else m
        sent = u.params * (u.ranks - 1) / u.ranks
        out["fsdp_all_gathers_per_step"] += gathers
        out["fsdp_reduce_scatters_per_step"] += reduces
        out["fsdp_all_gather_bytes_scheduled"] += int(gathers * sent * a)
        out["fsdp_reduce_scatter_bytes_scheduled"] += int(reduces * sent * _grad_bytes(p))
    return out
