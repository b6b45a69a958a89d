"""Forks: new runs that start from a parent run's checkpoint at step k, with some fields changed.

A fork is a run folder prepared from the parent's, then continued by the one resume path
(moelab.launch.resume, with its lock and executors), so it trains steps k+1.. on any executor:

    FORK/config.yaml          the parent's config (train.steps, parallel.* and backend.* may differ)
    FORK/checkpoints/step_k   the parent's checkpoint (hard links where the file system allows, else a copy),
                              verified after copying (a running parent may rotate it away meanwhile: then
                              the partial fork is removed, "fork again"); the changes in force at k come with it
    FORK/metrics.jsonl        the parent's events up to step k, so the fork's curves are whole
    FORK/controls.jsonl       the fork's changes as one request due at step k (moelab.contract.controls):
                              applied before step k+1, recorded as `control` events at step k; with them
                              the parent's changes applied at k after its checkpoint there was saved (at a
                              resume's first boundary: not inside the checkpoint, in force after it)
    FORK/fork.json            {"parent": the parent's folder, "step": k, "changes": {...}}

The fork's name follows a run's name rules (moelab.config.bounds.check_name); without one, the folder is
PARENT-fork<k>-<key>-<value>+... (fork_label: no '=' or ','). A write that fails on a full or read-only disk
leaves nothing behind and says to fork again (undo_on_failure).

A fork without changes trains exactly the parent's steps k+1.. (the checkpoint holds everything a resume
needs). Changes are the fields a running run can change (moelab.config.live), plus train.steps, parallel.* and
backend.*, which a resume may change as well.

    job = fork(Run.load("runs/tiny"), step=20, name="aux10x", changes={"aux_loss_coeff": 0.01})
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from pathlib import Path

from moelab.config import ConfigError, load_config, save_config
from moelab.config.bounds import check_name
from moelab.config.live import check_changes
from moelab.config.paths import RUN_FOLDER_FIX, check_path
from moelab.contract.checkpoints import checkpoint_steps, decided_in, step_dir_name
from moelab.contract.controls import CHECKPOINT_NOW, append_request, read_controls, who as who_is
from moelab.contract.folder import RunFolder, lock_folder, write_json
from moelab.contract.writes import FolderWriteError, folder_cause
from moelab.run.controls import live_config, resolve

CONFIG_FIELDS = ("train.steps", "parallel.", "backend.")  # set in the fork's config.yaml, as a resume may


def parent_of(folder: "str | Path") -> dict | None:
    """The fork record of a run folder ({"parent", "step", "changes"}), or None for a run that is no fork."""
    return RunFolder(folder).read_fork()


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # checkpoint files are never written again once complete
    except FileNotFoundError:
        raise
    except OSError:
        shutil.copy2(src, dst)


class SourceVanished(Exception):
    """The parent's checkpoint changed or went away while a fork copied it (a running parent rotates its
    checkpoints): the copy is incomplete, never used.

        raise SourceVanished(["metadata.json is missing"])
    """


def copy_checkpoint(src: Path, dst: Path) -> None:
    """Copy (hard-link where possible) the checkpoint folder `src` to `dst`, then verify the copy against its own
    metadata (sizes and crc32 of every file: moelab.contract.checkpoints.verify). SourceVanished when a file
    vanished mid-copy or the copy is not intact; OSError (errno kept) for a write that failed."""
    from moelab.contract.checkpoints import verify

    try:
        files = sorted(p for p in src.rglob("*") if not p.is_dir())
        for p in files:
            target = dst / p.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            _link_or_copy(str(p), str(target))
    except FileNotFoundError as e:
        if not src.is_dir() or (e.filename and str(e.filename).startswith(str(src)) and not Path(e.filename).exists()):
            raise SourceVanished([f"{e.filename} vanished while it was copied"]) from None
        raise
    problems = verify(dst) if dst.is_dir() else [f"{src} vanished"]
    if problems:
        raise SourceVanished(problems)


def fork_label(changes: dict) -> str:
    """The folder name part a fork gets from its changes: "aux_loss_coeff-0.01+lr-0.001" (no '=' or ',',
    which shells and tools quote), "same" without changes; always a name check_name accepts."""
    if not changes:
        return "same"
    parts = [f"{k.rsplit('.', 1)[-1]}-{v:g}" if isinstance(v, float) else f"{k.rsplit('.', 1)[-1]}-{v}"
             for k, v in changes.items()]
    label = re.sub(r"[^A-Za-z0-9._+@-]", "-", "+".join(parts)).lstrip("._+@-")
    return label[:80] or "changed"


def _events_up_to(metrics: Path, step: int) -> bytes:
    """The parent's stream up to `step`: its first start event and every stepped event at or before it."""
    from moelab.contract.stream import MetricsError, parse_lines

    parsed, _ = parse_lines(metrics.read_bytes(), metrics) if metrics.is_file() else ([], b"")
    kept, started = [], False
    for _, line, event in parsed:
        if isinstance(event, MetricsError) or event["event"] in ("end", "error"):
            continue
        if event["event"] == "start":
            if not started:
                kept.append(line)
            started = True
        elif isinstance(event.get("step"), int) and event["step"] <= step:
            kept.append(line)
    return b"".join(line + b"\n" for line in kept)


