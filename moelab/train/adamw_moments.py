"""AdamW with its moments stored in a lower precision than the weights (train.optimizer_state=bf16_moments):
fp32 master weights, exp_avg and exp_avg_sq in bf16. Each step reads a tensor's moments, upcasts them, does
torch.optim.AdamW's update in fp32 (the same formulas, in the same order), and stores the moments back rounded
to nearest; the weights are updated in their own dtype. The state keeps torch's layout (`step`, `exp_avg`,
`exp_avg_sq`), so DCP checkpoints save and restore it as they do torch's (in bf16).

    opt = MomentsAdamW(model.parameters(), moment_dtype=torch.bfloat16, lr=1e-3, betas=(0.9, 0.95))
    loss.backward(); opt.step()     # opt.state[p]["exp_avg"].dtype == torch.bfloat16
"""
from __future__ import annotations

import math

import torch


def new_state(p: torch.Tensor, moment_dtype: torch.dtype, step_device: "torch.device | str" = "cpu") -> dict:
    """Fresh AdamW state for `p`: step 0 (a 0-d fp32 tensor, as torch keeps it) and zero moments."""
    return {"step": torch.zeros((), dtype=torch.float32, device=step_device),
            "exp_avg": torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.preserve_format)}


@torch.no_grad()
def moments_step(optimizer: torch.optim.Optimizer, moment_dtype: torch.dtype, skip=()) -> None:
    """One AdamW step over every parameter with a gradient (but those in `skip`, by id), moments kept in
    `moment_dtype` and updated in fp32."""
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("maximize"):
            raise NotImplementedError("AdamW with low-precision moments: amsgrad and maximize are not supported")
        beta1, beta2 = group["betas"]
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None or id(p) in skip:
                continue
            state = optimizer.state[p]
            if not state:
                state.update(new_state(p, moment_dtype))
            state["step"] += 1
            step = float(state["step"])
            g = p.grad.float()
            m = state["exp_avg"].float().lerp_(g, 1 - beta1)
            v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
            p.mul_(1 - lr * wd)
            denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
            if p.dtype == torch.float32:
                p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** step))
            else:
                p.add_((m / denom * (-lr / (1 - beta1 ** step))).to(p.dtype))
            state["exp_avg"].copy_(m)
            state["exp_avg_sq"].copy_(v)


def keep_moments_in(optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> None:
    """Mark `optimizer` as keeping its moments in `dtype` (the attribute `moment_dtype`, kept when
    use_triton_adamw swaps the class) and keep them so across load_state_dict, which casts every state tensor
    to its parameter's dtype."""
    optimizer.moment_dtype = dtype

    def hook(opt: torch.optim.Optimizer) -> None:
        for state in opt.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != dtype:
                    state[key] = state[key].to(dtype)

    optimizer.register_load_state_dict_post_hook(hook)


class MomentsAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (groups, hooks, state layout) whose moments are stored in `moment_dtype` (module
    docstring).

        opt = MomentsAdamW(params, moment_dtype=torch.bfloat16, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    """

    def __init__(self, params, moment_dtype: torch.dtype = torch.bfloat16, **kwargs):
        kwargs.pop("fused", None)  # torch's fused kernel needs the moments in the weights' dtype
        super().__init__(params, **kwargs)
        keep_moments_in(self, moment_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MomentsAdamW.step takes no closure")
        moments_step(self, self.moment_dtype)
        return None
