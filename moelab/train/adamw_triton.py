"""AdamW with one Triton kernel per large CUDA tensor (train.optimizer=adamw_triton, and auto's choice on CUDA:
moelab.train.optim.build_optimizer; first measured by gallery/scripts/gpu_perf.py for issue 17).

torch's fused AdamW moved the Qwen3 proxy's 78 GB of bf16 parameters, gradients and states at 2.7 TB/s of the
4.3 measured on an H200 (29 ms per step). This class keeps torch.optim.AdamW's math, parameter groups, hooks
and state layout (`step`, `exp_avg`, `exp_avg_sq`: checkpoints are interchangeable) and updates every CUDA
tensor of at least MIN_NUMEL elements with one kernel that reads each of p, g, m, v once with wide loads and
writes p, m, v once, bias corrections computed on the device from the `step` tensor (no host sync); the other
parameters (small vectors, CPU tensors) go through torch's own AdamW step. FSDP2's DTensors are updated through
their local shards (the update is per element, so a shard's update is the whole tensor's, restricted).
Moments in bf16 next to fp32 weights (train.optimizer_state=bf16_moments, moelab.train.adamw_moments) are read and
updated in fp32 by the kernel and stored rounded to nearest; the other parameters then take MomentsAdamW's step.

    opt = TritonAdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    use_triton_adamw(existing_torch_adamw)   # in place, state and hooks kept
"""
from __future__ import annotations

import functools
import math

import torch

from moelab.backends.flat import cdiv, dense, kernel_devices
from moelab.backends.grad_norm import scale_grads
from moelab.train.adamw_moments import keep_moments_in, moments_step, new_state


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _same_layout(p: torch.Tensor, *others: torch.Tensor) -> bool:
    """p dense, and every other tensor the same shape and strides: element i of each span is the same element."""
    return dense(p) and all(o.shape == p.shape and o.stride() == p.stride() for o in others)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, step_ptr, scale_ptr, n, lr, beta1, beta2, log2_beta1, log2_beta2,
                     eps, weight_decay, SCALE: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        step = tl.load(step_ptr).to(tl.float32)
        bc1 = 1.0 - tl.exp2(step * log2_beta1)
        bc2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if SCALE == 1:  # clipping's multiply of an fp32 gradient, rounded once as torch's multiply pass stores it
            if INTERPRETED:  # (numpy contracts nothing; on the GPU a multiply-add could skip the rounding)
                g = g * tl.load(scale_ptr)
            else:
                g = libdevice.mul_rn(g, tl.load(scale_ptr))
        if SCALE == 2:  # a narrower gradient: the product of two bf16 / fp16 values is exact in fp32, then rounded
            g = (g * tl.load(scale_ptr).to(tl.float32)).to(g_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            g = g.to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        p = p * (1.0 - lr * weight_decay)
        m = m + (g - m) * (1.0 - beta1)  # torch's lerp for weights below 0.5
        v = v * beta2 + g * g * (1.0 - beta2)
        denom = tl.sqrt(v) / bc2_sqrt + eps
        p = p - (lr / bc1) * (m / denom)
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)

    return adamw_kernel


BLOCK, WARPS = 1024, 4  # elements of each tensor per program, and its warps (gallery/scripts/gpu_check_adamw.py)