def applied_after_save(parent, step: int) -> dict:
    """The parent's changes applied at `step` that its checkpoint there does not hold (applied at the first
    boundary of a resume from it): {field: value}, in the order applied. A fork carries them, as the parent's
    steps after `step` had them."""
    inside = decided_in(parent.run_folder.checkpoints / step_dir_name(step))
    out = {}
    for o in read_controls(parent.folder)[1].values():
        if o["kind"] == "applied" and o.get("step") == step and o["id"] not in inside:
            out.update({k: new for k, (_, new) in o.get("changes", {}).items() if k != CHECKPOINT_NOW})
    return out


def check_fork(parent, step: int | None, changes: dict) -> tuple[int, object, dict, dict]:
    """(the step, the fork's config, its config changes, its live changes checked); ConfigError for a missing
    checkpoint, a field a fork cannot change or a bad value."""
    steps = checkpoint_steps(parent.folder)
    if not steps:
        raise ConfigError(f"run {parent.name} has no intact checkpoint to fork from; set train.checkpoint_every "
                          f"or ask for one while it trains (run.set(checkpoint=True))")
    step = steps[-1] if step is None else int(step)
    if step not in steps:
        raise ConfigError(f"step={step}: run {parent.name} has no intact checkpoint there; its checkpoints: "
                          f"{steps}")
    base = load_config(parent.run_folder.config)
    changes = resolve(dict(changes), base)
    config_changes = {k: v for k, v in changes.items() if k.startswith(CONFIG_FIELDS)}
    live = {k: v for k, v in changes.items() if k not in config_changes}
    cfg = load_config(base, config_changes) if config_changes else base
    if cfg.train.steps <= step:
        raise ConfigError(f"train.steps={cfg.train.steps}: a fork at step {step} needs more steps to train; "
                          f"give train.steps > {step}")
    checked = check_changes(live_config(parent.folder, step, cfg), live)[1] if live else {}
    return step, cfg, config_changes, checked


@contextlib.contextmanager
def undo_on_failure(path: Path):
    """Remove what the block wrote at `path` when it fails (the folder itself when it did not exist before, else
    the entries that were not there), so a failed fork leaves nothing behind; a write that failed for a reason a
    person must fix (a full or read-only disk) becomes one FolderWriteError that says so and to fork again."""
    existed = path.is_dir()
    before = set(os.listdir(path)) if existed else set()
    try:
        yield
    except BaseException as e:
        if existed:
            for entry in set(os.listdir(path)) - before:
                target = path / entry
                shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
        cause = folder_cause(e) if isinstance(e, Exception) else None
        if cause is None:
            raise
        where = e.path if isinstance(e, FolderWriteError) else (cause.filename or path)
        raise FolderWriteError(cause.errno, where, getattr(e, "need", None), left="the partial fork was removed, "
                               "nothing is left behind", then="fork again") from None


def prepare_fork(parent, step: int | None, folder: "str | Path", changes: dict) -> tuple[RunFolder, dict, dict]:
    """Check everything, then write the fork's folder (see the module docstring); returns (folder, the
    config changes, the live changes). ConfigError, with nothing written, for a missing checkpoint, a field a
    fork cannot change, a bad value or a folder that already holds a run."""
    step, cfg, config_changes, checked = check_fork(parent, step, changes)
    dest = RunFolder(check_path("folder", folder, "folder to write", RUN_FOLDER_FIX))
    if dest.holds_run():
        raise ConfigError(f"folder={str(dest.path)!r} already holds a run; choose a new folder for the fork")
    with undo_on_failure(dest.path):
        with lock_folder(dest.path, "fork"):
            dest.path.mkdir(parents=True, exist_ok=True)
            save_config(cfg, dest.config)
            name = step_dir_name(step)
            try:
                copy_checkpoint(parent.run_folder.checkpoints / name, dest.checkpoints / name)
            except SourceVanished as e:
                raise ConfigError(f"step={step}: run {parent.name} removed or rewrote its checkpoint at step {step} "
                                  f"while it was copied ({'; '.join(e.args[0][:2])}); nothing was left at "
                                  f"{dest.path}: fork again (its checkpoints now: {checkpoint_steps(parent.folder)})"
                                  ) from None
            dest.metrics.write_bytes(_events_up_to(parent.run_folder.metrics, step))
            request = {**applied_after_save(parent, step), **checked}
            if request:
                append_request(dest.path, request, who=who_is("fork"), at=step)
            write_json(dest.fork_path, {"parent": str(parent.folder.resolve()), "step": step,
                                        "changes": {**config_changes, **checked}, "created": time.time()})
    return dest, config_changes, checked


