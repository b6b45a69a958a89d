"""The metrics stream: the one contract between the trainer and every reader (Run, dashboard, gallery).

A run folder holds ``metrics.jsonl``: one JSON object per line, appended and flushed as it happens.

The events and their fields are classes: moelab.contract.events (StartEvent, StepEvent, EvalEvent,
WarningEvent, CheckpointEvent, EndEvent, ErrorEvent, ControlEvent; SCHEMA_VERSION). Writers hand those to
``MetricsWriter.emit`` (the one writer); readers get them back with ``read_events(..., typed=True)`` or
``JsonlTail(..., typed=True)`` (the plain JSON objects without ``typed``, for tools and tests), or only the
stream's last events with ``tail_events`` (a reader of a long run reads a bounded amount from its end).

Readers must expect the last line to be half written while a run is live (``read_events(..., live=True)``):
it is left out silently until its newline arrives. Any other line that is not a valid event (it does not parse,
or a ``step`` / ``checkpoint`` event lacks an integer step, ...) is damage: every reader skips it and reports it
by file and line number, once (``read_events`` as a MetricsWarning, ``JsonlTail`` in ``errors``, a resume as a
``damaged_metrics_line`` warning event); ``read_events(..., strict=True)`` raises MetricsError instead.

Resume (rewind_metrics, below): a run continued from its checkpoint at step k first rewrites
this file once, atomically (temp file + rename), without the ``step``, ``checkpoint``, ``eval`` and ``control``
events after k
(the run computes those steps again) and without a half-written last line; every other event is kept, so an earlier
attempt's ``end`` (PREEMPTED) or ``error`` stays visible. It then appends a ``start`` with start_step = k. Hence
in any metrics.jsonl every step appears at most once, in order, and steps 1..k are contiguous at a resume; the
run's current attempt is everything after the last ``start``. A JsonlTail notices the rewrite (a new file) and
reads it again from the top, passing on only events it has not delivered before; the repeated steps that follow
arrive as new events with a step <= the last one seen, which a live reader treats as "rewind to here".
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from moelab.contract.events import EVENTS, SCHEMA_VERSION, Event, MetricsError, parse_event
from moelab.contract.writes import append_line, write_durably

__all__ = ["SCHEMA_VERSION", "EVENTS", "MetricsError", "MetricsWarning", "MetricsWriter", "read_events",
           "tail_events", "scan_events", "JsonlTail", "rewind_metrics"]


class MetricsWarning(UserWarning):
    """A damaged metrics.jsonl line that a reader skipped; the message names the file and the line, e.g.
    ``runs/tiny/metrics.jsonl:5: not valid JSON (...): a damaged line, skipped``. Python shows each once."""


class MetricsWriter:
    """The one writer of events: appends them to metrics.jsonl, each in one O_APPEND write of one line, so a
    crash loses nothing that was written, a reader never sees a partial line except the very last one, and
    lines of several processes do not interleave (rank 0 writes the run's events; any rank or the launcher may
    append one, e.g. an error). A failed write (disk full, read-only) raises FolderWriteError
    (moelab.contract.writes) naming the path and the bytes.

        w = MetricsWriter("runs/a/metrics.jsonl")
        w.emit(EvalEvent(step=10, loss=2.1, perplexity=8.2, batches=2, tokens=4096))
    """

    def __init__(self, path: "str | Path"):
        self.path = Path(path)

    def emit(self, event: Event) -> Event:
        """Append `event` as one line; returns it."""
        append_line(self.path, encode(event))
        return event

    def close(self) -> None:
        """Nothing to release (every emit opens and closes the file); kept for the writer's callers."""
        pass


def encode(event: Event) -> bytes:
    """One stream line: the event's JSON, non-finite numbers as null (a non-finite loss is also an error event)."""
    return (json.dumps(_finite(event.to_json()), allow_nan=False, default=_jsonable) + "\n").encode()


