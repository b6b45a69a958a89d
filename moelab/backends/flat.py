"""Triton kernels that walk a tensor's memory as one flat vector (the optimizer's update, moelab.train.adamw_triton;
the gradient norm, moelab.backends.grad_norm): where such a kernel runs and which tensors it can walk.

    if dense(g) and g.device.type in kernel_devices() and triton_available(): ...   # grid = cdiv(g.numel(), BLOCK)
"""
from __future__ import annotations

import importlib.util
import os

import torch


def triton_available() -> bool:
    """Whether triton is installed (found, not imported: importing it costs seconds)."""
    return importlib.util.find_spec("triton") is not None


def kernel_devices() -> tuple[str, ...]:
    """Where the kernels run: CUDA, and the CPU under Triton's interpreter (TRITON_INTERPRET=1, the tests)."""
    return ("cuda", "cpu") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda",)


def dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill its memory span exactly once, in any dimension order (contiguous, or e.g. the
    transposed experts' weights of backend.experts=sonic): a kernel then walks that span as one flat vector."""
    if t.is_contiguous():
        return True
    span = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):  # innermost dimension first
        if size != 1 and stride != span:
            return False
        span *= size
    return True


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