def _like(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """t's values in p's layout (a moment loaded from a checkpoint in another one)."""
    return torch.empty_like(p, dtype=t.dtype).copy_(t)


def adamw_update(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay, scale=None) -> None:
    """One AdamW update of p, m, v (in place) from g, all dense in one layout (``_same_layout``); `step` (a 0-d
    tensor) already counts this step. `scale` (a 0-d tensor in g's dtype, or None): the update reads g * scale,
    rounded into g's dtype as torch's multiply of a CUDA tensor by a 0-d CUDA tensor stores it (gradient
    clipping's multiply; g itself is not written). Runs under TRITON_INTERPRET=1 on CPU tensors too (the tests)."""
    n = p.numel()
    if scale is not None and scale.dtype != g.dtype:
        raise ValueError(f"adamw_update: scale is {scale.dtype}, the gradient {g.dtype}: pass the factor in the "
                         "gradient's dtype (torch multiplies a tensor by a 0-d tensor in the tensor's dtype)")
    kind = 0 if scale is None else 1 if g.dtype == torch.float32 else 2
    _kernel()[(cdiv(n, BLOCK),)](p, g, m, v, step, step if scale is None else scale, n, float(lr), float(beta1),
                                 float(beta2), math.log2(beta1), math.log2(beta2), float(eps), float(weight_decay),
                                 SCALE=kind, INTERPRETED=g.device.type == "cpu", BLOCK=BLOCK, num_warps=WARPS)


def use_triton_adamw(optimizer: torch.optim.AdamW) -> torch.optim.AdamW:
    """Switch an existing torch AdamW (state, groups and hooks kept) to TritonAdamW in place."""
    optimizer.__class__ = TritonAdamW
    optimizer._patch_step_function()  # the step hooks (e.g. moelab.train.expert_lr) run around the new step
    return optimizer


class TritonAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose large CUDA tensors are updated by one Triton kernel each (module docstring).

        opt = TritonAdamW(model.parameters(), lr=1e-3, fused=True); loss.backward(); opt.step()
    """

    MIN_NUMEL = 1 << 20
    DEVICES = kernel_devices()

    def __init__(self, params, moment_dtype: "torch.dtype | None" = None, **kwargs):
        """`moment_dtype`: store the moments in it (bf16 beside fp32 weights: train.optimizer_state=bf16_moments);
        None: in the parameters' dtype, as torch does."""
        if moment_dtype is not None:
            kwargs.pop("fused", None)  # the tensors the kernel does not take go through MomentsAdamW's step
        super().__init__(params, **kwargs)
        if moment_dtype is not None:
            keep_moments_in(self, moment_dtype)

    def clip_in_step(self, coef: "torch.Tensor | None") -> None:
        """Gradient clipping's multiply, done by this optimizer's next step() calls (until set again): the kernel
        reads each large gradient times `coef` (the factor in the gradient's dtype, the product rounded into it,
        as torch's multiply of a CUDA gradient stores it) and leaves the gradient as it is; the other gradients
        are multiplied in place first, as clipping did. `coef`: the 0-d factor clipping would multiply by
        (moelab.parallel's clip_grad_norm), or None (no clipping). On the GPU the update is bitwise that of the
        multiply pass and then step() (gallery/scripts/gpu_check_clip.py; under Triton's interpreter
        tests/train/test_adamw_triton.py), with one read and write of every large gradient fewer: on the Qwen3
        proxy's 11 GB of bf16 gradients a pass of 22 GB, which torch runs at 1 TB/s (a bf16 gradient and an fp32
        factor take its slow path)."""
        self._clip_coef = coef

    def _kernel_params(self, group) -> list:
        if group.get("amsgrad") or group.get("maximize") or group.get("differentiable") or group.get("capturable"):
            return []
        out = []
        for p in group["params"]:
            if p.grad is None or p.grad.is_sparse or p.device.type not in self.DEVICES:
                continue
            lp, lg = _local(p), _local(p.grad)
            if lp.numel() >= self.MIN_NUMEL and _same_layout(lp, lg):
                out.append(p)
        return out

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("TritonAdamW.step takes no closure")
        hidden = []
        moments = getattr(self, "moment_dtype", None)  # MomentsAdamW's (train.optimizer_state=bf16_moments)
        coef = getattr(self, "_clip_coef", None)  # clip_in_step's
        if coef is not None and coef.is_cuda:  # read on this stream (train.optimizer_overlap's side stream)
            coef.record_stream(torch.cuda.current_stream(coef.device))
        factor: dict[torch.dtype, torch.Tensor] = {}  # coef in each gradient dtype, as torch's multiply takes it
        for group in self.param_groups:
            params = self._kernel_params(group)
            steps = []
            for p in params:
                state = self.state[p]
                if not state:
                    state.update(new_state(p, moments or p.dtype, p.device))
                steps.append(state["step"])
            if steps:
                torch._foreach_add_(steps, 1.0)
            beta1, beta2 = group["betas"]
            for p in params:
                s = self.state[p]
                m, v = _local(s["exp_avg"]), _local(s["exp_avg_sq"])
                if not _same_layout(_local(p), m, v):  # a state loaded in another layout
                    s["exp_avg"], s["exp_avg_sq"] = (_like(p, s["exp_avg"]), _like(p, s["exp_avg_sq"]))
                    m, v = _local(s["exp_avg"]), _local(s["exp_avg_sq"])
                adamw_update(_local(p), _local(p.grad), m, v, s["step"], group["lr"], beta1, beta2,
                             group["eps"], group["weight_decay"],
                             scale=None if coef is None else factor.setdefault(p.grad.dtype, coef.to(p.grad.dtype)))
                hidden.append((p, p.grad))
                p.grad = None  # torch's step below skips it
        if coef is not None:  # the gradients torch's step takes: clipping's multiply, as clipping made it
            scale_grads([_local(p.grad) for group in self.param_groups for p in group["params"]
                         if p.grad is not None], coef)
        base = torch.optim.AdamW.step  # torch's step for the rest, without running the step hooks a second time
        if getattr(base, "hooked", False):
            base = base.__wrapped__
        try:
            if moments is not None and moments != torch.float32:
                moments_step(self, moments)  # the rest with low-precision moments: updated in fp32, stored back
            else:
                base(self)
        finally:
            for p, g in hidden:
                p.grad = g
        return None
