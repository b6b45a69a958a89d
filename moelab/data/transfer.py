"""Host tensors onto the device without the host waiting for it (one owner: every micro batch and the step's
host-side figures go through to_device)."""
from __future__ import annotations

import torch

PINNED = True
"""to_device stages CUDA copies in pinned memory; False: the pageable copy (a measurement's before,
gallery/scripts/gpu_perf.py --pageable-trial), not a setting."""


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without the host waiting for the device. A copy from pageable memory, also with
    non_blocking=True, waits for every kernel already queued on the stream (CUDA's API synchronisation rules): one
    per micro batch, after which the host launches the forward with an idle GPU. On CUDA the tensor is staged in
    pinned memory (torch's caching host allocator keeps that block until the copy has run) and copied
    non-blocking; elsewhere, a plain copy.

        batch_BL = to_device(torch.randint(0, 1000, (2, 4097)), "cuda")   # queued behind the GPU's work
    """
    if torch.device(device).type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return (t.pin_memory() if PINNED else t).to(device, non_blocking=True)
