"""Forks: new runs that start from a parent run's checkpoint at step k, with some fields changed.

A fork is a run folder prepared from the parent's, then continued by the one resume path
(moelab.launch.resume, with its lock and executors), so it trains steps k+1.. on any executor:

    FORK/config.yaml          the parent's config (train.steps, parallel.* and backend.* may differ)
    FORK/checkpoints/step_k   the parent's checkpoint (hard links where the file system allows, else a copy);
                              the changes the parent had in force at k come with it
    FORK/metrics.jsonl        the parent's events up to step k, so the fork's curves are whole
    FORK/controls.jsonl       the fork's changes as one request due at step k (moelab.contract.controls):
                              applied before step k+1, recorded as `control` events at step k; with them
                              the parent's changes applied at k after its checkpoint there was saved (at a
                              resume's first boundary: not inside the checkpoint, in force after it)
    FORK/fork.json            {"parent": the parent's folder, "step": k, "changes": {...}}

A fork without changes trains exactly the parent's steps k+1.. (the checkpoint holds everything a resume
needs). Changes are the fields a running run can change (moelab.config.live), plus train.steps, parallel.* and
backend.*, which a resume may change as well.

    job = fork(Run.load("runs/tiny"), step=20, name="aux10x", changes={"aux_loss_coeff": 0.01})
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from moelab.config import ConfigError, load_config, save_config
from moelab.config.live import check_changes
from moelab.config.paths import RUN_FOLDER_FIX, check_path
from moelab.contract.checkpoints import checkpoint_steps, decided_in, step_dir_name
from moelab.contract.controls import CHECKPOINT_NOW, append_request, read_controls, who as who_is
from moelab.contract.folder import RunFolder, lock_folder, write_json
from moelab.run.controls import live_config, resolve

CONFIG_FIELDS = ("train.steps", "parallel.", "backend.")  # set in the fork's config.yaml, as a resume may


def parent_of(folder: "str | Path") -> dict | None:
    """The fork record of a run folder ({"parent", "step", "changes"}), or None for a run that is no fork."""
    return RunFolder(folder).read_fork()


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # checkpoint files are never written again once complete
    except OSError:
        shutil.copy2(src, dst)


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


def prepare_fork(parent, step: int | None, folder: "str | Path", changes: dict) -> tuple[RunFolder, dict, dict]:
    """Check everything, then write the fork's folder (see the module docstring); returns (folder, the
    config changes, the live changes). ConfigError, with nothing written, for a missing checkpoint, a field a
    fork cannot change, a bad value or a folder that already holds a run."""
    step, cfg, config_changes, checked = check_fork(parent, step, changes)
    dest = RunFolder(check_path("folder", folder, "folder to write", RUN_FOLDER_FIX))
    if dest.holds_run():
        raise ConfigError(f"folder={str(dest.path)!r} already holds a run; choose a new folder for the fork")
    with lock_folder(dest.path, "fork"):
        dest.path.mkdir(parents=True, exist_ok=True)
        save_config(cfg, dest.config)
        shutil.copytree(parent.run_folder.checkpoints / step_dir_name(step), dest.checkpoints / step_dir_name(step),
                        copy_function=_link_or_copy)
        dest.metrics.write_bytes(_events_up_to(parent.run_folder.metrics, step))
        request = {**applied_after_save(parent, step), **checked}
        if request:
            append_request(dest.path, request, who=who_is("fork"), at=step)
        write_json(dest.fork_path, {"parent": str(parent.folder.resolve()), "step": step,
                                      "changes": {**config_changes, **checked}, "created": time.time()})
    return dest, config_changes, checked


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
    label = name or ("same" if not changes else ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in changes.items()))
    dest_path = Path(folder) if folder else parent.folder.parent / f"{parent.folder.name}-fork{step}-{label}"
    dest, _, _ = prepare_fork(parent, step, dest_path, changes)
    kind = executor or parent.executor
    if kind in EXECUTORS and EXECUTORS[kind].in_background:  # to that executor (a foreground one: as a resume)
        info = parent.run_folder.read_info()
        options = {**(info.get("options", {}) if kind == parent.executor else {}), **cluster_options}
        world = nproc or previous_world_size(parent.folder)
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
    names = [f"{i:02d}-" + ",".join(f"{k.rsplit('.', 1)[-1]}={v:g}" if isinstance(v, float) else
                                    f"{k.rsplit('.', 1)[-1]}={v}" for k, v in p.items()) for i, p in enumerate(points)]
    root.mkdir(parents=True, exist_ok=True)
    write_json(RunFolder(root).sweep_path, {"grid": {k: list(v) for k, v in grid.items()}, "points": points,
                                            "runs": names, "parent": str(parent.folder.resolve()), "step": step,
                                            "created": time.time()})
    jobs = [fork(parent, step, n, root / n, executor, nproc, p, **cluster_options) for n, p in zip(names, points)]
    return root, jobs
