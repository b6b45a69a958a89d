"""Changing a run while it trains, from any kernel or shell: what Run.set and `moelab set` call.

A change is checked here, before anything is written, against the run's config as it is now (config.yaml plus
the changes already applied: moelab.config.live.check_changes, the config's own errors), then appended to
RUN/controls.jsonl as a request (moelab.contract.controls). Rank 0 picks it up at the next step boundary and
every rank applies it there (moelab.train.controls); a refused field or a bad value writes nothing.

Fields are dotted (`model.moe.aux_loss_coeff`) or their last part (`aux_loss_coeff`) where that names one
changeable field; `checkpoint=True` asks for a checkpoint at the next boundary. A run that has COMPLETED (or
closed its controls file as it completes: moelab.contract.controls) is refused, with the fork that does it.

A process reads controls.jsonl once and then what is appended (moelab.contract.controls.reader), and the
folder's config.yaml again only when it changed, so a request costs the same however many came before.

    rid = request(Run.load("runs/tiny"), {"aux_loss_coeff": 0.01})
    wait_outcome("runs/tiny", rid, timeout=60)     # {"kind": "applied", "step": 12, "changes": {...}}
"""
from __future__ import annotations

import copy
import time
from pathlib import Path

from moelab.config import ConfigError, flatten, load_config
from moelab.config.live import LIVE_FIELDS, check_changes, set_dotted
from moelab.contract.controls import (CHECKPOINT_NOW, ControlsClosed, append_request, read_controls, reader,
                                      who as who_is)
from moelab.contract.folder import RunFolder


def resolve(changes: dict, cfg) -> dict:
    """Short names to dotted fields: `aux_loss_coeff` -> `model.moe.aux_loss_coeff` (a changeable field first,
    then any config field that ends so, so a refusal names the real field); dotted names pass through."""
    out = {}
    for key, value in changes.items():
        if "." in key or key == CHECKPOINT_NOW:
            out[key] = value
            continue
        for pool in (lambda: LIVE_FIELDS, lambda: flatten(cfg.to_dict())):  # every field only when needed
            hits = [f for f in pool() if f.rsplit(".", 1)[-1] == key]
            if len(hits) == 1:
                out[hits[0]] = value
                break
            if len(hits) > 1:
                raise ConfigError(f"{key}={value!r}: ambiguous, give one of {hits}")
        else:
            out[key] = value  # unknown: the config's own message (did you mean ...)
    return out


_CONFIGS: dict[Path, tuple[tuple, object]] = {}  # config.yaml -> ((inode, size, mtime), its Config)


def _config(folder: "str | Path") -> tuple[tuple, object]:
    """(what identifies the folder's config.yaml now, it as a Config), parsed again only when the file changed."""
    path = RunFolder(Path(folder).absolute()).config
    st = path.stat()
    key = (st.st_ino, st.st_size, st.st_mtime_ns)
    known = _CONFIGS.get(path)
    if known is None or known[0] != key:
        known = _CONFIGS[path] = (key, load_config(path))
    return known


_LIVE: dict[Path, tuple[tuple, object]] = {}  # folder -> ((its config, the applied values), the live config)


def _live(folder: "str | Path"):
    """The run's live config as it is now, shared: built again only when config.yaml or an applied value
    changed (never modify it; live_config gives a copy)."""
    (version, base), latest = _config(folder), reader(folder).latest  # each field's newest applied value
    key = (version, tuple(latest.items()))
    known = _LIVE.get(Path(folder).absolute())
    if known is None or known[0] != key:
        cfg = copy.deepcopy(base)
        for field, new in latest.items():
            set_dotted(cfg, field, new)
        known = _LIVE[Path(folder).absolute()] = (key, cfg)
    return known[1]


def live_config(folder: "str | Path", up_to: int | None = None, cfg=None):
    """The run's config as it trains: `cfg` (default its config.yaml; copied, never changed) with the changes
    applied so far, in the order applied (only those applied up to step `up_to` where given)."""
    if cfg is None and up_to is None:
        return copy.deepcopy(_live(folder))
    cfg = copy.deepcopy(_config(folder)[1] if cfg is None else cfg)
    if up_to is None:
        latest = reader(folder).latest
    else:
        latest = {}
        for o in read_controls(folder)[1].values():  # file order: the newest line per field wins
            if o["kind"] == "applied" and o.get("step", 0) <= up_to:
                latest.update({k: new for k, (_, new) in o.get("changes", {}).items() if k != CHECKPOINT_NOW})
    for key, new in latest.items():
        set_dotted(cfg, key, new)
    return cfg


def finished(run, step, how: str) -> ConfigError:
    """The refusal of a change to a run that has no step left: fork it."""
    at = f" --step {step}" if step is not None else ""
    return ConfigError(f"run {run.name} is {how}: there is no step left to change; fork it with the change "
                       f"instead: `moelab fork {run.folder}{at} --set FIELD=VALUE` (Python: "
                       f"run.fork(step=..., **changes))")


def request(run, changes: dict, origin: str = "notebook", at: int | None = None) -> str:
    """Check `changes` and append them as one request, applied at the next step boundary or, with `at`, at the
    boundary after step `at`; returns its id. ConfigError, with nothing written, for a field that cannot change, a
    bad value or `at`, or a run that has COMPLETED."""
    if at is not None and (isinstance(at, bool) or not isinstance(at, int) or at < 0):
        raise ConfigError(f"at={at!r}: the step after which the change applies, an integer >= 0; leave it out for "
                          f"the next step boundary")
    cfg = _live(run.folder)  # not modified: check_changes builds a new config
    _, checked = check_changes(cfg, resolve(changes, cfg))
    if run.status == "COMPLETED":
        raise finished(run, None, "COMPLETED")
    try:
        return append_request(run.folder, checked, who=who_is(origin), at=at)
    except ControlsClosed as e:  # it completed since: the file's lock orders this request after its close
        raise finished(run, e.record.get("step"), f"{e.record.get('status', 'COMPLETED')} (after step "
                                                  f"{e.record.get('step')})") from None


def wait_outcome(folder: "str | Path", rid: str, timeout: float | None = None, run=None,
                 poll_s: float = 0.2) -> dict | None:
    """Block until request `rid` is applied or rejected (its line in controls.jsonl), the run ends, or `timeout`
    seconds pass; None when it was not decided."""
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        over = (run is not None and run.done) or (end is not None and time.monotonic() >= end)
        outcome = reader(folder).outcomes.get(rid)  # after `over`: a run decides its requests before it ends
        if outcome is not None or over:
            return outcome
        time.sleep(poll_s)
