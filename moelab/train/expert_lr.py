"""Per-expert learning rates by utilisation: under-used experts learn faster.

    scale_e = clip(((1 / E) / share_e) ** model.moe.expert_lr_power, 1, model.moe.expert_lr_max_scale)

where share_e is expert e's share of the step's routed tokens (global counts, after dropping: the tokens the
expert actually learned from). An expert at or above its fair share 1/E keeps the base rate; a starved one gets
up to expert_lr_max_scale times it.

Shapes (docs/shapes.md): M MoE layers, E experts (global), X experts of a stacked expert tensor held here (E, or
E/R under EP).
Every parameter of a layer's GroupedExperts is stacked by expert (weights, and GPT-OSS's biases); its first row
is global expert ``experts.expert_offset`` (non-zero under expert parallelism), plus FSDP2's shard offset when
the parameter is a DTensor sharded along the experts.

Why not param groups: the experts of a layer are one stacked [E, ...] tensor, so one expert cannot be a param
group, and Adam's update does not change when its gradient is scaled. So the UPDATE is scaled instead: a
pre-step hook on the optimizer snapshots the expert tensors, and ``apply`` (after the step) sets
w_e = w_e_before + scale_e * (w_e_after - w_e_before). For AdamW (decoupled weight decay included) this is
exactly a step with learning rate lr * scale_e for expert e; the moments are not touched, as they do not depend on
the learning rate. Cost: one copy of this rank's expert weights, alive only during the optimizer step.

    scaler = ExpertLR.attach(optimizer, model.moe_layers(), cfg)   # None when expert_lr_power == 0
    optimizer.step(); scaler.apply(counts_ME)
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from moelab.config import Config


def expert_lr_scales(counts_ME: torch.Tensor, power: float, max_scale: float) -> torch.Tensor:
    """Learning-rate multipliers [M, E] from tokens per expert [M, E] (a layer with no tokens keeps 1)."""
    counts_ME = counts_ME.float()
    E = counts_ME.shape[-1]
    total_M1 = counts_ME.sum(-1, keepdim=True)
    share_ME = counts_ME / total_M1.clamp(min=1e-30)
    scale_ME = ((1.0 / E) / share_ME).pow(power)  # share 0 -> inf -> clipped to max_scale
    scale_ME = scale_ME.clamp(min=1.0, max=max_scale)
    return torch.where(total_M1 > 0, scale_ME, torch.ones_like(scale_ME))


def _local_rows(p: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The rows of a stacked expert parameter held on this rank, and the index of the first one among the
    parameter's rows (non-zero when FSDP2 shards a DTensor along the expert dimension)."""
    if not hasattr(p, "to_local"):
        return p.data, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return p.to_local(), int(offset[0]) if offset else 0


class ExpertLR:
    """Scales each expert's optimizer update by its utilisation (see the module docstring).

    `moe_layers` has one entry per MoE layer of the whole model (None where another pipeline stage holds it),
    in the order of the counts given to ``apply``.

        expert_lr = ExpertLR.attach(optimizer, moe_layers, cfg)   # None unless train.expert_lr_scaling
        expert_lr.apply(counts_ME)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, moe_layers: Sequence, power: float, max_scale: float):
        self.power, self.max_scale = power, max_scale
        # (layer index, global id of the first expert held here, parameter) for every stacked expert tensor
        self.params = [(i, getattr(moe.experts, "expert_offset", 0), p) for i, moe in enumerate(moe_layers)
                       if moe is not None for p in moe.experts.parameters() if p.requires_grad]  # LoRA: adapters
        self._before: list[torch.Tensor] | None = None
        self._hook = optimizer.register_step_pre_hook(self._snapshot)

    @classmethod
    def attach(cls, optimizer: torch.optim.Optimizer, moe_layers: Sequence, cfg: Config) -> "ExpertLR | None":
        """An ExpertLR hooked on `optimizer`, or None when the config leaves it off (expert_lr_power == 0)."""
        moe = cfg.model.moe
        if moe.expert_lr_power <= 0:
            return None
        return cls(optimizer, moe_layers, moe.expert_lr_power, moe.expert_lr_max_scale)

    @torch.no_grad()
    def _snapshot(self, optimizer, args, kwargs) -> None:
        self._before = [_local_rows(p)[0].clone() for _, _, p in self.params]

    @torch.no_grad()
    def apply(self, counts_ME: torch.Tensor) -> torch.Tensor:
        """After optimizer.step(): rescale this step's expert updates. counts_ME: the step's global tokens per
        expert [M, E]. Returns the scales [M, E] (device tensor; nothing is synchronised)."""
        if self._before is None:
            raise RuntimeError("ExpertLR.apply needs an optimizer.step() since the last apply")
        scale_ME = expert_lr_scales(counts_ME, self.power, self.max_scale)
        for (layer, first, p), before_X in zip(self.params, self._before):
            after_X, row0 = _local_rows(p)
            start = first + row0
            s_X = scale_ME[layer, start:start + after_X.shape[0]].to(after_X.dtype)
            s_X = s_X.view(-1, *([1] * (after_X.dim() - 1)))
            # before + s * (after - before); lerp computes it from `after` for s >= 0.5, so s = 1 is exact
            after_X.copy_(before_X.lerp_(after_X, s_X))
        self._before = None  # free the snapshot before the next forward
        return scale_ME

    def remove(self) -> None:
        """Unhook from the optimizer."""
        self._hook.remove()
