"""Host tensors onto the device without the host waiting for it (one owner: every micro batch and the step's
host-side figures go through to_device)."""
from __future__ import annotations

import torch

PINNED = True
"""to_device stages CUDA copies in pinned memory; False: the pageable copy (a measurement's before,
gallery/scripts/gpu_perf.py --pageable-trial), not a setting."""


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without the host waiting for the device. A plain copy from pageable memory waits
    for every kernel already queued on the stream (46.8 ms behind a 50 ms kernel in issue 41 call 31's check,
    gallery/scripts/gpu_check_copy.py), after which the host launches the next work with an idle GPU; with
    non_blocking=True CUDA's rules still let it wait (the driver staged a 64 KiB micro batch without waiting there).
    On CUDA the tensor is staged in pinned memory (torch's caching host allocator keeps that block until the copy has
    run) and copied non-blocking, which never waits; elsewhere, a plain copy.

        batch_BL = to_device(torch.randint(0, 1000, (2, 4097)), "cuda")   # queued behind the GPU's work
    """
    if torch.device(device).type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return (t.pin_memory() if PINNED else t).to(device, non_blocking=True)
