"""Checkpoints: sharded with torch.distributed.checkpoint (DCP), loadable into another layout.

A checkpoint is a folder of the run folder, written by every rank together (the layout, its listing,
metadata.json and verification are moelab.contract.checkpoints: readers need not import this module):

    checkpoints/step_000010/
        .metadata, __<rank>_<n>.distcp   DCP: model and optimizer state, saved as GLOBAL tensors: FSDP2 DTensors
                                         by shard, and with expert parallelism each rank's experts as its rows
                                         of one [num_experts, ...] tensor (`global_experts`), so any layout
                                         loads any other's checkpoint
        rng/rank_00000.json              each rank's RNG states (torch, cuda, python, numpy), as JSON
        rank_state/rank_00000.pt         each rank's own training state, where the layout has one (the 1-bit
                                         expert-gradient exchange's error-feedback residuals)
        metadata.json                    step, config identity and hash, world size, layout, every file's size
                                         and crc32, and its own crc32: written last, so it means "complete";
                                         with train.lora, "base": where the frozen base comes from (the model
                                         state then holds only what trains, and the routers' buffers)
    checkpoints/.step_000010.tmp/        a save in progress; renamed to step_000010 when complete (atomic)

What makes a resume exact: the model state dict holds the parameters and the Router's persistent buffers
(expert_bias, capacity_factor, load_history, history_len); the optimizer state dict holds AdamW's moments and
step counts; the data is indexed by (seed, step, sample), so the step IS the data position; the learning rate is
a function of the step. Nothing else carries over between steps.

A folder that fails verification (no metadata.json, a missing, truncated or corrupt file, a step that does not
match its name) is never loaded: `restore` reports it in a warning, renames it to `step_N.corrupt-<time>` and
falls back to the previous complete checkpoint, or raises CheckpointError when there is none. The run folder is
assumed to be on a file system every rank sees (as SLURM clusters provide).

    ckpt = Checkpointer(run_dir, cfg, env, layout)   # refuses checkpoints of another config (ConfigError)
    ckpt.save(10, model, optimizer)                   # collective: every rank calls it
    restored = ckpt.restore(model, optimizer, RunFolder(run_dir).metrics)   # restored.step == 10
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import random
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moelab.config import Config, ConfigError
from moelab.train import diskspace
from moelab.train.checkpoint_experts import copy_back, global_experts
from moelab.contract.checkpoints import (FORMAT, CheckpointError, checkpoint_dir, file_record, is_complete,
                                         json_crc32, list_checkpoints, rank_state_file, read_metadata, rng_file,
                                         step_dir_name, verify_files)
from moelab.contract.folder import CHECKPOINT_METADATA, CHECKPOINT_RANK_STATE, CHECKPOINT_RNG, RunFolder
from moelab.contract.stream import rewind_metrics, write_durably
from moelab.contract.writes import FolderWriteError, folder_cause

# Config fields that may change between a checkpoint and its resume: the length of the run, checkpointing and
# failure policy, and everything about placement (layout, kernels, device) that does not change the maths.
RESUMABLE_FIELDS = ("name", "parallel", "backend", "train.steps", "train.checkpoint_every",
                    "train.keep_checkpoints", "train.save_checkpoints", "train.collective_timeout_s",
                    "train.on_nan", "train.device", "train.activation_checkpointing", "train.compile",
                    "train.micro_batch_size", "train.optimizer")


class DiskFullError(CheckpointError):
    """A checkpoint that does not fit on the disk: refused before writing, or stopped when the disk filled up
    (its partial folder removed). The message names the folder, the bytes needed and free, and the fix:
    "disk full: checkpoint step 6 needs about 3,752,548 bytes (3.6 MiB) in runs/x/checkpoints, and ... are free
    there. ... Free space and resume: moelab resume runs/x"."""