def _finite(x):
    """NaN and infinities are not JSON: they are written as null (a non-finite loss is also an error event)."""
    if isinstance(x, float):
        return x if x == x and abs(x) != float("inf") else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, float):  # nan / inf are not JSON: write null
        return None
    return str(x)


def parse_line(line: "str | bytes", where: str, typed: bool = False) -> "dict | Event":
    """One line as its typed event (`typed`) or its JSON object, checked against the event's class either way;
    MetricsError names `where` and says what is wrong."""
    try:
        record = json.loads(line)
    except ValueError as e:
        raise MetricsError(f"{where}: not valid JSON ({e})") from None
    try:
        event = parse_event(record)
    except MetricsError as e:
        raise MetricsError(f"{where}: {e}") from None
    return event if typed else record


def parse_lines(data: bytes, where: "str | Path", typed: bool = False, first_line: int = 1
                ) -> tuple[list[tuple[int, bytes, "dict | Event | MetricsError"]], bytes]:
    """Split a stream's bytes into (line number, line, event or the MetricsError saying why it is none) for
    every complete non-blank line, and the bytes after the last newline (b"" when the stream ends cleanly)."""
    lines = data.split(b"\n")
    tail = lines.pop()
    out = []
    for i, line in enumerate(lines, first_line):
        if line.strip():
            try:
                out.append((i, line, parse_line(line, f"{where}:{i}", typed)))
            except MetricsError as e:
                out.append((i, line, e))
    return out, tail


