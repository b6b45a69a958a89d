"""A run's summary (summary.json and the `end` event), computed from its step records."""
from __future__ import annotations

import math

from moelab.config import Config


def balance(counts: list[float]) -> dict:
    """Load-balance figures of one layer's tokens per expert: max/mean, coefficient of variation, normalised
    entropy (1 = perfectly even), and the number of experts that got nothing."""
    n = len(counts)
    total = sum(counts)
    if n == 0 or total <= 0:
        return {"max_over_mean": 0.0, "cv": 0.0, "entropy": 0.0, "dead": n}
    mean = total / n
    std = math.sqrt(sum((c - mean) ** 2 for c in counts) / n)
    shares = [c / total for c in counts if c > 0]
    entropy = -sum(s * math.log(s) for s in shares) / math.log(n) if n > 1 else 1.0
    return {"max_over_mean": max(counts) / mean, "cv": std / mean, "entropy": entropy,
            "dead": sum(1 for c in counts if c == 0)}


def summarize(cfg: Config, records: list[dict], status: str, start_step: int = 0,
              evals: list[dict] | None = None) -> dict:
    """Throughput is averaged over steps after the first two of this process (start-up and warm-up).
    With `evals` (the ``eval`` events) also first_eval_loss, eval_loss and eval_perplexity (the last eval)."""
    timed = records[2:] if len(records) > 3 else records
    out: dict = {"name": cfg.name, "status": status, "steps": records[-1]["step"] if records else start_step,
                 "total_steps": cfg.train.steps, "start_step": start_step}
    if not records:
        return out
    mean = lambda key: sum(r[key] for r in timed if r.get(key) is not None) / max(
        sum(1 for r in timed if r.get(key) is not None), 1)
    layers = len(records[-1]["routing"]["tokens_per_expert"])
    totals = [[sum(c) for c in zip(*(r["routing"]["tokens_per_expert"][i] for r in records))]
              for i in range(layers)]
    out.update(
        first_loss=records[0]["loss"], final_loss=records[-1]["loss"],
        tokens_per_s=mean("tokens_per_s"), tokens_per_s_per_gpu=mean("tokens_per_s_per_gpu"),
        tflops_per_gpu=mean("tflops_per_gpu"), mfu=mean("mfu") if records[-1].get("mfu") is not None else None,
        step_time_s=mean("step_time_s"),
        peak_memory_gb=max(r["memory"]["max_peak_allocated_gb"] for r in records),
        dropped_tokens=sum(sum(r["routing"]["dropped_tokens"]) for r in records),
        skipped_steps=sum(1 for r in records if r.get("skipped")),
        routing_balance=[{"layer": i, **balance(c)} for i, c in enumerate(totals)])
    if evals:
        out.update(first_eval_loss=evals[0]["loss"], eval_loss=evals[-1]["loss"],
                   eval_perplexity=evals[-1]["perplexity"], eval_step=evals[-1]["step"])
    return out


def format_summary(s: dict) -> str:
    """Human-readable summary for the CLI."""
    if "final_loss" not in s:
        return f"{s['name']}: {s['status']} after {s['steps']} steps (no step recorded)"
    lines = [f"{s['name']}: {s['status']} at step {s['steps']}/{s['total_steps']}",
             f"  loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}" + (
                 f"; eval loss {s['first_eval_loss']:.4f} -> {s['eval_loss']:.4f} (perplexity "
                 f"{s['eval_perplexity']:.2f})" if s.get("eval_loss") is not None else ""),
             f"  {s['tokens_per_s']:,.0f} tokens/s ({s['tokens_per_s_per_gpu']:,.0f} per GPU), "
             f"{s['tflops_per_gpu']:.3f} TFLOPs/GPU" + (f", MFU {100 * s['mfu']:.1f}%" if s.get("mfu") else ""),
             f"  peak memory {s['peak_memory_gb']:.2f} GB, dropped tokens {s['dropped_tokens']:.0f}"]
    if s["routing_balance"]:
        lines.append("  routing balance per MoE layer (max/mean load, coefficient of variation):")
        for b in s["routing_balance"]:
            lines.append(f"    layer {b['layer']}: max/mean {b['max_over_mean']:.2f}  cv {b['cv']:.2f}"
                         f"  dead experts {b['dead']}")
    return "\n".join(lines)
