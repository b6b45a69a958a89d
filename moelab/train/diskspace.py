"""Disk space for checkpoints: what a save needs (estimated from the state dict), what is free where it goes, and
whether a save that failed ran out of space.

A save is refused before anything is written when the estimate does not fit in the free space; one that runs out
of space anyway (a quota the free-space figure does not show, another writer on the same disk) is recognised from
its exception (no_space_error: ENOSPC / EDQUOT anywhere in the chain, as torch's zip writer hides it under
"unexpected pos ...") or from the space left when it failed (left_too_little). Both give the same message
(moelab.train.checkpoint.DiskFullError).

    need = state_bytes({"model": model.state_dict()})      # tensor bytes + DCP's per-tensor / per-rank overhead
    shortage(need, free_bytes(run_dir))                     # None: it fits; else how many bytes are missing
"""
from __future__ import annotations

import errno
from pathlib import Path

import torch

from moelab.contract.writes import folder_cause, free_bytes  # noqa: F401 - free_bytes: checkpoint.py's too

# Measured on torch 2.13's FileSystemWriter (tiny preset, 2 layers, 126 tensors: 3.51 MB of tensors, 3.75 MB on
# disk): each tensor costs ~1.4 kB of container header and .metadata entry; each rank writes ~36 kB of RNG state
# and metadata.json. Rounded up, so the estimate errs on the side of refusing.
PER_TENSOR_BYTES = 2048
PER_RANK_BYTES = 64 * 1024
# A failed save counts as "out of space" when less than this is free beyond what it still had to write.
SLACK_BYTES = 1 << 20
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def state_bytes(state) -> int:
    """Bytes this rank writes for `state` (nested dicts / lists of tensors, DTensors by their local shard)."""
    total, stack = PER_RANK_BYTES, [state]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        elif isinstance(node, torch.Tensor):
            local = node.to_local() if hasattr(node, "to_local") else node
            total += local.numel() * local.element_size() + PER_TENSOR_BYTES
    return total


def folder_bytes(path: "str | Path") -> int:
    """Bytes of the files under `path` (0 when it does not exist)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def shortage(need: int, free: int) -> "int | None":
    """How many bytes are missing for `need` in `free` (None when it fits)."""
    return need - free if need > free else None


def no_space_error(exc: "BaseException | None") -> bool:
    """Is ENOSPC / EDQUOT anywhere in `exc`'s chain? (DCP wraps each rank's exception in
    CheckpointException.failures; torch's zip writer raises RuntimeError("unexpected pos ...") over it.)"""
    return folder_cause(exc, _NO_SPACE) is not None


def left_too_little(need: int, written: int, free: int) -> bool:
    """After a failed save: is less free than what it still had to write (need - written) plus SLACK_BYTES?"""
    return free < max(need - written, 0) + SLACK_BYTES


def disk_full_message(folder: "str | Path", step: int, need: int, free: int, run_dir: "str | Path",
                      partial: "str | Path | None") -> str:
    """The DiskFullError text: the folder, the bytes needed and free, what was cleaned up, and the fix."""
    done = (f"The partial checkpoint {partial} was removed" if partial else "Nothing was written") + \
        "; older checkpoints are intact."
    return (f"disk full: checkpoint step {step} needs about {need:,} bytes ({_mb(need)}) in {folder}, and "
            f"{free:,} bytes ({_mb(free)}) are free there. {done} Free space and resume: "
            f"moelab resume {run_dir}")


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"
