"""The controls file: requests to change a running run, and what the ranks did with them.

RUN/controls.jsonl is append-only; any process may append a line (one O_APPEND write each, so writers never
interleave), and nothing ever rewrites it. Two kinds of line:

- ``request``: id, time, who ("user@host kernel", "cli", "dashboard", "fork"), changes {dotted field: value}
  (the action "checkpoint": true saves a checkpoint at the boundary), and optionally at (apply at the boundary
  after that step; a fork's changes carry the fork step). Written by Run.set / `moelab set` / Run.fork.
- ``applied``: id, step (the boundary: after that step trained, before the next), changes {field: [old, new]};
  ``rejected``: id, step, reason. Written by rank 0 (moelab.train.controls).

A resume reads it to replay the changes applied after its checkpoint at the same steps; the changes applied up
to the checkpoint travel inside the checkpoint. Standard library only.

    rid = append_request("runs/tiny", {"model.moe.aux_loss_coeff": 0.01}, who="notebook")
    requests, outcomes = read_controls("runs/tiny")      # outcomes[rid] = the last applied/rejected line
"""
from __future__ import annotations

import getpass
import json
import socket
import time
import uuid
from pathlib import Path

from moelab.contract.folder import RunFolder
from moelab.contract.writes import append_line

CHECKPOINT_NOW = "checkpoint"  # the one action a request may carry besides fields


def controls_path(folder: "str | Path") -> Path:
    """RUN/controls.jsonl."""
    return RunFolder(folder).controls


def who(origin: str) -> str:
    """'user@host origin': who asked for a change, as the control events record it."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    return f"{user}@{socket.gethostname()} {origin}"


def append_control(folder: "str | Path", record: dict) -> None:
    """One line, stamped with the time, in one O_APPEND write (moelab.contract.writes.append_line: atomic
    against the other writers of the file; a full or read-only disk raises FolderWriteError)."""
    append_line(controls_path(folder), (json.dumps({"time": time.time(), **record}, allow_nan=False) + "\n").encode())


def append_request(folder: "str | Path", changes: dict, who: str, at: int | None = None) -> str:
    """Append a request for `changes` (already checked: moelab.config.live.check_changes); returns its id."""
    rid = uuid.uuid4().hex[:12]
    record = {"kind": "request", "id": rid, "who": who, "changes": changes}
    if at is not None:
        record["at"] = int(at)
    append_control(folder, record)
    return rid


def parse(data: bytes) -> tuple[list[dict], dict[str, dict]]:
    """(requests in file order, {request id: its last applied/rejected line}); a half-written last line and
    lines that are not JSON objects are skipped."""
    requests, outcomes = [], {}
    for line in data.split(b"\n")[:-1]:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        if rec.get("kind") == "request" and isinstance(rec.get("changes"), dict):
            requests.append(rec)
        elif rec.get("kind") in ("applied", "rejected") and "id" in rec:
            outcomes[rec["id"]] = rec
    return requests, outcomes


def read_controls(folder: "str | Path") -> tuple[list[dict], dict[str, dict]]:
    """parse() of the folder's controls.jsonl (([], {}) when there is none)."""
    path = controls_path(folder)
    return parse(path.read_bytes()) if path.is_file() else ([], {})