def check_fork_name(name, parent, step) -> None:
    """A fork's name follows the rules of a run's name (moelab.config.bounds.check_name: no '/', '..', tab or
    NUL; letters, digits and . _ + = , @ -): it names the folder PARENT-fork<step>-<name> beside the parent."""
    try:
        check_name(name)
    except ConfigError as e:
        fix = str(e).split(": it names", 1)[0]
        raise ConfigError(f"{fix}: a fork's name names its folder {parent.folder.name}-fork{step}-<name> beside "
                          f"the parent (or give the folder itself: --out / folder=)") from None


def default_folder(parent, step, name: str | None, changes: dict) -> Path:
    """PARENT-fork<step>-<name> beside the parent; without a name, the changes name it (fork_label)."""
    if name is not None:
        check_fork_name(name, parent, step)
    return parent.folder.parent / f"{parent.folder.name}-fork{step}-{name or fork_label(changes)}"


def fork(parent, step: int | None = None, name: str | None = None, folder: "str | Path | None" = None,
         executor: str | None = None, nproc: int | None = None, changes: dict | None = None, **cluster_options):
    """Start a fork of `parent` (a Run) from its checkpoint at `step` (default: the newest) and return its Job
    (Run.fork wraps it in a Run). executor (default the parent's), nproc and cluster_options as for a resume
    (moelab.launch.resume)."""
    from moelab.launch.executors import EXECUTORS
    from moelab.launch.resume import previous_world_size, resume

    changes = dict(changes or {})
    if step is None:
        step = (checkpoint_steps(parent.folder) or [None])[-1]  # prepare_fork says why when there is none
    dest_path = Path(folder) if folder else default_folder(parent, step, name, changes)
    dest, _, _ = prepare_fork(parent, step, dest_path, changes)
    kind = executor or parent.executor
    if kind in EXECUTORS and EXECUTORS[kind].in_background:  # to that executor (a foreground one: as a resume)
        info = parent.run_folder.read_info()
        options = {**(info.get("options", {}) if kind == parent.executor else {}), **cluster_options}
        world = nproc or previous_world_size(parent.folder)
        with undo_on_failure(dest.path):  # run.json on a disk that filled up: the fork goes as a whole
            dest.write_info({"name": dest.name, "executor": kind, "options": options, "ntasks": world,
                             "parent": str(parent.folder)})
        job = resume(dest.path, nproc=nproc or world)
    else:
        job = resume(dest.path, nproc=nproc or previous_world_size(parent.folder), **cluster_options)
    return job


def fork_points(parent, grid: dict, step: int | None = None, folder: "str | Path | None" = None,
                executor: str | None = None, nproc: int | None = None, **cluster_options) -> tuple[Path, list]:
    """One fork of `parent` at `step` per point of `grid` (the cartesian product of its value lists), in one
    sweep folder (sweep.json names the parent and the step); every point is checked before any is written.
    Returns (the sweep folder, the forks' Jobs); Sweep.fork wraps them."""
    import itertools

    if not isinstance(grid, dict) or not grid or not all(isinstance(v, (list, tuple)) and v for v in grid.values()):
        raise ConfigError(f"grid={grid!r}: give a dict of fields to non-empty lists of values, e.g. "
                          f"{{'model.moe.aux_loss_coeff': [1e-3, 1e-2]}}")
    points = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    for p in points:
        step = check_fork(parent, step, p)[0]  # every point checked first; the step resolved once
    root = check_path("folder", folder or parent.folder.parent / f"{parent.folder.name}-forks{step}",
                      "folder to write", RUN_FOLDER_FIX)
    if RunFolder(root).is_sweep():
        raise ConfigError(f"folder={str(root)!r} already holds a sweep; choose a new folder")
    names = [f"{i:02d}-{fork_label(p)}" for i, p in enumerate(points)]
    root.mkdir(parents=True, exist_ok=True)
    write_json(RunFolder(root).sweep_path, {"grid": {k: list(v) for k, v in grid.items()}, "points": points,
                                            "runs": names, "parent": str(parent.folder.resolve()), "step": step,
                                            "created": time.time()})
    jobs = [fork(parent, step, n, root / n, executor, nproc, p, **cluster_options) for n, p in zip(names, points)]
    return root, jobs
