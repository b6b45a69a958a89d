"""The events of metrics.jsonl as code: one dataclass per kind, with to_json / from_json.

The trainer writes these classes (moelab.contract.stream.MetricsWriter.emit) and every reader
turns a line back into one (`parse_event`), so the schema has one definition: the fields below, in the order a
line holds them. Every line also carries ``event`` (the kind), ``schema`` (SCHEMA_VERSION) and ``time`` (unix s).

    ev = StepEvent(step=3, loss=2.9, routing=Routing(tokens_per_expert_ME=[[5, 3]]))
    line = ev.to_json()                 # {"event": "step", "schema": 1, "time": ..., "step": 3, "loss": 2.9, ...}
    parse_event(line).routing.tokens_per_expert_ME   # [[5, 3]]

Fields a reader does not know are KEPT, deliberately: a stream of the same schema version written by a newer
moelab (a field added) reads here with the new fields in ``extra``, and to_json writes them back unchanged, so a
resume's rewind or an export loses nothing. A newer schema version, an unknown kind or a field of the wrong type
(a step that is not an integer, a nested part that is not an object) is refused: parse_event raises
MetricsError, and readers skip the line as damaged (moelab.contract.stream).

Nested parts readers use are typed: a step's Memory (with RankMemory per rank), Routing and Health; a start's
RunEnv. Shape letters (docs/shapes.md): M = MoE layers, E = experts per layer. On disk the keys stay the
schema's (``tokens_per_expert``); in code they carry the shape (``tokens_per_expert_ME``).
"""
from __future__ import annotations

import dataclasses as dc
import functools
import time as _time
from typing import Any, ClassVar

SCHEMA_VERSION = 1
END_STATUSES = ("COMPLETED", "PREEMPTED", "CANCELLED")  # what an `end` event may say (the trainer's three ends)


class MetricsError(ValueError):
    """A metrics.jsonl line that is not a valid event (the message names the file and the line).

        parse_event({"event": "step"})   # MetricsError: a step event without an integer step (None)
    """


# ---------------------------------------------------------------------- the typed parts
class Part:
    """A nested object of an event: JSON keys may differ from the field names (`KEYS`: field -> key), and
    unknown keys are kept in `extra`, as for events.

        Routing.from_json({"tokens_per_expert": [[1, 2]], "new": 1}).extra   # {"new": 1}
    """

    KEYS: ClassVar[dict] = {}

    def to_json(self) -> dict:
        """The part as the stream's JSON object (its keys, `extra` kept)."""
        out = {key: _to_json(getattr(self, name)) for name, key, *_ in _fields(type(self))}
        return {**out, **self.extra}

    @classmethod
    def from_json(cls, data: dict) -> "Part":
        """The part from the stream's JSON object; unknown keys go to `extra`; MetricsError when malformed."""
        if not isinstance(data, dict):
            raise MetricsError(f"{cls.__name__.lower()} is {type(data).__name__}, not an object")
        data, kw = dict(data), {}
        for name, key, part, many in _fields(cls):
            if key in data:
                v = data.pop(key)
                kw[name] = v if part is None or v is None else (
                    [part.from_json(x) for x in v] if isinstance(v, list) else []) if many else part.from_json(v)
        return cls(**kw, extra=data)


@dc.dataclass
class RankMemory(Part):
    """One rank's memory at a step, GiB (peak allocated and reserved by the CUDA allocator, 0 on CPU; peak RSS).

        RankMemory(rank=1, rss_gb=0.8).to_json()["rss_gb"]   # 0.8
    """

    rank: int = 0
    peak_allocated_gb: float | None = None
    peak_reserved_gb: float | None = None
    rss_gb: float | None = None
    extra: dict = dc.field(default_factory=dict)


