"""A run's summary (summary.json and the `end` event), computed from its step records, and moelab's one
definition of routing balance (the dashboard, the comparison and the summary all use it).

    s = summarize(cfg, records, "COMPLETED")   # cfg: a moelab.config.Config (its name and train.steps)
    print(format_summary(s))                    # what `moelab status RUN` prints
    step_balance([[3, 1], [2, 2]])              # {"max_over_mean": 1.25, "cv": 0.25, "entropy": ...}
"""
from __future__ import annotations

import math

import numpy as np

from moelab.contract.events import MetricsError, StepEvent


def balance_M(counts_ME) -> dict:
    """Load-balance figures of each MoE layer from one step's tokens per expert (a [layers][experts] array):
    max/mean (the busiest expert over the mean load), cv (std / mean, population std), normalised entropy
    (1 = perfectly even) and dead (experts that got nothing); each a list over layers. A layer that routed
    nothing has max/mean, cv and entropy 0 and every expert dead."""
    c_ME = np.asarray(counts_ME, dtype=np.float64)
    if c_ME.ndim != 2 or c_ME.shape[1] == 0:
        n = c_ME.shape[-1] if c_ME.ndim == 2 else 0
        return {"max_over_mean": [0.0] * len(c_ME), "cv": [0.0] * len(c_ME), "entropy": [0.0] * len(c_ME),
                "dead": [n] * len(c_ME)}
    E = c_ME.shape[1]
    total_M = c_ME.sum(-1)
    ok_M = total_M > 0
    mean_M = np.where(ok_M, total_M / E, 1.0)
    p_ME = c_ME / np.where(ok_M, total_M, 1.0)[:, None]
    plogp_ME = np.where(p_ME > 0, p_ME * np.log(np.where(p_ME > 0, p_ME, 1.0)), 0.0)
    entropy_M = -plogp_ME.sum(-1) / math.log(E) if E > 1 else np.ones(len(c_ME))
    zero = lambda x_M: [float(v) if k else 0.0 for v, k in zip(x_M, ok_M)]
    return {"max_over_mean": zero(c_ME.max(-1) / mean_M), "cv": zero(c_ME.std(-1) / mean_M),
            "entropy": zero(entropy_M), "dead": [int(d) for d in (c_ME == 0).sum(-1)]}


def balance(counts: list[float]) -> dict:
    """balance_M of one layer: {max_over_mean, cv, entropy, dead}."""
    return {k: v[0] for k, v in balance_M([list(counts)]).items()} if len(counts) else \
        {"max_over_mean": 0.0, "cv": 0.0, "entropy": 0.0, "dead": 0}


# moelab's ONE definition of a run's balance (dashboard, summary, compare, docs/routing-lab.md): per step and MoE layer on
# the router's demand (routed_per_expert: before capacity drops), max/mean and cv as balance_M computes them,
# averaged over the layers of the step (step_balance), then over steps (mean_balance: the whole run, or the
# last N steps where a view says "last N steps").
BALANCE_KEYS = ("max_over_mean", "cv", "entropy")


def step_balance(counts_ME) -> "dict | None":
    """One step's balance: balance_M averaged over the MoE layers that routed tokens (None if none did)."""
    per_M = balance_M(counts_ME)
    routed = [i for i, c in enumerate(counts_ME) if sum(c) > 0]
    if not routed:
        return None
    return {k: sum(per_M[k][i] for i in routed) / len(routed) for k in BALANCE_KEYS}


def mean_balance(per_step: list) -> "dict | None":
    """The mean over steps of step_balance (or of one layer's balance) dicts; None entries are skipped."""
    steps = [b for b in per_step if b]
    if not steps:
        return None
    return {k: sum(b[k] for b in steps) / len(steps) for k in BALANCE_KEYS}


def demand_ME(step: StepEvent):
    """The router's demand of a step event ([MoE layer][expert]): routed_per_expert, or tokens_per_expert in
    older streams; [] without routing."""
    routing = step.routing
    return (routing.routed_per_expert_ME or routing.tokens_per_expert_ME or []) if routing is not None else []


def as_step(record: "StepEvent | dict") -> "StepEvent | None":
    """A step record as its StepEvent (the trainer's own records are; a dict is read as the stream's JSON);
    None when it cannot be one."""
    if isinstance(record, StepEvent):
        return record
    try:
        return StepEvent.from_json(record)
    except (MetricsError, TypeError):
        return None


def timed_steps(records: list) -> list:
    """The steps a run's throughput is averaged over: all but the first two (start-up and warm-up)."""
    return records[2:] if len(records) > 3 else records


def _well_formed(r: "StepEvent | None", layers: int) -> bool:
    """A step record with every field the summary reads, `layers` MoE layers of routing (a step event read
    back from a damaged stream may parse and still lack them)."""
    num = (int, float)
    if r is None:
        return False
    routing, memory = r.routing, r.memory
    return (isinstance(r.loss, num) and memory is not None
            and isinstance(memory.max_peak_allocated_gb, num) and routing is not None
            and isinstance(routing.tokens_per_expert_ME, list) and len(routing.tokens_per_expert_ME) == layers
            and all(isinstance(c, list) and all(isinstance(x, num) for x in c)
                    for c in routing.tokens_per_expert_ME)
            and isinstance(routing.dropped_tokens_M, list)
            and all(isinstance(x, num) for x in routing.dropped_tokens_M))


