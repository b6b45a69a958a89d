"""The planner's gathered-weights term for a distributed run: what FSDP2 holds unsharded on one rank
(moelab.parallel.fsdp).

    gathered_params(pieces, [True, True], first=True, last=True, cfg=cfg, p=layout, shard=2, efsdp=1, a=2)

- Units on one-rank meshes are not wrapped unless FSDP2 casts them to bf16 (moelab.layout.dims.fsdp_wraps):
  nothing is gathered for a plain one.
- Wrapped units: the biggest one twice in the compute dtype (the one computing and the one prefetched) and once
  in fp32 (its unsharded gradient before the reduce-scatter), as before; plus every further block kept gathered
  from its forward through its backward by reshard_after_forward=False (parallel.reshard_after_forward and
  expert_reshard_after_forward: torchtitan's default keeps the last block, and under pp > 1 every block, of a
  stage; the first held block is the one already counted as computing).
"""
from __future__ import annotations

from moelab.config import Config
from moelab.layout.dims import fsdp_wraps, reshard_after_forward


def wrapped(cfg: Config, p, shard: int, efsdp: int) -> tuple[bool, bool]:
    """(dense weights, experts) wrapped by FSDP2 (DTensors gathered per unit), as moelab.parallel.fsdp does it;
    `shard`: ranks of the dense mesh, `efsdp`: of the expert mesh."""
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
    dense_on, experts_on = wrapped(cfg, p, shard, efsdp)
    dense_i = [(pieces.moe_layer - pieces.moe_experts if moe else pieces.dense_layer) * dense_on
               for moe in moe_layers]
    experts_i = [(pieces.moe_experts // p.ep if moe else 0) for moe in moe_layers]
    units = [d + e * experts_on for d, e in zip(dense_i, experts_i)]
    units += [pieces.embedding * dense_on] * first + [pieces.head * dense_on] * last
    biggest = max(units, default=0)
    n = len(moe_layers)
    # the experts' own policy where they are their own unit (ep > 1; DDP runs leave theirs at FSDP2's default)
    expert_policy = "always" if p.data_parallel == "ddp" else (
        p.expert_reshard_after_forward if p.ep > 1 else p.reshard_after_forward)
    held = [d * (not reshard_after_forward(p.reshard_after_forward, p.pp, i == n - 1))
            + e * experts_on * (not reshard_after_forward(expert_policy, p.pp, i == n - 1))
            for i, (d, e) in enumerate(zip(dense_i, experts_i))]
    extra_held = sum(held) - max(held, default=0)
    return 2 * biggest * a + biggest * 4 + extra_held * a
