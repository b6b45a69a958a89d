"""The planner's FSDP2 memory terms for a distributed run: what a rank's units (moelab.planner.comm.fsdp_units,
which also counts their collectives) keep gathered or unsharded.

    gathered_params(pieces, [True, True], first=True, last=True, cfg=cfg, p=layout, shard=2, efsdp=1, a=2)
    held_unsharded(fsdp_units(cfg, layout, pieces, [True, True], True, True, 2, 1, m=4), layout, m=4, a=2, pb=4,
                   gathered=...)

- Units on one-rank meshes are not wrapped unless FSDP2 casts them to bf16 (moelab.layout.dims.fsdp_wraps):
  nothing is gathered for a plain one. Planned as code from before 6131a2c (one_rank="wrapped":
  moelab.planner.comm.FSDP_ONE_RANK) every unit is wrapped and counted as a sharded one.
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
"""
from __future__ import annotations

from moelab.config import Config
from moelab.layout.dims import grad_sync, reshard_after_forward
from moelab.planner.comm import wrapped


def gathered_params(pieces, moe_layers: list[bool], first: bool, last: bool, cfg: Config, p, shard: int,
                    efsdp: int, a: int, one_rank: str = "plain") -> int:
    """Bytes of gathered (and cast) weights on a rank holding blocks `moe_layers` (True: MoE), the embedding
    when `first`, the LM head when `last`; `shard`: ranks of the dense mesh, `efsdp`: of the expert mesh,
    `a`: compute dtype bytes; `one_rank`: what the code does with one-rank meshes (moelab.planner.comm.wrapped)."""
    dense_on, experts_on = wrapped(cfg, p, shard, efsdp, one_rank)
    whole = pieces.tp_replicated * p.tp  # TP: a MoE layer's router (+ replicated shared experts), gathered whole
    dense_i = [((pieces.moe_layer - pieces.moe_experts - pieces.tp_replicated) * dense_on + whole if moe
                else pieces.dense_layer * dense_on) for moe in moe_layers]
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


def _grad_bytes(p) -> int:
    """FSDP2 accumulates unsharded gradients, and reduce-scatters them, in the reduce dtype."""
    return 2 if p.reduce_dtype == "bfloat16" else 4


def held_unsharded(units: list, p, m: int, a: int, pb: int, gathered: int, trained: bool = True) -> int:
    """Bytes held unsharded between micro batches when gradients are reduced once per step (see the module
    docstring), beyond the `gathered` term and in place of the sharded gradients (`pb` bytes each, counted in the
    plan's gradients: they exist only after the last reduce-scatter); 0 when gradients are reduced every micro
    batch or there is one. `trained`=False (LoRA): the units' weights are frozen, their gradients not counted."""
    if grad_sync(p) != "step" or m == 1:
        return 0
    grads = sum(u.count * (u.params * _grad_bytes(p) - -(-u.params // u.ranks) * pb) for u in units if u.ranks > 1)
    return max(0, sum(u.count * u.params * a for u in units) + grads * trained - gathered)
