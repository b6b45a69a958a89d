"""Routed experts stored stacked, computed as one grouped GEMM or a reference loop.

Shapes: N routed rows (tokens x top-k, sorted by expert), D hidden, F expert width, E local experts.
Weights: w_gate_up_EDF2 = [gate | up] of every expert, w_down_EFD.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def grouped_mm_supported(x: torch.Tensor, *dims: int) -> bool:
    """torch._grouped_mm needs 16-byte aligned strides; on CUDA it needs bf16 on sm80+; on CPU, fp32 works."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if any((d * x.element_size()) % 16 for d in dims):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 8
    return x.device.type == "cpu" and x.dtype == torch.float32


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, dim: int, ffn: int, impl: str = "auto"):
        super().__init__()
        self.num_experts, self.dim, self.ffn = num_experts, dim, ffn
        self.impl = impl  # auto | grouped_mm | loop; other backends replace forward_impl (moelab.backends)
        self.w_gate_up_EDF2 = nn.Parameter(torch.empty(num_experts, dim, 2 * ffn))
        self.w_down_EFD = nn.Parameter(torch.empty(num_experts, ffn, dim))

    def forward(self, x_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """x_ND: rows sorted by expert; counts_E: rows per expert (rows past their sum are ignored)."""
        w1, w2 = self.w_gate_up_EDF2, self.w_down_EFD
        if w1.dtype != x_ND.dtype:  # fp32 master weights with a bf16 compute dtype
            w1, w2 = w1.to(x_ND.dtype), w2.to(x_ND.dtype)
        impl = self.impl
        if impl == "auto":
            impl = "grouped_mm" if grouped_mm_supported(x_ND, self.dim, 2 * self.ffn) else "loop"
        if impl == "grouped_mm":
            return grouped_mm_swiglu(x_ND, w1, w2, counts_E)
        return loop_swiglu(x_ND, w1, w2, counts_E)


def grouped_mm_swiglu(x_ND, w_gate_up_EDF2, w_down_EFD, counts_E):
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    h_NF2 = torch._grouped_mm(x_ND, w_gate_up_EDF2, offs=offs_E)
    gate_NF, up_NF = h_NF2.chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate_NF) * up_NF, w_down_EFD, offs=offs_E)


def loop_swiglu(x_ND, w_gate_up_EDF2, w_down_EFD, counts_E):
    """Reference: one matmul pair per expert. Reads the counts on the host (one synchronisation)."""
    out = torch.zeros_like(x_ND)
    start = 0
    for e, n in enumerate(counts_E.tolist()):
        if n:
            h = x_ND[start:start + n] @ w_gate_up_EDF2[e]
            gate, up = h.chunk(2, dim=-1)
            out[start:start + n] = (F.silu(gate) * up) @ w_down_EFD[e]
        start += n
    return out
