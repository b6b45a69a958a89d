"""The metrics stream: the one contract between the trainer and every reader (Run, dashboard, gallery).

A run folder holds ``metrics.jsonl``: one JSON object per line, appended and flushed as it happens.

Schema version 1 (``SCHEMA_VERSION``); every event has ``event``, ``schema`` and ``time`` (unix seconds):
- ``start``: config (dict), env (torch, python, host, device, gpu_name, world_size, layout), total_steps,
  start_step (> 0 after a resume), resumed_from (the checkpoint folder, or null), flops_per_token,
  flops_convention, activated_params, total_params.
- ``step``: step (1-based optimizer step), loss, aux_loss, z_loss, lr, grad_norm, tokens (this step, global),
  step_time_s, tokens_per_s, tokens_per_s_per_gpu, tflops_per_gpu, mfu (null where the peak is unknown),
  skipped (true when a non-finite step was skipped),
  memory: {peak_allocated_gb, peak_reserved_gb, rss_gb, max_peak_allocated_gb, per_rank: [{rank, ...}]},
  routing: {tokens_per_expert: [moe_layers][num_experts] (global, after dropping: each layer sums to
  tokens x top_k - dropped), routed_per_expert: [moe_layers][num_experts] (the same before dropping: the demand
  the router placed), dropped_tokens: [moe_layers], entropy: [moe_layers], logit_norm: [moe_layers],
  capacity_factor: [moe_layers]}, health: {dead_experts: [[layer, expert], ...] (no tokens for
  model.moe.dead_expert_steps steps), overloaded: [[layer, expert, share], ...] (load > model.moe.overload_factor
  x the mean; share of the layer's assignments)} (moelab.train.health; layer = index among MoE layers),
  comm: {name: number or list} this step's communication counts summed over ranks (empty on one process; with
  EP moelab.parallel.expert_parallel.DispatchCounts: dispatch_rows, dispatch_bytes, dispatch_token_ranks,
  dispatch_once_per_rank_bytes, tokens_by_ranks_reached; with replicated experts the gradient exchange's
  expert_grad_bytes and expert_grad_uncompressed_bytes, moelab.parallel.compression).
- ``eval``: step (after that step's ``step`` event), loss (mean next-token cross entropy on the held-out data:
  train.eval_batches fixed global batches, the same on every layout), perplexity (exp(loss)), batches, tokens
  (moelab.train.evaluate; written every train.eval_every steps and after the last step).
- ``warning``: step, kind, message. Reliability kinds (moelab.train.checkpoint): "preempted" (a stop signal;
  a checkpoint was saved), "corrupt_checkpoint" (a damaged checkpoint was skipped on resume), "layout_changed"
  (resumed onto another layout), "truncated_metrics_line" (a half-written last line was dropped on resume),
  "damaged_metrics_line" (lines that are not valid events were kept as they are, and are skipped by readers).
  Kinds "dead_expert" and "overloaded_expert" (emitted when an expert becomes dead or overloaded, not while it
  stays so) also carry layer and expert, and "overloaded_expert" its share.
- ``checkpoint``: step, path (written once the checkpoint folder is complete).
- ``end``: step, status ("COMPLETED" | "PREEMPTED" | "STOPPED"), summary.
- ``error``: step, rank, message, traceback.
- ``control``: step (the boundary: after that step, before the next), field, old, new, who: a change made while
  the run trained (moelab.train.controls; the requests are RUN/controls.jsonl, moelab.contract.controls).

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
import time
import warnings
from pathlib import Path

SCHEMA_VERSION = 1
EVENTS = ("start", "step", "eval", "warning", "checkpoint", "end", "error", "control")


class MetricsError(ValueError):
    """A metrics.jsonl line that is not a valid event (the message names the file and the line)."""


class MetricsWarning(UserWarning):
    """A damaged metrics.jsonl line that a reader skipped; the message names the file and the line, e.g.
    ``runs/tiny/metrics.jsonl:5: not valid JSON (...): a damaged line, skipped``. Python shows each once."""


class MetricsWriter:
    """Appends events to metrics.jsonl; one write() and one flush() per event, so a crash loses nothing that
    was written and a reader never sees a partial line except the very last one."""

    def __init__(self, path: "str | Path"):
        self.path = Path(path)
        self._f = open(self.path, "a", buffering=1)

    def write(self, event: str, **fields) -> dict:
        record = {"event": event, "schema": SCHEMA_VERSION, "time": time.time(), **_finite(fields)}
        self._f.write(json.dumps(record, allow_nan=False, default=_jsonable) + "\n")
        self._f.flush()
        return record

    def close(self) -> None:
        self._f.close()


def append_event(path: "str | Path", event: str, **fields) -> None:
    """Append one event from any process (an error on a rank that is not the writer): a single O_APPEND
    write of one line, which does not interleave with the writer's lines."""
    line = json.dumps({"event": event, "schema": SCHEMA_VERSION, "time": time.time(), **_finite(fields)},
                      default=_jsonable) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


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


