"""Changing a run while it trains, from any kernel or shell: what Run.set and `moelab set` call.

A change is checked here, before anything is written, against the run's config as it is now (config.yaml plus
the changes already applied: moelab.config.live.check_changes, the config's own errors), then appended to
RUN/controls.jsonl as a request (moelab.contract.controls). Rank 0 picks it up at the next step boundary and
every rank applies it there (moelab.train.controls); a refused field or a bad value writes nothing.

Fields are dotted (`model.moe.aux_loss_coeff`) or their last part (`aux_loss_coeff`) where that names one
changeable field; `checkpoint=True` asks for a checkpoint at the next boundary.

    rid = request(Run.load("runs/tiny"), {"aux_loss_coeff": 0.01})
    wait_outcome("runs/tiny", rid, timeout=60)     # {"kind": "applied", "step": 12, "changes": {...}}
"""
from __future__ import annotations

import copy
import time
from pathlib import Path

from moelab.config import ConfigError, flatten, load_config
from moelab.config.live import LIVE_FIELDS, check_changes, set_dotted
from moelab.contract.controls import CHECKPOINT_NOW, append_request, read_controls, who as who_is
from moelab.contract.folder import RunFolder


def resolve(changes: dict, cfg) -> dict:
    """Short names to dotted fields: `aux_loss_coeff` -> `model.moe.aux_loss_coeff` (a changeable field first,
    then any config field that ends so, so a refusal names the real field); dotted names pass through."""
    out = {}
    every = list(flatten(cfg.to_dict()))
    for key, value in changes.items():
        if "." in key or key == CHECKPOINT_NOW:
            out[key] = value
            continue
        for pool in (list(LIVE_FIELDS), every):
            hits = [f for f in pool if f.rsplit(".", 1)[-1] == key]
            if len(hits) == 1:
                out[hits[0]] = value
                break
            if len(hits) > 1:
                raise ConfigError(f"{key}={value!r}: ambiguous, give one of {hits}")
        else:
            out[key] = value  # unknown: the config's own message (did you mean ...)
    return out


def live_config(folder: "str | Path", up_to: int | None = None, cfg=None):
    """The run's config as it trains: `cfg` (default its config.yaml; copied, never changed) with the changes
    applied so far, in the order applied (only those applied up to step `up_to` where given)."""
    cfg = load_config(RunFolder(folder).config) if cfg is None else copy.deepcopy(cfg)
    _, outcomes = read_controls(folder)
    applied = sorted((o for o in outcomes.values() if o["kind"] == "applied"), key=lambda o: o.get("time", 0))
    for o in applied:
        if up_to is None or o.get("step", 0) <= up_to:
            for key, (_, new) in o.get("changes", {}).items():
                if key != CHECKPOINT_NOW:
                    set_dotted(cfg, key, new)
    return cfg


def request(run, changes: dict, origin: str = "notebook", at: int | None = None) -> str:
    """Check `changes` and append them as one request; returns its id. ConfigError, with nothing written, for
    a field that cannot change, a bad value, or a run that has COMPLETED."""
    cfg = live_config(run.folder)
    _, checked = check_changes(cfg, resolve(changes, cfg))
    if run.status == "COMPLETED":
        raise ConfigError(f"run {run.name} is COMPLETED: there is no step left to change; fork it from a "
                          f"checkpoint with the change instead (run.fork(step=..., **changes))")
    return append_request(run.folder, checked, who=who_is(origin), at=at)


def wait_outcome(folder: "str | Path", rid: str, timeout: float | None = None, run=None,
                 poll_s: float = 0.2) -> dict | None:
    """Block until request `rid` is applied or rejected (its line in controls.jsonl), the run ends, or `timeout`
    seconds pass; None when it was not decided."""
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        outcome = read_controls(folder)[1].get(rid)
        if outcome is not None:
            return outcome
        if (run is not None and run.done) or (end is not None and time.monotonic() >= end):
            return None
        time.sleep(poll_s)
