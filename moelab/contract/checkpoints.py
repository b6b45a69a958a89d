"""A run's checkpoints on disk: the folder layout, the listing, metadata.json and verification (read-only).

The layout (written by moelab.train.checkpoint.Checkpointer, every rank together):

    checkpoints/step_000010/
        .metadata, __<rank>_<n>.distcp   torch.distributed.checkpoint (DCP): model and optimizer state as global
                                         tensors, so any layout loads any other's checkpoint
        rng/rank_00000.json              each rank's RNG states
        rank_state/rank_00000.pt         each rank's own training state, where the layout has one
        metadata.json                    step, config identity and hash, world size, layout, every file's size
                                         and crc32, and its own crc32: written last, so it means "complete"
    checkpoints/.step_000010.tmp/        a save in progress; renamed to step_000010 when complete (atomic)
    checkpoints/step_000010.corrupt-<t>  a folder that failed verification, set aside by a restore

Everything here reads files with the standard library only, so the views, the launcher, the fork and the HF
export can list and check checkpoints without importing the trainer (or torch).

    list_checkpoints("runs/tiny")            # [.../checkpoints/step_000005, .../step_000010]
    latest_checkpoint("runs/tiny")           # the newest one that verifies, or None
    read_metadata(path)["step"]              # 10; CheckpointError when incomplete or corrupt
    verify(path)                             # [] when complete and intact, else what is wrong
"""
from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

from moelab.contract.folder import CHECKPOINT_METADATA, CHECKPOINT_RANK_STATE, CHECKPOINT_RNG, CHECKPOINTS

FORMAT = 1  # metadata.json's format; a newer one is refused
_STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the folder and what is wrong with it.

        try: read_metadata("runs/a/checkpoints/step_000010")
        except CheckpointError as e: print(e)   # ".../step_000010: no metadata.json (the save did not finish)"
    """


def checkpoint_dir(run_dir: "str | Path") -> Path:
    """RUN/checkpoints."""
    return Path(run_dir) / CHECKPOINTS


def step_dir_name(step: int) -> str:
    """The folder name of step `step`'s checkpoint: step_000010."""
    return f"step_{step:06d}"


def rng_file(rank: int) -> str:
    """A rank's RNG states inside a checkpoint folder: rng/rank_00003.json."""
    return f"{CHECKPOINT_RNG}/rank_{rank:05d}.json"


def rank_state_file(rank: int) -> str:
    """A rank's own training state inside a checkpoint folder: rank_state/rank_00003.pt."""
    return f"{CHECKPOINT_RANK_STATE}/rank_{rank:05d}.pt"


def list_checkpoints(run_dir: "str | Path") -> list[Path]:
    """Checkpoint folders of a run (complete or not), oldest first; temp and quarantined folders excluded."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(p.name[5:]))


def read_metadata(path: "str | Path") -> dict:
    """A checkpoint's metadata.json; CheckpointError if it is missing or unreadable."""
    path = Path(path)
    try:
        meta = json.loads((path / CHECKPOINT_METADATA).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {CHECKPOINT_METADATA} (the save did not finish)") from None
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path}: {CHECKPOINT_METADATA} is unreadable ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict) or "step" not in meta:
        raise CheckpointError(f"{path}: {CHECKPOINT_METADATA} lacks 'step' or 'files'")
    if meta.pop("crc32", None) != json_crc32(meta):
        raise CheckpointError(f"{path}: {CHECKPOINT_METADATA} fails its crc32 check (corrupt)")
    if meta["step"] != int(path.name[5:]):
        raise CheckpointError(f"{path}: {CHECKPOINT_METADATA} says step {meta['step']}, not the folder's step")
    if meta.get("format", FORMAT) > FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {meta['format']} is newer than this moelab reads")
    return meta


def is_complete(path: "str | Path") -> bool:
    """Does the checkpoint folder hold its metadata.json (the save finished; it may still fail verify)?"""
    return (Path(path) / CHECKPOINT_METADATA).is_file()


def verify_files(path: Path, files: dict, names: "list[str] | None" = None) -> list[str]:
    """Problems (missing, truncated, corrupt) of the listed files, or of `names` among them."""
    problems = []
    for name in names if names is not None else sorted(files):
        want, f = files[name], path / name
        if not f.is_file():
            problems.append(f"{name} is missing")
        elif f.stat().st_size != want["size"]:
            problems.append(f"{name} is {f.stat().st_size} bytes, expected {want['size']} (truncated)")
        elif file_crc32(f) != want["crc32"]:
            problems.append(f"{name} fails its crc32 check (corrupt)")
    return problems


def verify(path: "str | Path") -> list[str]:
    """Everything wrong with one checkpoint folder (empty = complete and intact), from one process."""
    try:
        meta = read_metadata(path)
    except CheckpointError as e:
        return [str(e)]
    return [f"{path}: {p}" for p in verify_files(Path(path), meta["files"])]


def latest_checkpoint(run_dir: "str | Path") -> Path | None:
    """The newest complete, intact checkpoint of a run (None if there is none)."""
    for path in reversed(list_checkpoints(run_dir)):
        if not verify(path):
            return path
    return None


def checkpoint_steps(run_dir: "str | Path") -> list[int]:
    """The steps of a run's complete, intact checkpoints, oldest first (what a fork or a resume may start from)."""
    return [int(read_metadata(p)["step"]) for p in list_checkpoints(run_dir) if not verify(p)]


def file_crc32(path: Path) -> int:
    """crc32 of a file, read in 16 MiB chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def json_crc32(obj: dict) -> int:
    """crc32 of a JSON object as metadata.json checks itself (sorted keys)."""
    return zlib.crc32(json.dumps(obj, sort_keys=True).encode())


def file_record(path: Path) -> dict:
    """A file's entry in metadata.json's "files": size and crc32."""
    return {"size": path.stat().st_size, "crc32": file_crc32(path)}


def decided_in(checkpoint: "str | Path") -> set[str]:
    """The ids of the requests decided inside a checkpoint (rank 0's rank_state: the changes in force and
    control_ids); an empty set for a checkpoint saved before any. The one reader here that imports torch
    (the rank state is a torch file), when called."""
    import torch

    path = Path(checkpoint) / rank_state_file(0)
    if not path.is_file():
        return set()
    state = torch.load(path, map_location="cpu")
    return {r["id"] for r in state.get("controls", [])} | set(state.get("control_ids", ()))