def summarize(cfg, records: "list[StepEvent | dict]", status: str, start_step: int = 0,
              evals: "list | None" = None) -> dict:
    """summary.json of the run `cfg` (a moelab.config.Config: its name and train.steps are read) from its step
    records. Throughput is averaged over timed_steps (all but the first two of this process); balance is
    mean_balance over every step, per MoE layer in routing_balance and over layers in `balance`. Records that
    lack a field the summary reads (read back from a damaged stream) are left out and counted in
    `unreadable_steps`. With `evals` (the ``eval`` events) also first_eval_loss, eval_loss and eval_perplexity
    (the last eval)."""
    steps = [as_step(r) for r in records]
    counts = [len(r.routing.tokens_per_expert_ME) for r in steps
              if r is not None and r.routing is not None and isinstance(r.routing.tokens_per_expert_ME, list)]
    layers = max(set(counts), key=counts.count) if counts else 0  # what nearly every record has
    usable = [r for r in steps if _well_formed(r, layers)]
    last = steps[-1].step if steps and steps[-1] is not None else (records[-1].get("step") if records else None)
    out: dict = {"name": cfg.name, "status": str(status), "steps": last if records else start_step,
                 "total_steps": cfg.train.steps, "start_step": start_step}
    if len(usable) < len(records):
        out["unreadable_steps"] = len(records) - len(usable)
    records = usable
    timed = timed_steps(records)
    if not records:
        return out
    mean = lambda key: sum(getattr(r, key) for r in timed if getattr(r, key) is not None) / max(
        sum(1 for r in timed if getattr(r, key) is not None), 1)
    per_step_M = [balance_M(demand_ME(r)) for r in records]
    totals = [[sum(c) for c in zip(*(demand_ME(r)[i] for r in records))] for i in range(layers)]
    routing_balance = [{"layer": i, **mean_balance([{k: b[k][i] for k in BALANCE_KEYS} for b in per_step_M]),
                        "dead": balance(totals[i])["dead"]} for i in range(layers)]
    out.update(
        first_loss=records[0].loss, final_loss=records[-1].loss,
        tokens_per_s=mean("tokens_per_s"), tokens_per_s_per_gpu=mean("tokens_per_s_per_gpu"),
        tflops_per_gpu=mean("tflops_per_gpu"), mfu=mean("mfu") if records[-1].mfu is not None else None,
        step_time_s=mean("step_time_s"),
        peak_memory_gb=max(r.memory.max_peak_allocated_gb for r in records),
        dropped_tokens=sum(sum(r.routing.dropped_tokens_M) for r in records),
        skipped_steps=sum(1 for r in records if r.skipped),
        routing_balance=routing_balance, balance=mean_balance([step_balance(demand_ME(r)) for r in records]))
    if evals:  # EvalEvents
        out.update(first_eval_loss=evals[0].loss, eval_loss=evals[-1].loss,
                   eval_perplexity=evals[-1].perplexity, eval_step=evals[-1].step)
    return out


def format_summary(s: dict, name: str | None = None, device: str | None = None) -> str:
    """Human-readable summary for the CLI. `name`: what the header calls the run (its folder's name; default the
    config's name); `device`: where it trained (the start event's "cpu", "cuda:0", ...): throughput is per GPU
    on GPUs, per rank elsewhere. tokens/s and TFLOPs are means over the attempt's steps."""
    name = name or s["name"]
    if "final_loss" not in s:
        return f"{name}: {s['status']} after {s['steps']} steps (no step recorded)"
    unit = "GPU" if str(device or "").startswith("cuda") else "rank"
    lines = [f"{name}: {s['status']} at step {s['steps']}/{s['total_steps']}",
             f"  loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}" + (
                 f"; eval loss {s['first_eval_loss']:.4f} -> {s['eval_loss']:.4f} (perplexity "
                 f"{s['eval_perplexity']:.2f})" if s.get("eval_loss") is not None else ""),
             f"  {s['tokens_per_s']:,.0f} tokens/s, mean over steps ({s['tokens_per_s_per_gpu']:,.0f} per {unit}), "
             f"{s['tflops_per_gpu']:.3f} TFLOPs per {unit}" + (f", MFU {100 * s['mfu']:.1f}%" if s.get("mfu") else ""),
             f"  peak memory {s['peak_memory_gb']:.2f} GB, dropped tokens {s['dropped_tokens']:.0f}"]
    if s["routing_balance"]:
        lines.append("  routing balance per MoE layer (max/mean load, coefficient of variation; mean over steps):")
        for b in s["routing_balance"]:
            lines.append(f"    layer {b['layer']}: max/mean {b['max_over_mean']:.2f}  cv {b['cv']:.2f}"
                         f"  dead experts {b['dead']}")
    return "\n".join(lines)