@dc.dataclass
class Memory(Part):
    """A step's memory: rank 0's figures, the maximum over ranks (allocated on GPUs, RSS on CPU), every rank's.

        Memory(rss_gb=1.2, per_rank=[RankMemory(0, 0.0, 0.0, 1.2)]).per_rank[0].rss_gb   # 1.2
    """

    peak_allocated_gb: float | None = None
    peak_reserved_gb: float | None = None
    rss_gb: float | None = None
    max_peak_allocated_gb: float | None = None
    per_rank: list = dc.field(default_factory=list, metadata={"part": RankMemory, "many": True})
    extra: dict = dc.field(default_factory=dict)


@dc.dataclass
class Routing(Part):
    """A step's routing, per MoE layer (M) and expert (E), summed over ranks: tokens kept after capacity
    dropping, tokens the router placed (before dropping), and per layer the dropped tokens, the router's
    entropy, logit norm and capacity factor.

        Routing(tokens_per_expert_ME=[[4, 0]]).tokens_per_expert_ME[0]   # [4, 0]
    """

    KEYS: ClassVar[dict] = {"tokens_per_expert_ME": "tokens_per_expert", "routed_per_expert_ME": "routed_per_expert",
                            "dropped_tokens_M": "dropped_tokens", "entropy_M": "entropy",
                            "logit_norm_M": "logit_norm", "capacity_factor_M": "capacity_factor"}
    tokens_per_expert_ME: list = dc.field(default_factory=list)
    routed_per_expert_ME: list = dc.field(default_factory=list)
    dropped_tokens_M: list = dc.field(default_factory=list)
    entropy_M: list = dc.field(default_factory=list)
    logit_norm_M: list = dc.field(default_factory=list)
    capacity_factor_M: list = dc.field(default_factory=list)
    extra: dict = dc.field(default_factory=dict)


@dc.dataclass
class Health(Part):
    """Experts in trouble at a step (moelab.train.health; layer = index among MoE layers): dead ones ([layer,
    expert], no tokens for model.moe.dead_expert_steps steps) and overloaded ones ([layer, expert, share]).

        Health(dead_experts=[[0, 3]]).dead_experts   # [[0, 3]]
    """

    dead_experts: list = dc.field(default_factory=list)
    overloaded: list = dc.field(default_factory=list)
    extra: dict = dc.field(default_factory=dict)


@dc.dataclass
class RunEnv(Part):
    """Where a run (attempt) started: versions, host, device, world size, layout, pid, SLURM job id.

        RunEnv(device="cpu", world_size=2, slurm_job_id="1234")
    """

    torch: str | None = None
    python: str | None = None
    host: str | None = None
    device: str | None = None
    gpu_name: str | None = None
    world_size: int | None = None
    layout: dict = dc.field(default_factory=dict)
    pid: int | None = None
    slurm_job_id: str | None = None
    extra: dict = dc.field(default_factory=dict)


# ---------------------------------------------------------------------- the events
@dc.dataclass(kw_only=True)
class Event(Part):
    """What every event carries: its kind (`EVENT`), the schema version and the time it was written.

        ev = parse_event(line); ev.EVENT, ev.schema, ev.time   # "step", 1, 1796160252.9
    """

    EVENT: ClassVar[str] = ""
    OMIT_NONE: ClassVar[frozenset] = frozenset()  # optional fields left out of the line when None (else null)
    schema: int = SCHEMA_VERSION
    time: float = dc.field(default_factory=_time.time)
    extra: dict = dc.field(default_factory=dict)

    def to_json(self) -> dict:
        """One stream line's object: event, schema and time first, then the fields (OMIT_NONE ones left out when
        None)."""
        body = super().to_json()
        head = {"event": self.EVENT, "schema": body.pop("schema"), "time": body.pop("time")}
        return {**head, **{k: v for k, v in body.items() if v is not None or k not in self.OMIT_NONE}}

    @classmethod
    def from_json(cls, data: dict) -> "Event":
        """The event of one stream line's object (its "event" key names the class: parse_event picks it)."""
        data = {k: v for k, v in data.items() if k != "event"}
        return super().from_json(data)