def read_events(path: "str | Path", live: bool = False, strict: bool = False, typed: bool = False
                ) -> "list[dict] | list[Event]":
    """All valid events of a metrics.jsonl: typed (moelab.contract.events) when `typed`, else their JSON
    objects. A damaged complete line is skipped with a MetricsWarning naming its line (MetricsError if
    `strict`). A last line without its newline is left out silently when `live` (the writer may be mid-line);
    otherwise it raises MetricsError (the stream was cut by a kill mid-write)."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    parsed, tail = parse_lines(data, path, typed)
    events = []
    for _, _, event in parsed:
        if isinstance(event, MetricsError):
            if strict:
                raise event
            # stacklevel 1: the warnings registry of this module shows each damaged line once per process
            warnings.warn(MetricsWarning(f"{event}: a damaged line, skipped"), stacklevel=1)
            continue
        events.append(event)
    if tail.strip() and not live:
        last = data.count(b"\n") + 1
        raise MetricsError(f"{path}:{last}: truncated last line (no newline); the run was "
                           f"interrupted mid-write. Remove the line or resume the run")
    return events


class JsonlTail:
    """Incremental reader for a live stream: returns new complete events on each poll (typed when `typed`; at
    most about `chunk_bytes` of the file per poll: poll until it returns nothing to catch up), keeps a half-written
    last line for the next poll, and reports each damaged complete line once through `errors` (never raises).
    When the file is replaced (a resume rewinds it, see above) it is read again from the top and only events not
    delivered before are returned; `rewinds` counts such replacements."""

    def __init__(self, path: "str | Path", typed: bool = False, chunk_bytes: int = 16 << 20):
        self.path, self.typed, self.chunk_bytes = Path(path), typed, chunk_bytes
        self._pos = 0
        self._partial = b""
        self._line = 0
        self._inode: int | None = None
        self._delivered: set[int] = set()
        self._damaged: set[tuple[int, int]] = set()  # (line hash, its n-th copy in the file): reported
        self._copies: dict[int, int] = {}  # damaged line hash -> copies seen in this reading of the file
        self.rewinds = 0
        self.errors: list[str] = []

    def poll(self) -> "list[dict] | list[Event]":
        """The events (or JSON objects) appended since the last poll; a replaced or truncated file is read again
        from its start."""
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if self._inode is not None and (st.st_ino != self._inode or st.st_size < self._pos):
                    self._pos, self._partial, self._line, self._copies = 0, b"", 0, {}
                    self.rewinds += 1
                self._inode = st.st_ino
                f.seek(self._pos)
                chunk = b""
                while True:  # at most chunk_bytes per poll (memory stays bounded), but a whole line
                    part = f.read(self.chunk_bytes)
                    chunk += part
                    if len(part) < self.chunk_bytes or b"\n" in part:
                        break
                self._pos = f.tell()
        except FileNotFoundError:
            return []
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        out = []
        for line in lines:
            self._line += 1
            if line.strip():
                key = hash(line)  # each line is one event, made unique by its time
                try:
                    event = parse_line(line, f"{self.path}:{self._line}", self.typed)
                except MetricsError as e:
                    self._copies[key] = self._copies.get(key, 0) + 1
                    if (key, self._copies[key]) not in self._damaged:  # once, even when a rewound file shows
                        self._damaged.add((key, self._copies[key]))   # it again
                        self.errors.append(str(e))
                    continue
                if self.rewinds and key in self._delivered:
                    continue
                self._delivered.add(key)
                out.append(event)
        return out


# ---------------------------------------------------------------------- the end of a long stream
TAIL_BYTES = 256 << 10  # tail_events reads this much from the end of the stream (more only for a longer line)


def tail_events(path: "str | Path", kinds: "tuple[str, ...] | None" = None, max_bytes: int = TAIL_BYTES,
                first: "tuple[str, ...]" = ("start",), limit: "int | None" = None) -> tuple[list[Event], list[Event]]:
    """The typed events of `kinds` (all when None) in the last `max_bytes` of a stream (the last `limit` of them
    when given: only those lines are parsed), and the events of kinds `first` from its first 64 KiB (a run's
    first `start`, which a long stream's end no longer holds). A reader of a run of a million steps reads a
    bounded amount, whatever the file's size: `moelab status`, moelab.runs(), a Run's progress and status. The
    window grows only while it holds no whole line (a single line longer than it). Damaged lines and a
    half-written last line are left out (the full readers report them).

        last, head = tail_events("runs/a/metrics.jsonl", kinds=("step",), limit=1)   # the last step, first start
    """
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return [], []
    with f:
        start, lines = _last_whole_lines(f, os.fstat(f.fileno()).st_size, max_bytes)
        last = _parse_kinds(lines, path, kinds, limit)
        head = b""
        if start and first:
            f.seek(0)
            head = f.read(min(64 * 1024, start))
            head = head[:head.rfind(b"\n") + 1]
    return last, _parse_kinds(head.split(b"\n")[:-1], path, first)


def _last_whole_lines(f, size: int, max_bytes: int) -> tuple[int, list[bytes]]:
    """(where the window starts, its whole lines): the last `max_bytes` of the open file `f` of `size` bytes,
    the window doubled while it holds no whole line."""
    while True:
        start = max(size - max_bytes, 0)
        f.seek(start)
        data = f.read(size - start)
        cut = data.find(b"\n") + 1 if start else 0  # the first line read is a piece of a line: drop it
        if not start or 0 < cut < len(data):
            return start, data[cut:data.rfind(b"\n") + 1].split(b"\n")[:-1]
        max_bytes *= 2


def _parse_kinds(lines: list[bytes], path: Path, kinds: "tuple[str, ...] | None",
                 limit: "int | None" = None) -> list[Event]:
    """The typed events of `kinds` (all when None) among `lines`, in order, damaged lines left out; only the
    last `limit` when given (parsed from the end: the other lines are not parsed)."""
    found = []
    for line in reversed(lines):
        kind = _kind(line)
        if kinds is not None and kind is not None and kind not in kinds:
            continue
        try:
            event = parse_line(line, str(path), typed=True)
        except MetricsError:
            continue
        if kinds is None or event.EVENT in kinds:
            found.append(event)
            if limit is not None and len(found) >= limit:
                break
    found.reverse()
    return found


def scan_events(path: "str | Path", kinds: "tuple[str, ...] | None" = None, max_steps: "int | None" = None
                ) -> list[Event]:
    """The typed events of `kinds` (all when None), read line by line (memory stays flat however long the
    stream); only the lines of those kinds are parsed. With `max_steps`, a stream of more step events keeps
    at most about that many, evenly spaced, the last one always (a table or a plot of a million steps).
    Damaged lines and a half-written last line are left out (read_events reports them).

        steps = scan_events("runs/a/metrics.jsonl", kinds=("step",), max_steps=10_000)
    """
    path = Path(path)
    if not path.exists():
        return []
    wanted = set(kinds or EVENTS)
    stride = 1
    if max_steps and "step" in wanted:
        with open(path, "rb") as f:
            n = sum(1 for line in f if _kind(line) in ("step", None))
        stride = max(1, -(-n // max(max_steps - 1, 1)))  # room for the last step
    out, seen, passed = [], 0, None
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                break  # half written: the writer is mid-line
            kind = _kind(line)
            if kind is not None and kind not in wanted:
                continue
            if kind == "step" and stride > 1:
                seen += 1
                passed = (i, line, len(out)) if (seen - 1) % stride else None
                if passed is not None:
                    continue
            try:
                event = parse_line(line, f"{path}:{i}", typed=True)
            except MetricsError:
                continue
            if event.EVENT in wanted:
                out.append(event)
    if passed is not None:  # the last step, which the stride passed over, in its place
        try:
            out.insert(passed[2], parse_line(passed[1], f"{path}:{passed[0]}", typed=True))
        except MetricsError:
            pass
    return out


_PREFIX = b'{"event": "'


def _kind(line: bytes) -> "str | None":
    """A line's event kind from the prefix every writer puts first (None when the line does not start so)."""
    if not line.startswith(_PREFIX):
        return None
    end = line.find(b'"', len(_PREFIX))
    return line[len(_PREFIX):end].decode(errors="replace") if end > 0 else None


# ---------------------------------------------------------------------- the stream on resume
def rewind_metrics(path: "str | Path", step: int) -> tuple[list[dict], list[dict]]:
    """Rewrite metrics.jsonl (atomically) without the step, checkpoint and eval events after `step`: the resumed run
    writes them again, so every step appears exactly once. Returns the kept step events and warnings for the
    stream ({kind, message}; none when all was well): a half-written last line (a kill mid-write: dropped) and
    damaged lines (not valid events: kept as they are, for a person to look at, and skipped by every reader)."""
    path = Path(path)
    if not path.exists():
        return [], []
    data = path.read_bytes()
    parsed, tail = parse_lines(data, path)
    kept, records, damaged, damaged_why = [], [], [], []
    for _, line, event in parsed:
        if isinstance(event, MetricsError):
            damaged.append(str(len(kept) + 1))  # its line in the rewritten file
            damaged_why.append(str(event).split(": ", 1)[-1])
        elif event["event"] == "step" and event["step"] <= step:
            records.append(event)
        elif event["event"] in ("step", "checkpoint", "eval", "control") and event.get("step", 0) > step:
            continue
        kept.append(line)
    tmp = path.with_name(path.name + ".rewind")
    write_durably(tmp, b"".join(line + b"\n" for line in kept))
    os.replace(tmp, path)
    notes = []
    if tail.strip():
        last = data.count(b"\n") + 1
        notes.append({"kind": "truncated_metrics_line",
                      "message": f"{path}:{last}: dropped a half-written last line ({len(tail)} bytes)"})
    if damaged:
        notes.append({"kind": "damaged_metrics_line", "message": (
            f"{path}: line(s) {', '.join(damaged)} are not valid events ({damaged_why[0]}); kept as they are "
            f"and skipped by every reader")})
    return records, notes

