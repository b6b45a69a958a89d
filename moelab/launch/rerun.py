"""The one re-run rule, the same on every executor (Session.submit, `moelab run` with or without --nproc or
--executor, resume): a folder that holds a run is never started afresh, and the refusal, decided before any
rank starts, changes nothing in it.

- a run whose job is pending or running: refused, "wait for it to end or cancel it" (never "resume it");
- the same config, run COMPLETED: refused, "already COMPLETED at step N: nothing to do";
- the same config, run stopped (PREEMPTED, FAILED, ...): refused, "continue it with `moelab resume D`";
- only train.steps differs: refused, pointing at `moelab resume D --steps M`, which says it resumes from step
  N to M and what that does to the learning-rate schedule (the cosine decay is recomputed over M steps);
- any other field differs: refused, naming every differing field (old -> new).

    raise ConfigError(rerun_refusal(RunFolder("runs/tiny"), cfg))
"""
from __future__ import annotations

from moelab.config import ConfigError, flatten, load_config
from moelab.contract.folder import RunFolder


def reached_step(folder: RunFolder) -> int:
    """The last step the folder's stream recorded (0 before the first)."""
    from moelab.contract.stream import tail_events

    steps = tail_events(folder.metrics, kinds=("step",))[0]  # read from the end of the stream
    return int(steps[-1].step) if steps else 0


def checkpoint_step(folder: RunFolder) -> int:
    """The step of the folder's newest intact checkpoint: where a resume continues from (0 without one; the
    stream is rewound to it, so a run killed after step N with its last checkpoint at C < N trains C+1.. again)."""
    from moelab.contract.checkpoints import latest_checkpoint, read_metadata

    path = latest_checkpoint(folder.path)
    return int(read_metadata(path)["step"]) if path is not None else 0


def resume_point(folder: RunFolder) -> tuple[int, str]:
    """(the step a resume starts from, a note saying so when the stream reached further than that checkpoint)."""
    step, start = reached_step(folder), checkpoint_step(folder)
    if start >= step:
        return start, ""
    where = f"its checkpoint at step {start}" if start else "step 0 (no intact checkpoint)"
    return start, f"the stream reached step {step}; a resume continues from {where}"


def config_diff(old, new) -> dict:
    """{dotted key: (old, new)} for every field that differs."""
    a, b = flatten(old.to_dict()), flatten(new.to_dict())
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def rerun_refusal(folder: RunFolder, cfg) -> str:
    """Why `cfg` cannot start afresh in `folder`, which holds a run, and what to do instead."""
    from moelab.launch.executors import job_for
    from moelab.launch.jobs import TERMINAL

    where = str(folder.path)
    try:
        old = load_config(folder.config)
    except (ConfigError, OSError):
        return (f"folder={where!r} already holds a run; choose a new folder, or continue it with "
                f"`moelab resume {where}`")
    status, step = job_for(folder).state(), reached_step(folder)
    start, note = resume_point(folder) if status != "COMPLETED" else (step, "")
    note = f" ({note})" if note else ""
    diff = config_diff(old, cfg)
    if status not in TERMINAL:  # a live job (it may not hold the lock yet): resuming it would be a second writer
        return (f"folder={where!r} holds a run that is {status} at step {step}/{old.train.steps}; wait for it to "
                f"end (`moelab status {where}`) or cancel it (`moelab cancel {where}`), or choose a new folder")
    if not diff:
        if status == "COMPLETED":
            return (f"folder={where!r} already holds this run, COMPLETED at step {step}/{old.train.steps}: nothing "
                    f"to do (moelab.Run.load({where!r}), `moelab status {where}`); choose a new folder to train "
                    f"it again")
        return (f"folder={where!r} holds this run, {status} at step {step}/{old.train.steps}{note}; continue it with "
                f"`moelab resume {where}` (Run.load(folder).resume()), or choose a new folder")
    if set(diff) == {"train.steps"}:
        return (f"folder={where!r} holds this run with train.steps={old.train.steps} ({status} at step {step}"
                f"{note}); "
                f"to extend it to {cfg.train.steps} steps, `moelab resume {where} --steps {cfg.train.steps}` "
                f"(Run.load(folder).resume(steps={cfg.train.steps})); or choose a new folder")
    fields = ", ".join(f"{k} ({a!r} -> {b!r})" for k, (a, b) in diff.items())
    return (f"folder={where!r} holds a run of another config: {fields}; choose a new folder for this config "
            f"(a run folder keeps the config it was started with)")


def extension_note(old, new, step: int) -> str | None:
    """What resuming at `step` (the newest intact checkpoint's) with another train.steps does: the range, and the
    learning rate's jump (the cosine decay is recomputed over the new total); ConfigError when the new total is
    below `step`."""
    if old.train.steps == new.train.steps:
        return None
    if new.train.steps < step:
        raise ConfigError(f"train.steps={new.train.steps}: the run already reached step {step} (its newest "
                          f"checkpoint); give steps >= {step} (or load the run as it is with moelab.Run.load)")
    from moelab.config.schedule import lr_at

    nxt = min(step + 1, new.train.steps)
    return (f"resuming from step {step} to {new.train.steps} (was {old.train.steps}): the learning-rate schedule "
            f"is recomputed over {new.train.steps} steps, so step {nxt} trains at lr {lr_at(nxt, new):.3g} "
            f"where the old schedule gave {lr_at(min(nxt, old.train.steps), old):.3g}")