@dc.dataclass(kw_only=True)
class StartEvent(Event):
    """An attempt begins (the first, or a resume with start_step = the checkpoint's step).

        StartEvent(config=cfg.to_dict(), total_steps=20, env=RunEnv(device="cpu", world_size=1))
    """

    EVENT: ClassVar[str] = "start"
    config: dict = dc.field(default_factory=dict)
    total_steps: int | None = None
    start_step: int = 0
    resumed_from: str | None = None
    flops_per_token: float | None = None
    flops_convention: str | None = None
    init_from: dict | None = None  # what loading train.init_from read (moelab.hf.sharded_load), else null
    total_params: int | None = None
    activated_params: int | None = None
    env: RunEnv | None = dc.field(default=None, metadata={"part": RunEnv})


@dc.dataclass(kw_only=True)
class StepEvent(Event):
    """One optimizer step (1-based), global figures. `comm`: this step's communication counts summed over
    ranks (name -> number or list; empty on one process; moelab.parallel). mfu is null where the peak is unknown;
    skipped is true when a non-finite step was skipped.

        StepEvent(step=1, loss=3.2, tokens=4096, memory=Memory(rss_gb=0.5))
    """

    EVENT: ClassVar[str] = "step"
    step: int
    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    skipped: bool = False
    aux_loss: float | None = None
    z_loss: float | None = None
    comm: dict = dc.field(default_factory=dict)
    routing: Routing | None = dc.field(default=None, metadata={"part": Routing})
    health: Health | None = dc.field(default=None, metadata={"part": Health})
    tokens: int | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    tokens_per_s_per_gpu: float | None = None
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    memory: Memory | None = dc.field(default=None, metadata={"part": Memory})


@dc.dataclass(kw_only=True)
class EvalEvent(Event):
    """Held-out loss after step `step` (moelab.train.evaluate): mean next-token cross entropy over `batches`
    fixed global batches (`tokens` tokens), and its perplexity.

        EvalEvent(step=10, loss=2.1, perplexity=8.17, batches=2, tokens=4096)
    """

    EVENT: ClassVar[str] = "eval"
    step: int
    loss: float | None = None
    perplexity: float | None = None
    batches: int | None = None
    tokens: int | None = None


@dc.dataclass(kw_only=True)
class WarningEvent(Event):
    """Something a person should know. Kinds: "preempted" (a stop signal; a checkpoint was saved),
    "not_requeued" (SLURM refused the requeue after it: moelab.launch.executors), "corrupt_checkpoint",
    "layout_changed", "truncated_metrics_line", "damaged_metrics_line" (moelab.train.checkpoint,
    moelab.contract.stream); "dead_expert" and "overloaded_expert" (moelab.train.health: also layer and expert, and
    the overloaded one's share).

        WarningEvent(step=5, kind="dead_expert", layer=0, expert=3, message="...")
    """

    EVENT: ClassVar[str] = "warning"
    OMIT_NONE: ClassVar[frozenset] = frozenset({"layer", "expert", "share"})  # only the kinds that have them
    step: int | None = None
    kind: str = ""
    message: str = ""
    layer: int | None = None
    expert: int | None = None
    share: float | None = None


@dc.dataclass(kw_only=True)
class CheckpointEvent(Event):
    """The checkpoint of step `step` is complete in folder `path`.

        CheckpointEvent(step=10, path="runs/a/checkpoints/step_000010")
    """

    EVENT: ClassVar[str] = "checkpoint"
    step: int
    path: str = ""


@dc.dataclass(kw_only=True)
class EndEvent(Event):
    """The attempt ended at `step`: COMPLETED (all steps), PREEMPTED (a stop signal: checkpointed, resumable) or
    CANCELLED (a stop after `moelab cancel` / Run.cancel); `summary` as summary.json (moelab.contract.summary).

        EndEvent(step=10, status="PREEMPTED", summary={"final_loss": 3.1})
    """

    EVENT: ClassVar[str] = "end"
    step: int | None = None
    status: str = "COMPLETED"
    summary: dict = dc.field(default_factory=dict)

    def __post_init__(self):
        if self.status not in END_STATUSES:
            raise MetricsError(f"an end event's status is {self.status!r}, not one of {END_STATUSES}")