@dataclass
class Restored:
    """What `Checkpointer.restore` did: the step to continue after (0 = fresh start), the folder it loaded,
    warnings for the stream (skipped corrupt checkpoints, a changed layout, a cut metrics line), and the step
    events the stream keeps from before (for the run's summary)."""
    step: int = 0
    path: Path | None = None
    warnings: list[dict] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    rank_state: dict = field(default_factory=dict)  # this rank's own state (Parallelized.rank_state)


# ---------------------------------------------------------------------- what a resume must match
def config_identity(cfg: Config) -> dict:
    """The config with RESUMABLE_FIELDS removed: what must match for a checkpoint to be resumed."""
    d = cfg.to_dict()
    for dotted in RESUMABLE_FIELDS:
        *parents, last = dotted.split(".")
        node = d
        for p in parents:
            node = node.get(p, {})
        node.pop(last, None)
    return d


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(json.dumps(config_identity(cfg), sort_keys=True).encode()).hexdigest()[:16]


def _diff(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [f"{prefix.rstrip('.')}: {a!r} -> {b!r}"]


# ---------------------------------------------------------------------- save and restore (collective)
@contextlib.contextmanager
def one_process_is_meant(single: bool):
    """torch.distributed.checkpoint warns "torch.distributed is disabled ... assuming the intent is to save in a
    single process" even when told so with no_dist=True: on one process that is the intent, so that one warning is
    silenced there (and only there)."""
    with warnings.catch_warnings():
        if single:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


class Checkpointer:
    """Saves and restores one run's checkpoints; every rank makes the same calls (they are collectives)."""

    def __init__(self, run_dir: "str | Path", cfg: Config, env, layout):
        self.run_dir, self.root = Path(run_dir), checkpoint_dir(run_dir)
        self.cfg, self.env, self.layout = cfg, env, layout
        self.check_config()

    def state_options(self):
        """LoRA (train.lora): the model state holds only what trains (adapters, a trained router) and the routers'
        buffers; the frozen base is re-created by the run's setup (seed or checkpoint) before a restore."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=True, strict=False) if self.cfg.train.lora.rank else None

    # ------------------------------------------------------------------ collectives (trivial on one process)
    @property
    def _dist(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def _rank(self) -> int:
        return dist.get_rank() if self._dist else 0

    @property
    def _world(self) -> int:
        return dist.get_world_size() if self._dist else 1

    def _broadcast(self, obj):
        if not self._dist:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _gather(self, obj) -> list:
        if not self._dist:
            return [obj]
        out = [None] * self._world
        dist.all_gather_object(out, obj)
        return out

    def _barrier(self) -> None:
        if self._dist:
            dist.barrier()

    # ------------------------------------------------------------------ config check
    def check_config(self) -> None:
        """Refuse (ConfigError) to resume checkpoints written by a different model, data or optimizer config."""
        for path in reversed(list_checkpoints(self.run_dir)):
            try:
                meta = read_metadata(path)
            except CheckpointError:
                continue
            if meta.get("config_hash") != config_hash(self.cfg):
                changes = _diff(meta.get("config", {}), config_identity(self.cfg))
                raise ConfigError(
                    f"run folder {self.run_dir} has checkpoints of a different config ({'; '.join(changes[:6])}). "
                    f"Resume with its own config ({RunFolder(self.run_dir).config}) or use a new run folder")
            return

    # ------------------------------------------------------------------ save
    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meshes=None,
             check_space: bool = True, rank_state: dict | None = None) -> Path:
        """Write checkpoints/step_<step> (collective); keep the newest `train.keep_checkpoints`. `meshes`: the
        layout's moelab.parallel.mesh.Meshes when there is one (needed with expert parallelism). Refused with
        DiskFullError before anything is written when the size estimated from the state dict is more than the
        free space (`check_space=False` skips that check: as where a quota hides the real limit, the save then
        meets the full disk while writing). A save that fails removes its partial folder (where it can; a
        partial folder is never loaded); every rank raises DiskFullError when it ran out of space,
        FolderWriteError (moelab.contract.writes, as any write to the run folder) when the folder cannot be
        written (read-only, not ours), CheckpointError otherwise; older checkpoints stay intact."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        name = step_dir_name(step)
        final, tmp = self.root / name, self.root / f".{name}.tmp"
        model_sd, optim_sd = get_state_dict(model, optimizer, options=self.state_options())
        state = global_experts({"model": model_sd, "optim": optim_sd}, meshes)
        need = sum(self._gather(diskspace.state_bytes(state)))
        self._check_space(step, tmp, need, check_space)
        error, mine = self._write_parts(tmp, state, rank_state)
        parts = self._gather({"files": mine, "error": None if error is None else _describe(error),
                              "cause": _cause(error)})
        failure = next((p["error"] for p in parts if p["error"]), None)
        outcome = None  # rank 0: None when saved, else what every rank raises (_failed)
        if self._rank == 0:
            if failure is None:
                try:
                    self._finish(step, tmp, final, {f: r for p in parts for f, r in p["files"].items()})
                except Exception as e:
                    error, failure = e, _describe(e)
                    parts.append({"cause": _cause(e)})
            if failure is not None:
                outcome = self._failed(step, tmp, need, failure, {p["cause"] for p in parts} - {None})
        outcome = self._broadcast(outcome)
        if outcome is None:
            return final
        kind, message, err, free = outcome
        if kind == "folder":
            raise FolderWriteError(err, tmp, need, free=free, left=message,
                                   then=f"resume the run (`moelab resume {self.run_dir}`)") from error
        raise (DiskFullError if kind == "disk" else CheckpointError)(message) from error

    def _check_space(self, step: int, tmp: Path, need: int, check_space: bool) -> None:
        """Rank 0 clears a save that died half way and, with `check_space`, compares `need` with the free space;
        every rank raises the same DiskFullError when it does not fit."""
        refusal = None
        if self._rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a save that died half way
            free = diskspace.free_bytes(self.root)
            if check_space and diskspace.shortage(need, free):
                refusal = diskspace.disk_full_message(self.root, step, need, free, self.run_dir, None)
        refusal = self._broadcast(refusal)
        if refusal:
            raise DiskFullError(refusal)

    def _write_parts(self, tmp: Path, state: dict, rank_state: dict | None) -> tuple:
        """Every rank writes its part into `tmp` (DCP's shards, its RNG states, its own state); returns (the
        error it met or None, {file: size and crc32} of the files it wrote). Rank 0 creates the folder first;
        DCP's .metadata is left for rank 0 to record (_finish)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        error, mine = None, {}
        if self._rank == 0:
            try:
                (tmp / CHECKPOINT_RNG).mkdir(parents=True)
            except OSError as e:  # a read-only folder: every rank hears of it (no rank waits in DCP's collectives)
                error = e
        try:
            if not self._broadcast(error is None):  # also the barrier: the folder exists for every rank
                raise CheckpointError(f"rank 0 could not create {tmp}")
            with one_process_is_meant(not self._dist):
                dcp.save(state, checkpoint_id=tmp, no_dist=not self._dist)
            rng_name = rng_file(self._rank)
            write_durably(tmp / rng_name, json.dumps(_rng_state(self.env.device)))
            own_name = rank_state_file(self._rank)  # replicated experts' error feedback
            if rank_state:
                (tmp / CHECKPOINT_RANK_STATE).mkdir(exist_ok=True)
                torch.save(rank_state, tmp / own_name)
            # Each rank checksums what it wrote; rank 0 takes whatever no rank claimed (DCP's .metadata).
            mine = {f: file_record(tmp / f) for f in _files(tmp)
                    if f.startswith(f"__{self._rank}_") or f in (rng_name, own_name)}
        except (Exception, CheckpointException) as e:
            error = error or e
        return error, mine

    def _finish(self, step: int, tmp: Path, final: Path, files: dict) -> None:
        """Rank 0: metadata.json (written last: it means "complete"), the rename into place, pruning."""
        for f in _files(tmp):
            files.setdefault(f, file_record(tmp / f))
        meta = {"format": FORMAT, "step": step, "time": time.time(), "world_size": self._world,
                "layout": dataclasses.asdict(self.layout), "config_hash": config_hash(self.cfg),
                "config": config_identity(self.cfg), "torch": torch.__version__, "files": files}
        if self.cfg.train.lora.rank:  # only the adapters (and what else trains) are saved: where the base comes from
            meta["base"] = lora_base(self.cfg)
        meta["crc32"] = json_crc32(meta)
        write_durably(tmp / CHECKPOINT_METADATA, json.dumps(meta, indent=1))
        if final.exists():  # a leftover of an abandoned timeline (its metadata did not verify)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        self._prune()

    def _failed(self, step: int, tmp: Path, need: int, failure: str, causes: set[int]) -> tuple:
        """Rank 0, after a failed save whose ranks met the folder errors `causes` (errnos): remove the partial
        folder; (kind, message, errno, free) for every rank to raise: kind "disk" (DiskFullError), "folder"
        (FolderWriteError: read-only, not ours; the message says what was left) or "other" (CheckpointError)."""
        written, free = diskspace.folder_bytes(tmp), diskspace.free_bytes(self.root)
        no_space = sorted(causes & {errno.ENOSPC, errno.EDQUOT})
        unwritable = sorted(causes - {errno.ENOSPC, errno.EDQUOT})
        existed = tmp.exists()
        shutil.rmtree(tmp, ignore_errors=True)
        left = (f"the partial checkpoint {tmp} stays (a folder that cannot be removed here; it is never loaded)"
                if tmp.exists() else f"the partial checkpoint {tmp} was removed" if existed else
                f"nothing of checkpoint step {step} was written") + "; older checkpoints are intact"
        free = diskspace.free_bytes(self.root)
        if no_space or (not unwritable and diskspace.left_too_little(need, written, free)):
            return "disk", diskspace.disk_full_message(self.root, step, need, free, self.run_dir, tmp), None, free
        if unwritable:
            return "folder", left, unwritable[0], free
        return "other", f"checkpoint step {step} could not be saved in {self.root} ({failure}); {left}", None, free

    def _prune(self) -> None:
        complete = [p for p in list_checkpoints(self.run_dir) if is_complete(p)]
        for old in complete[: -self.cfg.train.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ restore
    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                metrics_path: "str | Path | None" = None, meshes=None) -> Restored:
        """Load the newest intact checkpoint into model and optimizer (collective), and rewind the metrics
        stream to it (rank 0). Corrupt folders are reported and skipped; CheckpointError if all are."""
        out = Restored()
        out.path = self._newest_intact(out.warnings)
        if out.path is not None:
            self._load(out, model, optimizer, meshes)
        if self._rank == 0 and metrics_path is not None:
            out.records, notes = rewind_metrics(metrics_path, out.step)
            out.warnings.extend(notes)
        for w in out.warnings:
            w["step"] = out.step
        self._barrier()
        return out

    def _newest_intact(self, warnings_out: list) -> "Path | None":
        """The newest checkpoint that verifies (every rank checks a share of its files); the ones before it that
        do not are renamed step_N.corrupt-<time> by rank 0 and reported in `warnings_out`. None without
        checkpoints; CheckpointError when none is usable."""
        names = self._broadcast([p.name for p in reversed(list_checkpoints(self.run_dir))]
                                if self._rank == 0 else None)
        bad = []
        for name in names:
            path = self.root / name
            problems = self._verify_collectively(path)
            if not problems:
                return path
            bad.append(f"{name}: {'; '.join(problems)}")
            warnings_out.append({"kind": "corrupt_checkpoint", "message": (
                f"checkpoint {path} is not usable and was not loaded ({'; '.join(problems)}); renamed to "
                f"{name}.corrupt-*, falling back to an older one")})
            if self._rank == 0:
                os.rename(path, path.with_name(f"{name}.corrupt-{int(time.time())}"))
        if names:
            raise CheckpointError(f"{self.root}: no usable checkpoint ({' | '.join(bad)}). The run cannot resume; "
                                  f"move the checkpoints folder away to start again from step 0")
        return None

    def _load(self, out: Restored, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meshes) -> None:
        """Load checkpoint `out.path` into model and optimizer, this rank's own state and RNG states; sets
        out.step, and warns when another layout wrote it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        meta = self._broadcast(read_metadata(out.path) if self._rank == 0 else None)
        out.step = meta["step"]
        model_sd, optim_sd = get_state_dict(model, optimizer, options=self.state_options())
        state = {"model": model_sd, "optim": optim_sd}
        # Only the per-parameter optimizer state is read: the groups come from the config and the layout
        # (moelab.train.optim groups parameters by kind, so another layout may have more or fewer)
        moments = {k: v for k, v in optim_sd.items() if k != "param_groups"}
        view = global_experts({"model": model_sd, "optim": moments}, meshes)  # shares storage with `state`
        try:
            with one_process_is_meant(not self._dist):
                dcp.load(view, checkpoint_id=out.path, no_dist=not self._dist)
            copy_back(view, state)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=self.state_options())
        except Exception as e:
            raise CheckpointError(f"{out.path}: could not be loaded into this model and optimizer: "
                                  f"{type(e).__name__}: {e}") from e
        own = out.path / rank_state_file(self._rank)
        if own.is_file():
            out.rank_state = torch.load(own, map_location="cpu")
        rng = out.path / rng_file(self._rank)
        _set_rng_state(json.loads((rng if rng.is_file() else out.path / rng_file(0)).read_text()), self.env.device)
        now = {"world_size": self._world, "layout": dataclasses.asdict(self.layout)}
        if (meta["world_size"], meta["layout"]) != (now["world_size"], now["layout"]):
            out.warnings.append({"kind": "layout_changed", "message": (
                f"resumed step {out.step} written by {meta['world_size']} ranks with layout {meta['layout']} "
                f"onto {now['world_size']} ranks with layout {now['layout']}")})

    def _verify_collectively(self, path: Path) -> list[str]:
        """Rank 0 reads metadata.json; the files are then checked by all ranks, file i by rank i % world."""
        head = None
        if self._rank == 0:
            try:
                head = {"files": read_metadata(path)["files"], "problems": []}
            except CheckpointError as e:
                head = {"files": {}, "problems": [str(e)]}
        head = self._broadcast(head)
        if head["problems"]:
            return head["problems"]
        names = sorted(head["files"])[self._rank::self._world]
        return [p for part in self._gather(verify_files(path, head["files"], names)) for p in part]


