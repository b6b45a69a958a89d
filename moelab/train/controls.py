"""Live controls on the ranks: the changes asked for in RUN/controls.jsonl, applied by every rank at the same
step boundary, recorded, checkpointed and replayed on resume.

The request path (moelab.contract.controls names the file): rank 0 looks at controls.jsonl once per step (one
stat; when it grew, only what was appended is read) and adds one flag, "something is due", to the step's one
all-reduce (moelab.train.stats.StatsPack), so a step without a change costs no extra collective. When the flag is set,
after the step (and its evaluation), rank 0 checks the due changes against the live config
(moelab.config.live.check_changes: the same errors as a config), broadcasts them (broadcast_object_list on the
world group) and every rank applies the same changes before the next step. Rank 0 records each field as a
``control`` event (step, field, old, new, who) and the request as ``applied`` (or ``rejected``, with a warning
event) in controls.jsonl.

Where a value lives: the trainer's Config is the one place. Changing a field sets it there (and on the routers'
config where a pipeline stage holds a copy); the router reads its coefficients from it at every forward, the
schedule reads train.lr at every step, the trainer reads the intervals at every boundary. The few things built
from the config at setup are rebuilt: the per-expert learning-rate hook, the evaluator, the token recorder; a
new capacity_factor also restarts the factor in force (a router buffer).

Under train.compile, dynamo specialises on the first value of a float it reads (a coefficient) and recompiles
once, generalising it, at its first change (checked on CPU: 11 values of a coefficient, 2 graphs, right values);
turning a term on or off (0 <-> > 0) takes the other branch, compiled once.

Exact resumes: the changes in force at a checkpoint are saved in it (every rank's rank_state, "controls") and
set again before training continues, with the ids of every request decided inside it ("control_ids"); a request
applied at or after the checkpoint's step that is not inside it (one applied at a resume's or a fork's first
boundary, after the checkpoint it started from was saved) is replayed at the step its ``applied`` line names.
A fork (moelab.run.fork) starts from a copied checkpoint with its changes as requests due at its first boundary.

The end: as a run COMPLETES, after its last checkpoint and before its end event, rank 0 closes controls.jsonl
(under the file's lock): every request not decided by then is rejected (the run has no step left; the reason
says to fork), then a ``closed`` line; a request after it is refused (moelab.contract.controls.ControlsClosed).
A resume of the run opens the file again.

    controls = Controls(cfg, run_dir, par.moe_layers, rebuild=trainer.rebuild_from_config, rank0=True, writer=w)
    controls.restore(restored.rank_state, restored.step)
    flag = controls.poll(step)             # rank 0: 1.0 when a change is due after this step
    checkpoint_now = controls.apply(step)  # every rank, when the summed flag says so
    controls.close(step, "COMPLETED", checkpointed=True)  # rank 0, at the end
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from moelab.config import Config, ConfigError
from moelab.config.live import check_changes, get_dotted, set_dotted
from moelab.contract.controls import CHECKPOINT_NOW, ControlsFile, append_control, holding
from moelab.contract.events import ControlEvent, WarningEvent

# fields whose change needs the trainer to rebuild what it built from the config (Trainer.rebuild_from_config)
REBUILT = {"model.moe.expert_lr_power", "model.moe.expert_lr_max_scale", "train.eval_every",
           "train.expert_tokens_every"}


class Controls:
    """This rank's side of the live controls (see the module docstring). It is handed what it changes and
    writes: the live config `cfg` (the trainer's own object: a change is set in it), the run folder, this rank's
    MoE layers (their routers' copies of the config and capacity buffer), `rebuild` (called after a change of a
    REBUILT field: the trainer rebuilds what it built from the config), whether this is rank 0, and rank 0's
    MetricsWriter (None elsewhere).

        controls = Controls(cfg, run_dir, par.moe_layers, rebuild=trainer.rebuild_from_config, rank0=True,
                            writer=MetricsWriter(run_dir / "metrics.jsonl"))
        if controls.apply(step): trainer.save_checkpoint(step)
    """

    def __init__(self, cfg: Config, run_dir: "str | Path", moe_layers: list, rebuild: Callable[[], None],
                 rank0: bool, writer=None):
        self.cfg, self.run_dir, self.moe_layers = cfg, Path(run_dir), list(moe_layers)
        self.rebuild, self.rank0, self.writer = rebuild, rank0, writer
        self.in_force: list[dict] = []    # [{"id", "step", "changes"}] applied in this timeline (checkpointed)
        self.done: set[str] = set()       # request ids applied or rejected in this timeline
        self.replay: dict[str, int] = {}  # request id -> the step an earlier attempt applied it at
        self.start = 0                    # the step this attempt started from
        self.file = ControlsFile(self.run_dir)  # rank 0: controls.jsonl, read as it grows
        self.seen = 0                     # rank 0: the file's requests taken into `pending`
        self.damaged = 0                  # rank 0: the file's damaged lines reported
        self.pending: list[dict] = []     # rank 0: requests not yet decided, in file order
        self.due: list[dict] = []         # rank 0: the requests due at the coming boundary

    # ------------------------------------------------------------------ checkpoint state
    def rank_state(self) -> dict:
        """What a checkpoint keeps: the changes in force and the ids of every request decided in this
        timeline (applied, rejected, or a checkpoint asked for), exactly those inside the checkpoint."""
        if not self.done:
            return {}
        return {"controls": [dict(r) for r in self.in_force], "control_ids": sorted(self.done)}

    def restore(self, rank_state: dict, start_step: int) -> None:
        """Set the changes a checkpoint holds (no events: they were recorded when applied) and, on rank 0,
        schedule the replay of those applied that are not inside it, and open a closed controls file. Every
        rank takes rank 0's (a resume on more ranks: the new ranks' checkpoint holds no state of theirs)."""
        rank_state = self._broadcast({k: rank_state[k] for k in ("controls", "control_ids") if k in rank_state})
        for rec in rank_state.get("controls", []):
            self._set(rec["changes"], restoring=True)
            self.in_force.append(rec)
            self.done.add(rec["id"])
        self.done.update(rank_state.get("control_ids", ()))
        self.start = start_step
        if not self.rank0:
            return
        self._read()
        for rid, out in self.file.outcomes.items():
            if rid in self.done:
                continue
            if out["kind"] == "applied" and out.get("step", 0) >= start_step:
                self.replay[rid] = out["step"]  # applied after the checkpoint was saved, at its step or later
            else:
                self.done.add(rid)  # rejected, or (a checkpoint without control_ids) applied before it
        if self.file.closed:
            append_control(self.run_dir, {"kind": "opened", "step": start_step})

    # ------------------------------------------------------------------ the request path
    def _read(self, step: "int | None" = None) -> None:
        """Rank 0: what was appended to controls.jsonl since the last read; new requests become pending. With
        `step` (a poll's), lines cut by a crash mid-append are reported in the stream too (not while restoring:
        the stream's start event comes after)."""
        requests = self.file.read().requests
        if len(requests) < self.seen:  # the file was replaced: every request again
            self.seen, self.pending = 0, []
        self.pending += [r for r in requests[self.seen:] if r["id"] not in self.done]
        self.seen = len(requests)
        if self.writer and step is not None:
            for message in self.file.damaged[self.damaged:]:
                self.writer.emit(WarningEvent(step=step, kind="damaged_controls_line", message=message))
            self.damaged = len(self.file.damaged)

    def poll(self, step: int) -> float:
        """Rank 0: 1.0 when a request is due at the boundary after `step` (new, scheduled with `at` <= step,
        or replayed at this step); 0.0 on the other ranks (the all-reduce sums the flag)."""
        if not self.rank0:
            return 0.0
        self._read(step)
        self.pending = [r for r in self.pending if r["id"] not in self.done]
        self.due = [r for r in self.pending if self._when(r) <= step]
        return 1.0 if self.due else 0.0

    def _when(self, request: dict) -> int:
        rid = request["id"]
        return self.replay[rid] if rid in self.replay else int(request.get("at") or 0)

    def apply(self, step: int) -> bool:
        """Every rank (a collective): apply the changes rank 0 found due at the boundary after `step`; True
        when one of them asked for a checkpoint now."""
        batch = self._checked(step) if self.rank0 else None
        batch = self._broadcast(batch)
        checkpoint = False
        for item in batch:
            fields = {k: v for k, v in item["changes"].items() if k != CHECKPOINT_NOW}
            old = self._set(fields, restoring=False)
            checkpoint = checkpoint or CHECKPOINT_NOW in item["changes"]
            if fields:
                self.in_force.append({"id": item["id"], "step": step, "changes": fields})
            self.done.add(item["id"])
            if self.rank0 and not (self.replay.get(item["id"]) == step == self.start):
                self._record(step, item, old)  # (a replay at the start step: its events are kept by the rewind)
        return checkpoint

    def _checked(self, step: int) -> list[dict]:
        """Rank 0: the due requests checked against the live config, in order; a refused one is recorded."""
        batch, cfg = [], self.cfg
        for r in self.due:
            try:
                cfg, changes = check_changes(cfg, r["changes"])  # each against the config the ones before left
            except ConfigError as e:
                self.done.add(r["id"])
                append_control(self.run_dir, {"kind": "rejected", "id": r["id"], "step": step, "reason": str(e)})
                if self.writer:
                    self.writer.emit(WarningEvent(step=step, kind="control_rejected", message=str(e)))
                continue
            batch.append({"id": r["id"], "who": r.get("who", "?"), "changes": changes})
        self.due = []
        return batch

    def close(self, step: int, status: str, checkpointed: bool) -> None:
        """Rank 0, as the run ends `status` (COMPLETED) after `step`, before its end event: reject every request
        not decided yet and close controls.jsonl, in one hold of its lock (a later request is refused).
        `checkpointed`: a checkpoint of `step` was saved (the refusal names the fork to make from it)."""
        if not self.rank0:
            return
        fork = (f"`moelab fork {self.run_dir} --step {step} --set FIELD=VALUE`"
                if checkpointed else "`moelab fork` from a checkpoint")
        reason = (f"the run {status} after step {step} before this request's step boundary: no step is left to "
                  f"change; fork it with the change instead ({fork})")
        with holding(self.run_dir) as held:
            self._read()
            left = [r for r in self.pending if r["id"] not in self.done]
            held.append([{"kind": "rejected", "id": r["id"], "step": step, "reason": reason} for r in left]
                        + [{"kind": "closed", "step": step, "status": status}])
        self.done.update(r["id"] for r in left)
        self.pending = []
        if self.writer:
            for r in left:
                self.writer.emit(WarningEvent(step=step, kind="control_rejected",
                                              message=f"request {r['id']} ({', '.join(r['changes'])}): {reason}"))

    def _broadcast(self, batch):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return batch
        box = [batch]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _record(self, step: int, item: dict, old: dict) -> None:
        for key, new in item["changes"].items():
            if self.writer:
                self.writer.emit(ControlEvent(step=step, field=key, old=old.get(key), new=new, who=item["who"]))
        append_control(self.run_dir, {"kind": "applied", "id": item["id"], "step": step,
                                      "changes": {k: [old.get(k), v] for k, v in item["changes"].items()}})

    # ------------------------------------------------------------------ where the values live
    def _set(self, fields: dict, restoring: bool) -> dict:
        """Set `fields` in the trainer's config (and the routers' copies); returns the old values."""
        old = {}
        for key, value in fields.items():
            old[key] = get_dotted(self.cfg, key)
            set_dotted(self.cfg, key, value)
            if key.startswith("model.moe."):
                name = key.rsplit(".", 1)[1]
                for moe in self.moe_layers:  # a pipeline stage's copy of the model holds a copy of the config
                    if moe.router.cfg is not self.cfg.model.moe:
                        setattr(moe.router.cfg, name, value)
                    if name == "capacity_factor" and not restoring:  # a checkpoint restores the buffer itself
                        moe.router.capacity_factor.fill_(float(value))
        if REBUILT & set(fields):
            self.rebuild()
        return old


def drop_frozen_grads(moe_layers, cfg) -> None:
    """model.moe.freeze_router: the routers' gradients are dropped before clipping and the optimizer step, so
    AdamW leaves their weights (and moments) as they are."""
    if cfg.model.moe.freeze_router:
        for moe in moe_layers:
            for p in moe.router.parameters():
                p.grad = None
