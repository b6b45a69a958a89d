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
- ``warning``: step, kind, message. Reliability kinds (moelab.train.checkpoint): "preempted" (a stop signal;
  a checkpoint was saved), "corrupt_checkpoint" (a damaged checkpoint was skipped on resume), "layout_changed"
  (resumed onto another layout), "truncated_metrics_line" (a half-written last line was dropped on resume). Kinds "dead_expert" and "overloaded_expert" (emitted when an expert becomes
  dead or overloaded, not while it stays so) also carry layer and expert, and "overloaded_expert" its share.
- ``checkpoint``: step, path (written once the checkpoint folder is complete).
- ``end``: step, status ("COMPLETED" | "PREEMPTED" | "STOPPED"), summary.
- ``error``: step, rank, message, traceback.

Readers must expect the last line to be half written while a run is live (``read_events(..., live=True)``);
any other line that does not parse is corruption and raises MetricsError with the line number.

Resume (moelab.train.checkpoint.rewind_metrics): a run continued from its checkpoint at step k first rewrites
this file once, atomically (temp file + rename), without the ``step`` and ``checkpoint`` events after k (the run
computes those steps again) and without a half-written last line; every other event is kept, so an earlier
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
from pathlib import Path

SCHEMA_VERSION = 1
EVENTS = ("start", "step", "warning", "checkpoint", "end", "error")


class MetricsError(ValueError):
    """A metrics.jsonl line that is not a valid event (the message names the file and the line)."""


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
        raise MetricsError(f"{where}: not valid JSON ({e}); the metrics stream is corrupt") from None
    if not isinstance(record, dict) or record.get("event") not in EVENTS:
        raise MetricsError(f"{where}: not a moelab event (needs 'event' in {EVENTS})")
    schema = record.get("schema", SCHEMA_VERSION)
    if not isinstance(schema, int) or isinstance(schema, bool):
        raise MetricsError(f"{where}: schema {schema!r} is not a version number")
    if schema > SCHEMA_VERSION:
        raise MetricsError(f"{where}: schema {record['schema']} is newer than this moelab reads "
                           f"({SCHEMA_VERSION}); upgrade moelab")
    return record


def read_events(path: "str | Path", live: bool = False) -> list[dict]:
    """All events of a metrics.jsonl. A last line without its newline is tolerated only when `live` (the
    writer may be mid-line); a bad line anywhere else raises MetricsError naming its line number."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    events = []
    for i, line in enumerate(lines, 1):
        if line.strip():
            events.append(parse_line(line, f"{path}:{i}"))
    if tail.strip():
        if not live:
            raise MetricsError(f"{path}:{len(lines) + 1}: truncated last line (no newline); the run was "
                               f"interrupted mid-write. Remove the line or resume the run")
    return events


class JsonlTail:
    """Incremental reader for a live stream: returns new complete events on each poll, keeps a half-written
    last line for the next poll, and reports corrupt complete lines through `errors` (never raises). When the
    file is replaced (a resume rewinds it, see above) it is read again from the top and only events not
    delivered before are returned; `rewinds` counts such replacements."""

    def __init__(self, path: "str | Path"):
        self.path = Path(path)
        self._pos = 0
        self._partial = b""
        self._line = 0
        self._inode: int | None = None
        self._delivered: set[int] = set()
        self.rewinds = 0
        self.errors: list[str] = []

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if self._inode is not None and (st.st_ino != self._inode or st.st_size < self._pos):
                    self._pos, self._partial, self._line = 0, b"", 0
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
                try:
                    event = parse_line(line, f"{self.path}:{self._line}")
                except MetricsError as e:
                    self.errors.append(str(e))
                    continue
                key = hash(line)  # each line is one event, made unique by its time
                if self.rewinds and key in self._delivered:
                    continue
                self._delivered.add(key)
                out.append(event)
        return out
