"""The controls file: requests to change a running run, and what the ranks did with them.

RUN/controls.jsonl is append-only; any process may append a line, and nothing ever rewrites it. Kinds of line:

- ``request``: id, time, who ("user@host kernel", "cli", "dashboard", "fork"), changes {dotted field: value}
  (the action "checkpoint": true saves a checkpoint at the boundary), and optionally at (apply at the boundary
  after that step; a fork's changes carry the fork step). Written by Run.set / `moelab set` / Run.fork.
- ``applied``: id, step (the boundary: after that step trained, before the next), changes {field: [old, new]};
  ``rejected``: id, step, reason. Written by rank 0 (moelab.train.controls).
- ``closed``: step, status: rank 0 closed the file as its run COMPLETED; every request before it is applied or
  rejected, and a request after it is refused (ControlsClosed). ``opened``: step: a resume opened it again.

Every append holds the file's lock (flock on it) for its read-and-write: a request checks, under the same lock
as rank 0's close, that the file is not closed, so a request either comes before the close (and is decided by
it) or is refused. An append starts on a new line (a line cut by a crash mid-append stays a damaged line of its
own, which readers skip with a ControlsWarning) and is taken back whole when the disk is full; a write that fails
for a reason a person must fix is a FolderWriteError (moelab.contract.writes), and a file the failed append
created is removed again.

A resume replays the changes applied after its checkpoint at the same steps; the checkpoint records the ids of
the requests decided inside it (moelab.train.controls). Readers read what was appended since their last read
(ControlsFile). Standard library only.

    rid = append_request("runs/tiny", {"model.moe.aux_loss_coeff": 0.01}, who="notebook")
    requests, outcomes = read_controls("runs/tiny")      # outcomes[rid] = the last applied/rejected line
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import getpass
import json
import os
import socket
import threading
import time
import uuid
import warnings
from pathlib import Path

from moelab.contract.folder import RunFolder
from moelab.contract.writes import writing

CHECKPOINT_NOW = "checkpoint"  # the one action a request may carry besides fields
AGAIN = "write the line again (a request: `moelab set` / run.set once more)"  # after a failed append


class ControlsWarning(UserWarning):
    """A line of controls.jsonl that is no control line (a write cut by a crash): skipped; the message names the
    file and the line.

        runs/a/controls.jsonl:7: not a control line (Unterminated string ...): skipped (a write cut by a crash)
    """


class ControlsClosed(RuntimeError):
    """The run closed its controls file as it completed (`record`: the ``closed`` line, with step and status):
    no step is left to change.

        try: append_request(folder, {"train.lr": 1e-3}, who="cli")
        except ControlsClosed as e: e.record["step"]
    """

    def __init__(self, folder: "str | Path", record: dict):
        self.folder, self.record = Path(folder), record
        super().__init__(f"{folder}: the run {record.get('status', 'COMPLETED')} after step {record.get('step')} "
                         f"and closed its controls")


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


def encode(record: dict) -> bytes:
    """One controls.jsonl line: `record` stamped with the current time, as strict JSON ending in a newline."""
    return (json.dumps({"time": time.time(), **record}, allow_nan=False) + "\n").encode()


class Held:
    """controls.jsonl open for appending under its lock (see `holding`): `closed()` says whether the run closed
    it, `append(records)` writes lines as one write.

        with holding("runs/a") as held:
            if not held.closed(): held.append([{"kind": "request", ...}])
    """

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    def size(self) -> int:
        """The file's current size in bytes."""
        return os.fstat(self.fd).st_size

    def last(self) -> "dict | None":
        """The file's last complete line as a record (None: none, or not a JSON object)."""
        size = self.size()
        tail = os.pread(self.fd, min(size, 4096), max(0, size - 4096))
        lines = tail[:tail.rfind(b"\n") + 1].split(b"\n")[:-1]
        try:
            rec = json.loads(lines[-1]) if lines else None
        except ValueError:
            return None
        return rec if isinstance(rec, dict) else None

    def closed(self) -> "dict | None":
        """The ``closed`` line when the run closed the file (nothing may be appended after it but ``opened``)."""
        rec = self.last()
        return rec if rec and rec.get("kind") == "closed" else None

    def append(self, records: list[dict]) -> None:
        """The records as lines, one write, starting on a new line; a write cut short (disk full) is taken back,
        a file left empty by it removed; FolderWriteError for what a person must fix."""
        size = self.size()
        repair = size and os.pread(self.fd, 1, size - 1) != b"\n"  # a line cut by a crash: end it first
        data = (b"\n" if repair else b"") + b"".join(encode(r) for r in records)
        try:
            written = os.write(self.fd, data)
            if written < len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            try:
                if self.size() > size:
                    os.ftruncate(self.fd, size)
                if size == 0:
                    self.path.unlink()  # ours (under the lock): leave no empty controls.jsonl behind
            except OSError:
                pass
            with writing(self.path, len(data), left="the file was left as it was", then=AGAIN):
                raise e