def parse_line(line: "str | bytes", where: str) -> dict:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise MetricsError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(record, dict) or record.get("event") not in EVENTS:
        raise MetricsError(f"{where}: not a moelab event (needs 'event' in {EVENTS})")
    schema = record.get("schema", SCHEMA_VERSION)
    if not isinstance(schema, int) or isinstance(schema, bool):
        raise MetricsError(f"{where}: schema {schema!r} is not a version number")
    if schema > SCHEMA_VERSION:
        raise MetricsError(f"{where}: schema {record['schema']} is newer than this moelab reads "
                           f"({SCHEMA_VERSION}); upgrade moelab")
    step = record.get("step")
    if record["event"] in ("step", "checkpoint") and (not isinstance(step, int) or isinstance(step, bool)):
        raise MetricsError(f"{where}: a {record['event']} event without an integer step ({step!r})")
    for key in ("memory", "routing", "config", "env", "summary"):
        if record.get(key) is not None and not isinstance(record[key], dict):
            raise MetricsError(f"{where}: {key} is {type(record[key]).__name__}, not an object")
    return record


def parse_lines(data: bytes, where: "str | Path") -> tuple[list[tuple[int, bytes, "dict | MetricsError"]], bytes]:
    """Split a stream's bytes into (line number, line, event or the MetricsError saying why it is none) for
    every complete non-blank line, and the bytes after the last newline (b"" when the stream ends cleanly)."""
    lines = data.split(b"\n")
    tail = lines.pop()
    out = []
    for i, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append((i, line, parse_line(line, f"{where}:{i}")))
            except MetricsError as e:
                out.append((i, line, e))
    return out, tail


def read_events(path: "str | Path", live: bool = False, strict: bool = False) -> list[dict]:
    """All valid events of a metrics.jsonl. A damaged complete line is skipped with a MetricsWarning naming its
    line (MetricsError if `strict`). A last line without its newline is left out silently when `live` (the
    writer may be mid-line); otherwise it raises MetricsError (the stream was cut by a kill mid-write)."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    parsed, tail = parse_lines(data, path)
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
    """Incremental reader for a live stream: returns new complete events on each poll, keeps a half-written
    last line for the next poll, and reports each damaged complete line once through `errors` (never raises).
    When the file is replaced (a resume rewinds it, see above) it is read again from the top and only events not
    delivered before are returned; `rewinds` counts such replacements."""

    def __init__(self, path: "str | Path"):
        self.path = Path(path)
        self._pos = 0
        self._partial = b""
        self._line = 0
        self._inode: int | None = None
        self._delivered: set[int] = set()
        self._damaged: set[tuple[int, int]] = set()  # (line hash, its n-th copy in the file): reported
        self._copies: dict[int, int] = {}  # damaged line hash -> copies seen in this reading of the file
        self.rewinds = 0
        self.errors: list[str] = []

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if self._inode is not None and (st.st_ino != self._inode or st.st_size < self._pos):
                    self._pos, self._partial, self._line, self._copies = 0, b"", 0, {}
                    self.rewinds += 1
                self._inode = st.st_ino
                f.seek(self._pos)
                chunk = f.read()
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
                    event = parse_line(line, f"{self.path}:{self._line}")
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


def write_durably(path: Path, data: "str | bytes") -> None:
    """Write a whole file and fsync it before returning (callers then rename it into place)."""
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