# ---------------------------------------------------------------------- helpers
def lora_base(cfg: Config) -> dict:
    """The pointer a LoRA checkpoint keeps to its frozen base: the checkpoint it started from (train.init_from,
    where the config has it) or the random-init seed."""
    init_from = getattr(cfg.train, "init_from", "")
    return {"init_from": init_from} if init_from else {"seed": cfg.train.seed}


def _cause(e: "BaseException | None") -> "int | None":
    """The errno of a folder error (disk full, read-only, not ours: moelab.contract.writes) behind a failed save."""
    cause = folder_cause(e)
    return None if cause is None else cause.errno


def _describe(e: BaseException) -> str:
    """One line for an exception (DCP's CheckpointException: the first failing rank's)."""
    failures = getattr(e, "failures", None)
    if failures:
        rank, (inner, _) = next(iter(failures.items()))
        return f"rank {rank}: {type(inner).__name__}: {inner}"
    return f"{type(e).__name__}: {e}"


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state(device: str) -> dict:
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state().tolist(), "python": _listify(random.getstate()),
             "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
    if str(device).startswith("cuda"):
        state["cuda"] = torch.cuda.get_rng_state(device).tolist()
    return state


def _set_rng_state(state: dict, device: str) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    random.setstate(_tuplify(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    if "cuda" in state and str(device).startswith("cuda"):
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8), device)


def _listify(x):
    return [_listify(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, list) else x
