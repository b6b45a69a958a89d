"""The LM head's weight gradient d^T h, accumulated in fp32 over the chunks of a fused loss (moelab.backends.loss's
`chunked`, and its vocabulary-parallel form in moelab.backends.vocab_parallel).

Shapes: C tokens of one chunk, V vocabulary rows (this rank's under tensor parallelism), D hidden.

    dw_VD = weight_grad(d_CV, h_CD)          # the first chunk's term
    add_weight_grad(dw_VD, d_CV, h_CD)       # each further chunk's, added in place
"""
from __future__ import annotations

import torch


def weight_grad(d_CV: torch.Tensor, h_CD: torch.Tensor) -> torch.Tensor:
    """d^T h in fp32: the first chunk's term writes the accumulator (no zeros to read back)."""
    if d_CV.is_cuda and d_CV.dtype != torch.float32:
        try:
            return torch.mm(d_CV.t(), h_CD, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # a torch without mm(out_dtype=)
            pass
    return (d_CV.t() @ h_CD).float()


def add_weight_grad(dw_VD: torch.Tensor, d_CV: torch.Tensor, h_CD: torch.Tensor) -> None:
    """dw += d^T h, accumulated in fp32. On CUDA the bf16 GEMM adds into the fp32 accumulator in place
    (addmm with out_dtype): one read and one write of it per chunk, where a separate fp32 product and an add
    would cost two more passes over [V, D] fp32 per chunk."""
    if dw_VD.dtype == d_CV.dtype:
        dw_VD.addmm_(d_CV.t(), h_CD)
    elif d_CV.is_cuda:
        try:
            torch.addmm(dw_VD, d_CV.t(), h_CD, out_dtype=dw_VD.dtype, out=dw_VD)
        except (TypeError, RuntimeError):  # a torch without addmm(out_dtype=)
            dw_VD.add_(d_CV.t() @ h_CD)
    else:
        dw_VD.add_(d_CV.t() @ h_CD)