@dc.dataclass(kw_only=True)
class ErrorEvent(Event):
    """A rank failed at `step` (any rank appends one): the exception's `message` and its `traceback`.

        ErrorEvent(step=3, rank=1, message="RuntimeError: ...", traceback="Traceback ...")
    """

    EVENT: ClassVar[str] = "error"
    step: int | None = None
    rank: int | None = None
    message: str = ""
    traceback: str = ""


@dc.dataclass(kw_only=True)
class ControlEvent(Event):
    """A live change of a config field while the run trains, from step `step` on: `field` (dotted, e.g.
    "train.lr"), its `old` and `new` value, and `who` asked (a user, a schedule, a rule).

        ControlEvent(step=100, field="train.lr", old=3e-4, new=1e-4, who="notebook")
    """

    EVENT: ClassVar[str] = "control"
    step: int
    field: str
    old: Any = None
    new: Any = None
    who: str = ""


KINDS: dict[str, type[Event]] = {c.EVENT: c for c in (StartEvent, StepEvent, EvalEvent, WarningEvent,
                                                       CheckpointEvent, EndEvent, ErrorEvent, ControlEvent)}
EVENTS = tuple(KINDS)  # the kinds a stream may hold


def parse_event(record: Any) -> Event:
    """A stream line's parsed JSON as its typed event; MetricsError says why it is none."""
    if not isinstance(record, dict) or record.get("event") not in KINDS:
        raise MetricsError(f"not a moelab event (needs 'event' in {EVENTS})")
    schema = record.get("schema", SCHEMA_VERSION)
    if not isinstance(schema, int) or isinstance(schema, bool):
        raise MetricsError(f"schema {schema!r} is not a version number")
    if schema > SCHEMA_VERSION:
        raise MetricsError(f"schema {schema} is newer than this moelab reads ({SCHEMA_VERSION}); upgrade moelab")
    cls = KINDS[record["event"]]
    step_required, objects, required = _checks(cls)
    step = record.get("step")
    if step is not None or step_required:
        if not isinstance(step, int) or isinstance(step, bool):
            raise MetricsError(f"a {cls.EVENT} event without an integer step ({step!r})")
    for name in objects:
        v = record.get(name)
        if v is not None and not isinstance(v, dict):
            raise MetricsError(f"{name} is {type(v).__name__}, not an object")
    for name in required:
        if name not in record:
            raise MetricsError(f"a {cls.EVENT} event without {name!r}")
    try:
        return cls.from_json(record)
    except TypeError as e:
        raise MetricsError(f"a {cls.EVENT} event that does not fit its class ({e})") from None


# ---------------------------------------------------------------------- what the classes declare, computed once
@functools.cache
def _fields(cls) -> tuple:
    """(field name, JSON key, Part class or None, a list of them?) of every field but `extra`."""
    return tuple((f.name, cls.KEYS.get(f.name, f.name), f.metadata.get("part"), f.metadata.get("many", False))
                 for f in dc.fields(cls) if f.name != "extra")


@functools.cache
def _checks(cls) -> tuple:
    """What parse_event checks of a kind: is `step` required, the fields that must be objects, the required ones."""
    fields = dc.fields(cls)
    required = tuple(f.name for f in fields if f.default is dc.MISSING and f.default_factory is dc.MISSING)
    objects = tuple(f.name for f in fields if f.name != "extra" and
                    (f.metadata.get("part") is not None or f.type in ("dict", "dict | None")))
    return "step" in required, objects, required


def _to_json(v):
    """A field's JSON: parts (and lists of them) become objects; plain values, lists and dicts are JSON already."""
    if isinstance(v, Part):
        return v.to_json()
    if isinstance(v, list) and v and isinstance(v[0], Part):
        return [x.to_json() for x in v]
    return v