@contextlib.contextmanager
def holding(folder: "str | Path"):
    """controls.jsonl (created if missing) open for appending under its lock, an exclusive flock on the file,
    as a Held; what is read and appended inside is one step for every other writer. FolderWriteError where the
    folder cannot be written."""
    path = controls_path(folder)
    while True:
        with writing(path, None, left="nothing was written", then=AGAIN):
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False  # removed by a failed append while we waited: open the path again
            if same:
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield Held(path, fd)
    finally:
        os.close(fd)  # releases the lock


def append_control(folder: "str | Path", record: dict) -> None:
    """One line, appended under the file's lock (see the module docstring)."""
    with holding(folder) as held:
        held.append([record])


def append_request(folder: "str | Path", changes: dict, who: str, at: int | None = None) -> str:
    """Append a request for `changes` (already checked: moelab.config.live.check_changes); returns its id.
    ControlsClosed when the run has closed the file (it completed), FolderWriteError where it cannot be written;
    nothing is written then."""
    rid = uuid.uuid4().hex[:12]
    record = {"kind": "request", "id": rid, "who": who, "changes": changes}
    if at is not None:
        record["at"] = int(at)
    with holding(folder) as held:
        closed = held.closed()
        if closed:
            raise ControlsClosed(folder, closed)
        held.append([record])
    return rid


class ControlsFile:
    """What controls.jsonl holds, read incrementally: `read()` parses only the lines appended since the last
    read (the file read again from the top when it was replaced or shrank). `requests` in file order,
    `outcomes` {request id: its last applied/rejected line}, `closed` (the ``closed`` line while the run is
    closed, else None), `latest` {field: its newest applied value}. A half-written last line waits for its
    newline; a damaged complete line is skipped with a ControlsWarning (its message kept in `damaged`).

        f = ControlsFile("runs/tiny"); f.read().outcomes.get(rid)
    """

    def __init__(self, folder: "str | Path"):
        self.path = controls_path(folder)
        self.lock = threading.Lock()
        self._reset(None)

    def _reset(self, ino) -> None:
        self.ino, self.offset, self.lineno = ino, 0, 0
        self.requests: list[dict] = []
        self.outcomes: dict[str, dict] = {}
        self.closed: "dict | None" = None
        self.latest: dict = {}
        self.damaged: list[str] = []

    def read(self) -> "ControlsFile":
        """Parse the complete lines appended since the last read (from the top when the file was replaced or
        shrank; reset when it is gone) and return self."""
        with self.lock:
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                if self.ino is not None:
                    self._reset(None)
                return self
            if st.st_ino != self.ino or st.st_size < self.offset:
                self._reset(st.st_ino)
            if st.st_size > self.offset:
                with open(self.path, "rb") as f:
                    f.seek(self.offset)
                    data = f.read(st.st_size - self.offset)
                end = data.rfind(b"\n") + 1
                self.feed(data[:end])
                self.offset += end
        return self

    def feed(self, data: bytes) -> None:
        """Take complete lines (bytes ending in a newline)."""
        for line in data.split(b"\n")[:-1]:
            self.lineno += 1
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                rec = e
            kind = rec.get("kind") if isinstance(rec, dict) else None
            if kind == "request" and isinstance(rec.get("changes"), dict) and "id" in rec:
                self.requests.append(rec)
            elif kind in ("applied", "rejected") and "id" in rec:
                self.outcomes[rec["id"]] = rec
                if kind == "applied":
                    for key, pair in rec.get("changes", {}).items():
                        if key != CHECKPOINT_NOW:
                            self.latest[key] = pair[1]
            elif kind in ("closed", "opened"):
                self.closed = rec if kind == "closed" else None
            else:
                why = rec if isinstance(rec, ValueError) else "not a request, an outcome or a marker"
                self.damaged.append(f"{self.path}:{self.lineno}: not a control line ({why}): skipped (a write "
                                    f"cut by a crash)")
                warnings.warn(ControlsWarning(self.damaged[-1]), stacklevel=3)


_READERS: dict[Path, ControlsFile] = {}


def reader(folder: "str | Path") -> ControlsFile:
    """This process's ControlsFile of `folder`, brought up to date (one per folder: a caller that asks again
    reads only what was appended since)."""
    key = Path(folder).absolute()
    f = _READERS.get(key)
    if f is None:
        f = _READERS.setdefault(key, ControlsFile(key))
    return f.read()


def read_controls(folder: "str | Path") -> tuple[list[dict], dict[str, dict]]:
    """(requests, outcomes) of the folder's controls.jsonl (([], {}) when there is none)."""
    f = reader(folder)
    return list(f.requests), dict(f.outcomes)
