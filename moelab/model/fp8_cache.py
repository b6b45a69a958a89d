"""The routed experts' FP8 weights quantised once per optimizer step instead of once per micro batch.

At the Qwen3-30B-A3B proxy's shapes an expert weight is larger than the rows routed to it (512 rows per expert
against K = 2048), so quantising the weights costs more than the FP8 GEMMs save: two e4m3 copies (the forward's,
scaled along K, and the dgrad's, scaled along N) of 604 M elements per layer, about 6 GB of traffic per layer
and micro batch. The weights do not change between the micro batches of one step, so with gradient accumulation
the trainer quantises them once at the start of the step (`expert_weights_cached`) and the FP8 experts read the
cached operands; the cache is marked invalid when the step's micro batches are done, so anything that runs the
model outside them (evaluation, a forward after the optimizer step) quantises afresh and can never see stale
weights. Weights sharded by FSDP (DTensors) are not cached (their full tensor exists only inside the forward).

    with expert_weights_cached(model, torch.bfloat16):   # moelab.train.trainer.Trainer.forward_backward
        for micro_batch in ...: loss(model(micro_batch)).backward()
"""
from __future__ import annotations

import contextlib

import torch

from moelab.model.fp8 import quantize_expert_weight
from moelab.model.fp8_kernel import kernel_applies, quantize_weight_kernel


def _quantize_into(w_EKN: torch.Tensor, dtype: torch.dtype, buffers: tuple | None) -> tuple[torch.Tensor, ...]:
    """The weight's two operands (quantize_expert_weight's), written into `buffers` (None: new ones). On CUDA
    moelab.model.fp8_kernel's tiled kernel writes them (inductor's pass wrote the transposed forward operand
    strided: 37.6 ms per step at the Qwen3 proxy, call 5); else torch (CPU)."""
    if kernel_applies(w_EKN, dtype):
        return (*quantize_weight_kernel(w_EKN, -2, dtype, out=buffers and buffers[:2]),
                *quantize_weight_kernel(w_EKN, -1, dtype, out=buffers and buffers[2:]))
    new = quantize_expert_weight(w_EKN.to(dtype))
    if buffers is None:
        return new
    for buf, t in zip(buffers, new):
        buf.copy_(t)
    return buffers


class ExpertWeightCache:
    """The e4m3 operands of one GroupedExperts' two weights, refreshed by `expert_weights_cached`.

        cache = ExpertWeightCache(experts); cache.refresh(torch.bfloat16); cache.valid  # -> True

    If the refresh fails (a Triton problem on some GPU), caching is switched off for the process with a warning
    and the experts quantise per micro batch, as without the cache (`ExpertWeightCache.error`)."""

    refreshes = 0  # over all caches of the process (benchmarks report it)
    error: str | None = None

    def __init__(self, experts):
        self.experts = experts
        self.valid = False
        self.dtype: torch.dtype | None = None
        self.buffers: tuple | None = None  # (operands of w_gate_up, operands of w_down)

    def supported(self) -> bool:
        from torch.distributed.tensor import DTensor

        return not any(isinstance(w, DTensor) for w in (self.experts.w_gate_up_EDF2, self.experts.w_down_EFD))

    @torch.no_grad()
    def refresh(self, dtype: torch.dtype | None = None) -> None:
        self.valid = False
        if ExpertWeightCache.error is not None or not self.supported():
            return
        weights = (self.experts.w_gate_up_EDF2, self.experts.w_down_EFD)
        dtype = dtype or weights[0].dtype
        # in place after the first time: the same tensors every step (compiled graphs see the same inputs)
        old = self.buffers if self.buffers is not None and self.dtype == dtype else (None, None)
        try:
            self.buffers = tuple(_quantize_into(w.detach(), dtype, bufs) for w, bufs in zip(weights, old))
        except Exception as e:  # noqa: BLE001 (the uncached path computes the same; say so once)
            import warnings

            ExpertWeightCache.error = f"{type(e).__name__}: {str(e)[:300]}"
            warnings.warn(f"FP8 expert weight cache switched off: {ExpertWeightCache.error}", stacklevel=2)
            self.buffers = None
            return
        self.dtype, self.valid = dtype, True
        ExpertWeightCache.refreshes += 1

    def operands(self, dtype: torch.dtype) -> tuple | None:
        """The cached operands for weights computed in `dtype`, or None (not valid, or another dtype)."""
        return self.buffers if self.valid and self.dtype == dtype else None


def attach(model: torch.nn.Module) -> int:
    """Give every FP8 GroupedExperts an (empty, invalid) cache; returns how many."""
    n = 0
    for m in model.modules():
        if getattr(m, "fp8", False) and hasattr(m, "w_gate_up_EDF2"):
            m.fp8_cache = ExpertWeightCache(m)
            n += 1
    return n


@contextlib.contextmanager
def expert_weights_cached(model: torch.nn.Module, dtype: torch.dtype | None = None):
    """Quantise every FP8 expert weight once (in `dtype`, the experts' compute dtype; None = the weights'), valid
    until the block ends."""
    caches = [m.fp8_cache for m in model.modules() if getattr(m, "fp8_cache", None) is not None]
    for c in caches:
        c.refresh(dtype)
    try:
        yield caches
    finally:
        for c in caches:
            c.valid = False
