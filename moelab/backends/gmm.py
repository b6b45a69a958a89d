"""Experts through grouped_gemm's ``gmm`` (CUTLASS grouped GEMM, the kernel of Megablocks and NeMo's "gmm").

Shapes: N routed rows sorted by expert, D hidden, F expert width, E local experts.

gmm takes the rows per expert as a CPU int64 tensor, so this path reads the counts on the host once per layer
(one device synchronisation); torch._grouped_mm takes device offsets and needs none. Rows past the counted
ones (dropped by capacity) are not computed and come back as zeros.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moelab.backends.ops import scale_rows


def gmm_swiglu(x_ND: torch.Tensor, w_gate_up_EDF2: torch.Tensor, w_down_EFD: torch.Tensor,
               counts_E: torch.Tensor, scale_N: torch.Tensor | None = None) -> torch.Tensor:
    """`scale_N`: each row's routing weight, applied before the down projection (moelab.backends.ops.scale_rows)."""
    from grouped_gemm.ops import gmm

    counts_cpu = counts_E.to("cpu", torch.int64)  # the one host synchronisation gmm needs
    total = int(counts_cpu.sum())
    x = x_ND[:total] if total < x_ND.shape[0] else x_ND
    h_NF2 = gmm(x.contiguous(), w_gate_up_EDF2.contiguous(), counts_cpu)
    gate_NF, up_NF = h_NF2.chunk(2, dim=-1)
    a_NF = scale_rows(F.silu(gate_NF) * up_NF, scale_N[:total] if scale_N is not None else None)
    y = gmm(a_NF.contiguous(), w_down_EFD.contiguous(), counts_cpu)
    if total < x_ND.shape[0]:
        y = torch.cat([y, y.new_zeros(x_ND.shape[0] - total, y.shape[1])])
    return y
