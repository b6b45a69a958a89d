"""The measured tables of gallery/perf-notes.md and README's headline, rendered from gallery/results/*.json (no
figure typed by hand).

    python gallery/scripts/perf_tables.py --write     # replaces the text between the markers in both files

Current tables first: each system's current row on the Qwen3 proxy (moelab.gallery.current's rule: the newest
record of the fastest current configuration per system, workload, GPU, batch, micro batch and FP8 on or off;
moelab's only where it ran today's defaults), issue 31's targets computed from those records, the newest
profiles, and each gallery entry's newest record. Then the history: every record of the Qwen3 proxy on one GPU
with the reason it is not current, and the tables of earlier issues as they were measured.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from moelab.gallery import entry_result, load_entries, load_results
from moelab.gallery.current import (call_of, commit_of, configuration_of, current_records, fp8_of, stem,
                                    step_trials)
from moelab.gallery.records import by_router, fmt, record_settings, router_of

GALLERY = Path(__file__).resolve().parents[1]
R = GALLERY / "results"
W = "qwen3-moe-30b-a3b-proxy"
BEGIN, END = "<!-- tables: begin (gallery/scripts/perf_tables.py) -->", "<!-- tables: end -->"
README_BEGIN = "<!-- perf-highlights: begin (gallery/scripts/perf_tables.py) -->"
README_END = "<!-- perf-highlights: end -->"
# Issue 31's targets (one H200, the Qwen3 proxy, seq 4096, micro batch 2, peers in the same device call)
BF16_OVER_TORCHTITAN = 1.25  # moelab's defaults compiled / the faster compiled torchtitan, global batch 2 and 16
FP8_OVER_BF16 = 1.25  # train.fp8=rowwise / moelab's own bf16, global batch 16
LOSS_PARITY = 0.01  # FP8's final loss within 1% of bf16's
PEAK_GIB = 52.0  # peak memory at global batch 16, micro batch 2, backend.loss=chunked
ROUTER_NOTE = ("Router: the record's `router` field; \"(inferred)\" for a record older than the field, its kind then "
               "read from its fake_balanced_gate / fake_gate_noise fields, its `--set` overrides, its gallery entry "
               "or its preset's default (moelab.gallery.records.router_of; the history table says which).")


def _ctx(results: list | None = None):
    """(results, entries by name, current records) of the gallery, or of `results`."""
    results = load_results(GALLERY) if results is None else results
    entries = {e.name: e for e in load_entries(GALLERY)}
    return results, entries, current_records(results, entries)


def _date(r: dict) -> str:
    return str(r.get("date", ""))


def describe(r: dict) -> str:
    """A record's configuration in words, from its fields: system and version, compiled (how) or eager, experts
    implementation, FP8 recipe, and moelab's loss and optimizer kernel."""
    version = r.get("torchtitan_version") or r.get("transformers_version") or ""
    parts = [f"{r['system']} {version}".strip()]
    if r.get("experts_implementation"):
        parts.append(f"experts {r['experts_implementation']}")
    parts.append(f"compiled ({r['compile_mode']})" if r.get("compile") and r.get("compile_mode") else
                 "compiled" if r.get("compile") else "eager")
    if fp8_of(r) != "off":
        parts.append(f"FP8 {fp8_of(r)}" + (" (torchao)" if r["system"] == "torchtitan" else ""))
    if r["system"] == "moelab":
        ran = record_settings(r)
        parts += [f"loss {ran.get('loss', '?')}", ran.get("optimizer", "optimizer ?")]
        if r.get("experts") not in (None, "auto"):  # the experts backend the run took (auto's choice included)
            parts.append(f"experts {r['experts']}")
        if r.get("attention") not in (None, "auto", "sdpa"):  # the attention it took, where not SDPA (fa4: auto's)
            parts.append(f"attention {r['attention']}")
    return ", ".join(parts)


def _one_h200(r: dict, gbs=None, mbs=2) -> bool:
    return (r.get("workload") == W and r.get("gpus") == 1 and "H200" in str(r.get("gpu_name", ""))
            and r.get("seq_len") == 4096 and (gbs is None or r.get("global_batch_size") == gbs)
            and (mbs is None or r.get("micro_batch_size") == mbs))


def compiled_torchtitan(cur, gbs: int, mbs: int = 2) -> dict | None:
    """The faster compiled bf16 torchtitan among its current configurations (the peer to beat) at this batch."""
    rs = [r for slot, rs in cur.candidates.items() if slot[0] == "torchtitan" and not slot[7]
          for r in rs if r.get("compile") and _one_h200(r, gbs, mbs)]
    return max(rs, key=lambda r: r["tokens_per_s_per_gpu"]) if rs else None


def current_row(cur, system: str, gbs: int, mbs: int = 2, fp8: bool = False) -> dict | None:
    """The current row of `system` on the Qwen3 proxy on one H200 at this batch, micro batch and FP8 on/off."""
    rs = [r for slot, r in cur.best.items() if slot[0] == system and slot[7] == fp8 and _one_h200(r, gbs, mbs)]
    return max(rs, key=_date) if rs else None


def _vs_torchtitan(cur, r: dict) -> str:
    tt = compiled_torchtitan(cur, r["global_batch_size"], r["micro_batch_size"])
    return f"{r['tokens_per_s_per_gpu'] / tt['tokens_per_s_per_gpu']:.2f}x" if tt else "-"


# ---------------------------------------------------------------------- current
def current_table(cur) -> list[str]:
    """Every current row of the Qwen3 proxy on one GPU, by global batch, micro batch, FP8 and speed."""
    rows = sorted((r for r in cur.best.values() if _one_h200(r, mbs=None)),
                  key=lambda r: (r["global_batch_size"], r["micro_batch_size"], fp8_of(r) != "off",
                                 r["tokens_per_s_per_gpu"]))
    out = ["### Current rows: each system at its best, Qwen3-30B-A3B layer proxy, one H200, seq 4096", "",
           "Rule (moelab.gallery.current): per system, global batch, micro batch and FP8 on or off, the newest "
           "record of each configuration counts and the fastest configuration is the row; failed runs, runs before "
           "a fix, superseded records and fake routers are left out, and moelab's records count only where they "
           "ran today's defaults (`train.compile`, bf16 parameters, the loss and optimizer that `backend.loss=auto` "
           "and `train.optimizer=auto` resolve to). Every other record is in the history below with its reason. "
           + ROUTER_NOTE, "",
           "| system and configuration | global batch | micro batch | router | tokens/s/GPU | TFLOPs/GPU | step ms "
           "| peak GiB | vs compiled torchtitan | call | commit | result file |",
           "|---|---:|---:|---|---:|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        out.append(f"| {describe(r)} | {r['global_batch_size']} | {r['micro_batch_size']} | {router_of(r)} | "
                   f"{fmt(r['tokens_per_s_per_gpu'])} | {fmt(r.get('tflops_per_gpu'), 1)} | "
                   f"{fmt(r.get('step_time_ms'), 1)} | {fmt(r.get('peak_memory_gb'), 1)} | {_vs_torchtitan(cur, r)} | "
                   f"{call_of(r)} | {commit_of(r)} | `{r['_file']}` |")
    return out


def _target(what: str, records: list, figure: str, met) -> str:
    calls = sorted({call_of(r) for r in records})
    names = " / ".join(f"`{stem(r)}`" for r in records) or "-"
    if calls:
        names += (f" (device call {calls[0]})" if len(calls) == 1 else
                  f" (device calls {', '.join(calls)}: not one call)")
    return f"| {what} | {names} | {figure} | {'not measured' if met is None else 'yes' if met else 'no'} |"


def _fp8_pair(results: list, cur) -> tuple:
    """The newest FP8 (rowwise) record of moelab at global batch 16 that is current, else that differs from
    today's defaults in its loss alone, and the newest bf16 record of the same commit and configuration."""
    ok = [r for r in results if r.get("system") == "moelab" and _one_h200(r, 16) and cur.usable(r)
          and set(cur.deviations(r)) <= {"loss"}]
    fp8 = [r for r in ok if fp8_of(r) == "rowwise"]
    if not fp8:
        return None, None
    f = max(fp8, key=lambda r: (not cur.deviations(r), _date(r)))
    want = configuration_of({**f, "fp8": "off"})
    bf16 = [r for r in ok if fp8_of(r) == "off" and commit_of(r) == commit_of(f) and configuration_of(r) == want]
    return f, (max(bf16, key=_date) if bf16 else None)


def _parity_pair(results: list) -> tuple:
    """The newest commit's bf16 and FP8 loss-parity records (gpu_perf.py parity)."""
    runs: dict = {}
    for r in results:
        if str(r.get("variant", "")).startswith("parity-fp8-") and r.get("final_loss_mean20") is not None:
            runs.setdefault(commit_of(r), {})[fp8_of(r)] = r
    both = [v for v in runs.values() if "off" in v and "rowwise" in v]
    if not both:
        return None, None
    v = max(both, key=lambda v: _date(v["rowwise"]))
    return v["off"], v["rowwise"]


def targets(results: list, cur) -> list[str]:
    """Issue 31's targets, each computed from the records it names (no figure typed)."""
    out = ["| target (issue 31) | records | figure | met |", "|---|---|---:|---|"]
    for gbs in (2, 16):
        what = (f"bf16, global batch {gbs}: moelab (today's defaults, compiled) / the faster compiled torchtitan "
                f">= {BF16_OVER_TORCHTITAN}x")
        a, b = current_row(cur, "moelab", gbs), compiled_torchtitan(cur, gbs)
        if a is None or b is None:
            out.append(_target(what, [x for x in (a, b) if x], "-", None))
            continue
        x = a["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"]
        out.append(_target(what, [a, b], f"{x:.2f}x", x >= BF16_OVER_TORCHTITAN))
    f, b = _fp8_pair(results, cur)
    what = (f"FP8 (`train.fp8=rowwise`), global batch 16: moelab FP8 / moelab bf16 of the same call and settings "
            f">= {FP8_OVER_BF16}x")
    if f is not None and cur.deviations(f):
        what += (f" (both ran loss {record_settings(f).get('loss')}: no FP8 record with today's default loss "
                 "yet)")
    if f is None or b is None:
        out.append(_target(what, [x for x in (f, b) if x], "-", None))
    else:
        x = f["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"]
        out.append(_target(what, [f, b], f"{x:.2f}x", x >= FP8_OVER_BF16))
    off, fp8 = _parity_pair(results)
    what = f"FP8 loss parity: final loss (mean of the last 20 steps) within {100 * LOSS_PARITY:.0f}% of bf16"
    if off is None:
        out.append(_target(what, [], "-", None))
    else:
        d = abs(fp8["final_loss_mean20"] - off["final_loss_mean20"]) / off["final_loss_mean20"]
        out.append(_target(what + f" ({len(fp8.get('losses') or [])} steps)", [fp8, off],
                           f"{fp8['final_loss_mean20']:.4f} vs {off['final_loss_mean20']:.4f}: {100 * d:.2f}%",
                           d <= LOSS_PARITY))
    chunked = [r for r in results if r.get("system") == "moelab" and _one_h200(r, 16) and fp8_of(r) == "off"
               and cur.usable(r) and record_settings(r).get("loss") == "chunked"
               and set(cur.deviations(r)) <= {"loss"} and r.get("peak_memory_gb")]
    what = f"peak memory, global batch 16, micro batch 2, `backend.loss=chunked`, bf16 <= {PEAK_GIB:.0f} GiB"
    if not chunked:
        out.append(_target(what, [], "-", None))
    else:
        r = max(chunked, key=_date)
        out.append(_target(what, [r], f"{r['peak_memory_gb']:.1f} GiB", r["peak_memory_gb"] <= PEAK_GIB))
    return out


def stalled(p: dict) -> bool:
    """A profile whose step held one gap of over a tenth of the step: a host stall under the profiler that the timed
    steps did not have (call 31's global-batch-16 profile: 342 ms inside one compiled graph's call, its timed steps
    780-783 ms). Such a profile stays a record, not the tables' picture of a step."""
    largest = (p.get("idle_gaps") or {}).get("largest") or [{"ms": 0.0}]
    return largest[0]["ms"] > 0.1 * p["step_ms"]


def profiles(results: list) -> list[str]:
    """The newest compiled-step profile (gpu_perf.py bench --profile) of each FP8 mode, of a step that ran as today's
    in the one-GPU step's trials (moelab.gallery.current.step_trials), not stalled."""
    newest: dict = {}
    for r in results:
        if r.get("workload") == W and isinstance(r.get("by_category_ms"), dict) and not step_trials(r) \
                and not stalled(r):
            if fp8_of(r) not in newest or _date(r) > _date(newest[fp8_of(r)]):
                newest[fp8_of(r)] = r
    out = []
    for mode, p in sorted(newest.items()):
        out += ["", f"Profile of moelab's compiled step, `train.fp8={mode}`, global batch {p['global_batch_size']} "
                f"(`{stem(p)}`, commit {commit_of(p)}, {p.get('gpu_name', 'GPU ?')}, {describe(p)}): step "
                f"{p['step_ms']:.1f} ms, kernels "
                f"{p['gpu_busy_ms']:.1f} ms, idle {p['idle_ms']:.1f} ms", "", "| category | ms |", "|---|---:|"]
        out += [f"| {k} | {v:.1f} |" for k, v in p["by_category_ms"].items()]
    return out


# Named parts of a profiled step, found by kernel name among its top kernels (pattern, what it is)
STEP_PARTS = (("CUDAFunctor_add<c10::BFloat16>", "gradient accumulation: .grad += each micro batch's bf16 gradient"),
              ("log_softmax|nll_loss|logsumexp|cross_entropy", "the loss's own kernels (log-softmax forward and backward)"),
              ("adamw_kernel|LpNorm", "optimizer step and gradient norm (once per step)"),
              ("abs_amax", "FP8 quantisation passes (amax, scale, cast: alone or fused into their producer)"))


def micro_batch_breakdown(results: list) -> list[str]:
    """Where one micro batch goes: the newest multi-micro-batch profile of each FP8 mode (not stalled), its
    categories and named parts (STEP_PARTS, from its top kernels) divided by its micro batches."""
    newest: dict = {}
    for r in results:
        if r.get("workload") == W and isinstance(r.get("by_category_ms"), dict) and not stalled(r) and \
                r.get("global_batch_size", 0) > r.get("micro_batch_size", 1):
            if fp8_of(r) not in newest or _date(r) > _date(newest[fp8_of(r)]):
                newest[fp8_of(r)] = r
    if not newest:
        return []
    modes = sorted(newest)
    n = {m: newest[m]["global_batch_size"] // newest[m]["micro_batch_size"] for m in modes}
    out = ["", "### Where a micro batch goes (ms per micro batch: a profiled step divided by its micro batches)", "",
           "Profiles: " + "; ".join(f"`train.fp8={m}`: `{stem(newest[m])}` ({n[m]} micro batches, "
                                    f"{newest[m].get('gpu_name', 'GPU ?')})" for m in modes)
           + ". Named parts are sums of the step's top kernels by name (gallery/scripts/perf_tables.py STEP_PARTS);"
           " they overlap the categories.", "",
           "| part | " + " | ".join(f"fp8={m}" for m in modes) + " |", "|---|" + "---:|" * len(modes)]
    rows = {k: {m: newest[m]["by_category_ms"].get(k, 0.0) / n[m] for m in modes}
            for k in sorted({k for m in modes for k in newest[m]["by_category_ms"]})}
    rows["idle"] = {m: newest[m]["idle_ms"] / n[m] for m in modes}
    rows["step"] = {m: newest[m]["step_ms"] / n[m] for m in modes}
    for pattern, label in STEP_PARTS:
        rows[label] = {m: sum(k["ms"] for k in newest[m]["top_kernels"] if re.search(pattern, k["name"])) / n[m]
                       for m in modes}
    out += [f"| {k} | " + " | ".join(f"{v[m]:.1f}" for m in modes) + " |" for k, v in rows.items()]
    return out


def gallery_entries(results: list) -> list[str]:
    """Each gallery entry's newest record (moelab.gallery.entry_result: what gallery/README.md shows)."""
    out = ["", "### Gallery entries: each entry's newest record (`moelab gallery run ENTRY` or `moelab bench` of "
           "its preset with its settings; gallery/README.md shows the same)", "",
           "| entry | GPUs | global batch | compile | router | tokens/s/GPU | TFLOPs/GPU | learned router "
           "tokens/s/GPU | peak GiB | commit | call | result file |",
           "|---|---:|---:|---|---|---:|---:|---:|---:|---|---|---|"]
    for e in load_entries(GALLERY):
        r = entry_result(results, e)
        if r is None or not r.get("tokens_per_s_per_gpu"):
            continue
        rr = by_router(r).get("learned", {}).get("tokens_per_s_per_gpu")
        out.append(f"| {e.name} | {r['gpus']} | {r.get('global_batch_size', '-')} | {r.get('compile', '-')} | "
                   f"{router_of(r)} | {fmt(r['tokens_per_s_per_gpu'])} | {fmt(r.get('tflops_per_gpu'), 1)} | "
                   f"{fmt(rr)} | {fmt(r.get('peak_memory_gb'), 1)} | {commit_of(r)} | {call_of(r)} | "
                   f"`{r['_file']}` |")
    return out


# ---------------------------------------------------------------------- history
def history_table(results: list, entries: dict, cur) -> list[str]:
    """Every record of the Qwen3 proxy on one GPU, oldest first, with the reason each is not current."""
    rows = sorted((r for r in results if r.get("workload") == W and r.get("gpus") == 1
                   and (r.get("tokens_per_s_per_gpu") or "error" in r)), key=lambda r: (_date(r), r["_file"]))
    out = ["", "## History (every record, current or not)", "",
           "### History: every throughput record of the Qwen3-30B-A3B layer proxy on one GPU", "",
           "All records, oldest first; the last column says whether the record is a current row above and, if "
           "not, why (moelab.gallery.current). Compare variants within one call: calls 1-2 ran before the fixes "
           "of \"Changes\" items 3-4.", "",
           "| date | call | commit | system | variant | global batch | micro batch | configuration | router | "
           "tokens/s/GPU | TFLOPs/GPU | step ms | peak GiB | current? | result file |",
           "|---|---|---|---|---|---:|---:|---|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        status = cur.status(r) or "current row"
        out.append(f"| {_date(r)[:16]} | {call_of(r)} | {commit_of(r)} | {r['system']} | "
                   f"{str(r.get('variant', '-'))[:70]} | {r.get('global_batch_size', '-')} | "
                   f"{r.get('micro_batch_size', '-')} | {describe(r)} | {router_of(r, entries).how} | "
                   f"{fmt(r.get('tokens_per_s_per_gpu'))} | {fmt(r.get('tflops_per_gpu'), 1)} | "
                   f"{fmt(r.get('step_time_ms'), 1)} | {fmt(r.get('peak_memory_gb'), 1)} | {status} | "
                   f"`{r['_file']}` |")
    return out


def _load(name: str) -> dict:
    return json.loads((R / f"{name}.json").read_text())


HEAD = ("| system / variant | global batch | router | tokens/s/GPU | TFLOPs/GPU | step ms | peak GiB | call | "
        "result file |\n|---|---:|---|---:|---:|---:|---:|---|---|")


def _row(name: str, label: str) -> str:
    r = _load(name)
    return (f"| {label} | {r['global_batch_size']} | {router_of(r)} | {r['tokens_per_s_per_gpu']:,.0f} | "
            f"{r['tflops_per_gpu']:.1f} | {r['step_time_ms']:.1f} | {r['peak_memory_gb']:.1f} | "
            f"{r['device_call'].split(' ')[0]} | `{name}.json` |")


def earlier_issues() -> list[str]:
    """The tables of issues 7, 10 and 11 as they were measured (the records they name are history)."""
    out = ["", "### History: targets of issues 7 and 11 (against EAGER torchtitan, fp32-era defaults)", "",
           "| target | measured | ratio | met |", "|---|---|---:|---|"]

    def ratio(a, b, target, what):
        x = _load(a)["tokens_per_s_per_gpu"] / _load(b)["tokens_per_s_per_gpu"]
        out.append(f"| {what} >= {target}x | `{a}` / `{b}` | {x:.2f} | {'yes' if x >= target else 'no'} |")

    for gbs in (2, 16):
        ratio(f"{W}--moelab--real-router-gbs{gbs}-compile", f"{W}--hf-transformers--grouped_mm-gbs{gbs}", 1.5,
              f"learned router, global batch {gbs}: moelab / HF")
        ratio(f"{W}--moelab--real-router-gbs{gbs}-compile", f"{W}--torchtitan--gbs{gbs}", 1.1,
              f"learned router, global batch {gbs}: moelab / eager torchtitan")
        ratio(f"{W}--moelab--fake-gate-gbs{gbs}-compile", f"{W}--hf-transformers--grouped_mm-gbs{gbs}", 1.5,
              f"fake gate, global batch {gbs}: moelab / HF")
    for name in (f"{W}--moelab--fake-gate-gbs2-compile", f"{W}--moelab--real-router-gbs16-compile",
                 f"{W}--moelab--fake-gate-gbs16-compile"):
        t = _load(name)["tflops_per_gpu"]
        out.append(f"| TFLOPs/GPU >= 350 | `{name}` | {t:.1f} | {'yes' if t >= 350 else 'no'} |")
    ep, one = _load(f"{W}-ep2--moelab"), _load(f"{W}-1gpu--moelab--eager-fake-gate")
    for key, what in (("fake_balanced", "fake gate"), ("learned", "learned router")):
        a, b = by_router(ep)[key]["tokens_per_s_per_gpu"], by_router(one)[key]["tokens_per_s_per_gpu"]
        out.append(f"| EP=2 per-GPU >= 0.9 x one GPU ({what}, no compile, global batch 2 per GPU) | "
                   f"`{W}-ep2--moelab` / `{W}-1gpu--moelab` | {a / b:.2f} | {'yes' if a / b >= 0.9 else 'no'} |")
    for name, key in ((f"{W}--moelab--real-router-gbs2-compile", f"{W}--moelab--real-router-gbs2-compile-no-metrics"),
                      (f"{W}--moelab--real-router-gbs2", f"{W}--moelab--real-router-gbs2-no-metrics")):
        on, off = _load(name)["step_time_ms"], _load(key)["step_time_ms"]
        out.append(f"| metrics cost < 1% of the step | `{name}` vs `{key}` | {100 * (on - off) / on:+.2f}% | "
                   f"{'yes' if (on - off) / on < 0.01 else 'no'} |")

    out += ["", "### History: fast-path variants of the first session (same model, same call unless the call "
            "column says otherwise)", "", HEAD]
    for v, label in [("fake-gate-gbs2", "eager, bf16 params"),
                     ("fake-gate-gbs2-grouped_gemm", "+ backend.experts=grouped_gemm (cuBLAS loop build)"),
                     ("real-router-gbs2-grouped_gemm", "learned router + grouped_gemm"),
                     ("fake-gate-gbs2-fast-permute", "RowGather permutation (sort-free backward)"),
                     ("fake-gate-gbs2-cudnn-sdpa", "cuDNN attention forced first"),
                     ("fake-gate-gbs2-compile-eager-loss", "torch.compile per block, loss eager"),
                     ("fake-gate-gbs2-compile", "torch.compile per block + compiled loss")]:
        out.append(_row(f"{W}--moelab--{v}", label))

    out += ["", "### History: layouts on two H200s against one (issue 10), per-GPU throughput", "",
            "| layout | result file | router | tokens/s/GPU | one-GPU baseline | router | tokens/s | ratio | "
            "peak GiB (2 GPUs / 1) | call |", "|---|---|---|---:|---|---|---:|---:|---|---|"]
    for label, two, one in [
        ("EP=2 x FSDP=2, eager", f"{W}-ep2--moelab", f"{W}-1gpu--moelab--eager-fake-gate"),
        ("EP=2 x FSDP=2, compile", f"{W}--moelab--ep2-compile", f"{W}--moelab--1gpu-compile"),
        ("PP=2, 1F1B, 4 micro batches (global batch 8 against 2)", f"{W}-pp2--moelab", f"{W}-1gpu--moelab--eager-fake-gate"),
        ("CP=2 (FSDP over the CP ranks), seq 8192", f"{W}-cp2--moelab", f"{W}-1gpu-seq8192--moelab"),
        ("CP=2 x EP=2, seq 8192", f"{W}-cp2-ep2--moelab", f"{W}-1gpu-seq8192--moelab")]:
        a, b = _load(two), _load(one)
        calls = sorted({a["device_call"].split(" ")[0], b["device_call"].split(" ")[0]})
        out.append(f"| {label} | `{two}.json` | {router_of(a)} | {a['tokens_per_s_per_gpu']:,.0f} | `{one}.json` | "
                   f"{router_of(b)} | {b['tokens_per_s_per_gpu']:,.0f} | {a['tokens_per_s_per_gpu'] / b['tokens_per_s_per_gpu']:.2f} | "
                   f"{a['peak_memory_gb']:.1f} / {b['peak_memory_gb']:.1f} | {', '.join(calls)} |")
    return out


def checks() -> list[str]:
    """The kernel and two-GPU equivalence checks."""
    k = _load("backends-experts-kernels")
    out = ["", f"### Experts kernels, forward + backward, {k['shape']} (`backends-experts-kernels.json`)", "",
           "| kernel | matches fp32 reference (3 random draws) | max rel. error | balanced ms | TFLOP/s | "
           "skewed (Dirichlet 2) ms | TFLOP/s |", "|---|---|---:|---:|---:|---:|---:|"]
    for name, v in k["kernels"].items():
        err = max(max(x for key, x in c.items() if key != "ok") for c in v["check"])
        out.append(f"| {name} | {v['correct']} | {err:.1e} | {v['balanced']['ms']:.2f} | {v['balanced']['tflops']:.0f} "
                   f"| {v['skewed_dirichlet2']['ms']:.2f} | {v['skewed_dirichlet2']['tflops']:.0f} |")
    c = _load("check-two-gpu-equivalence-tiny")
    out += ["", f"### Two-GPU equivalence, tiny preset, 20 steps (`check-two-gpu-equivalence-tiny.json`, call "
            f"{c['device_call'].split(' ')[0]}, commit {c['commit'][:7]})", "",
            "| dtype | layout | max relative loss difference vs one GPU | tolerance | passed |",
            "|---|---|---:|---:|---|"]
    for x in c["comparisons"]:
        out.append(f"| {x['dtype']} | {x['layout']} | {x['max_rel_loss_diff']:.1e} | {x['tolerance']:.0e} | "
                   f"{x['passed']} |")
    return out


def fp8_trials() -> list[str]:
    """Issue 31's FP8 trials: the recipes at the experts' GEMMs (gpu_fp8_blockwise.py) and the expert weight
    cache's tiled kernel (gpu_perf_fp8check.py)."""
    t = _load("qwen3-moe-30b-a3b-proxy--moelab--fp8-blockwise-trial")
    sh, g = t["shapes"], t["grouped"]["zipf"]
    out = ["", f"### FP8 recipes at the experts' GEMMs, one MoE layer and micro batch (`{t['workload']}--moelab--"
           f"fp8-blockwise-trial.json`, {t['device_call']}, {t['device']}, torch {t['torch_version']})", "",
           f"{sh['routed_rows']} routed rows over {sh['experts']} experts (Zipf-like split: "
           f"{g['counts']['min']} to {g['counts']['max']} rows), hidden {sh['hidden']}, expert FFN "
           f"{sh['expert_ffn']}; ms per GEMM (median of {sh['reps']}); dense: the same GEMM on the concatenated rows "
           "with one expert's weight (the rate a grouped kernel could reach at best).", "",
           "| GEMM | bf16 grouped | rowwise grouped | blockwise grouped, torch | blockwise grouped, Triton | "
           "dense bf16 | dense rowwise | dense blockwise (cuBLAS) |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    ms = lambda d, k: f"{d[k]['ms']:.3f}" if isinstance(d.get(k), dict) and "ms" in d[k] else "-"  # noqa: E731
    for name in ("gate_up.fwd", "gate_up.dgrad", "gate_up.wgrad", "down.fwd", "down.dgrad", "down.wgrad"):
        v, d = g.get(name, {}), t["dense"].get(name, {})
        refusal = (v.get("F.scaled_grouped_mm blockwise") or {}).get("error", "ran")
        out.append(f"| {name} | {ms(v, 'bf16')} | {ms(v, 'rowwise')} | {refusal if 'rowwise' in v else '-'} | "
                   f"{ms(v, 'triton blockwise')} | {ms(d, 'bf16')} | {ms(d, 'rowwise')} | {ms(d, 'blockwise')} |")
    pr = t["projection"]
    out += ["", f"Projected per micro batch ({pr['layers']} layers; weights quantised once per step of "
            f"{pr['micro_batches_per_step']} micro batches), Zipf-like split:", "",
            "| recipe | expert GEMMs ms | activation quantisation ms | weight quantisation ms | total ms | "
            "saving vs bf16 ms |", "|---|---:|---:|---:|---:|---:|"]
    L = pr["layers"]
    for name, v in pr["zipf"].items():
        out.append(f"| {name} | {L * v['gemm_ms']:.1f} | {L * v['quant_activation_ms']:.1f} | "
                   f"{L * v['quant_weight_ms_amortised']:.1f} | {v['per_micro_batch_ms']:.1f} | "
                   f"{v['saving_vs_bf16_per_micro_batch_ms']:.1f} |")
    c = _load("qwen3-moe-30b-a3b-proxy--moelab--fp8-kernel-check")
    out += ["", f"### The FP8 expert weight cache's operands: tiled kernel against inductor's passes "
            f"(`{c['workload']}--moelab--fp8-kernel-check.json`, {c['device_call']}, commit {c['commit'][:7]})", "",
            "| weight | both operands, inductor ms | forward operand, kernel ms | dgrad operand, kernel ms | "
            "differing bytes, kernel vs inductor / vs CUDA's eager cast (forward; dgrad) |", "|---|---:|---:|---:|---|"]
    key = "differing bytes (kernel vs inductor, kernel vs eager, inductor vs eager)"
    for name, v in c["weight_cache"].items():
        if isinstance(v, dict):
            bytes_ = "; ".join(f"{v[f'{o} {key}'][0]} / {v[f'{o} {key}'][1]}" for o in ("forward", "dgrad"))
            out.append(f"| {name} ({v['elements']:,} elements) | {v['both operands ms, inductor']:.2f} | "
                       f"{v['forward operand ms, tiled kernel']:.2f} | {v['dgrad operand ms, tiled kernel']:.2f} | "
                       f"{bytes_} |")
    return out


def rows_check() -> list[str]:
    """gpu_check_rows.py's record: the sums over each token's K rows, the form before sum_rows and with it."""
    c = _load("qwen3-moe-30b-a3b-proxy--moelab--check-rows")
    sh = c["shapes"]
    out = ["", f"### The MoE layer's sums over K, compiled (`{c['workload']}--moelab--check-rows.json`, "
           f"{c['device_call']}, T {sh['tokens']}, K {sh['top_k']}, D {sh['hidden']}): 'now' is that commit's "
           "rows.py, the combine inside one autograd.Function with sum_rows (its compiled gradient: zeros; the "
           "combine went back to the 'before' form after this call, the dispatch kept sum_rows)", "",
           "| form | combine forward ms (GB/s) | combine fwd+bwd ms | combine gradient = gather (differing elements) | "
           "dispatch fwd+bwd ms | dispatch gradient rel. to float64 |", "|---|---:|---:|---|---:|---:|"]
    for name, r in c["results"].items():
        out.append(f"| {name} | {r['combine_forward_ms']:.3f} ({r['combine_forward_gb_s']:.0f}) | "
                   f"{r['combine_fwd_bwd_ms']:.3f} | {r['combine_grad_equals_gather']} "
                   f"({r['combine_grad']['differing']:,}) | {r['dispatch_fwd_bwd_ms']:.3f} | "
                   f"{r['dispatch_grad_rel_vs_float64']:.2e} |")
    return out


def moe_layer() -> list[str]:
    """gpu_moe_layer.py's records (issue 41): one MoE layer's experts forward + backward, per variant."""
    out = []
    for name in sorted(p.stem for p in R.glob("*--moelab--moe-layer*.json")):
        c = _load(name)
        sh = c["shapes"]
        out += ["", f"### One MoE layer's experts, forward + backward (`{name}.json`, {c['device_call']}; T "
                f"{sh['tokens']}, top-{sh['top_k']} of {sh['experts']}, D {sh['hidden']}, F {sh['expert_ffn']}, "
                f"bf16)" + (f": {c['note']}" if c.get("note") else ""), "",
                "| routing | variant | ms | TFLOP/s | vs today's compiled | saved activations MiB (vs today) | "
                "largest rel. error vs fp32 (y and all gradients) |", "|---|---|---:|---:|---:|---:|---:|"]
        for kind, res in c["results"].items():
            for v, r in res.items():
                if isinstance(r, dict) and "fwd_bwd_ms" in r:
                    out.append(f"| {kind} | {v} | {r['fwd_bwd_ms']:.3f} | {r['tflops']:.0f} | "
                               f"{r['speedup_vs_today']:.2f}x | {r['saved_bytes_hooks_activations'] / 2**20:.0f} "
                               f"({r['saved_activations_vs_today']:.2f}) | {max(r['rel_err_vs_fp32'].values()):.2e} |")
        for what, err in c.get("errors", {}).items():
            out.append(f"\n{what}: {err.strip().splitlines()[-1][:200]}")
    return out


# ---------------------------------------------------------------------- the two documents
def tables(results: list | None = None) -> str:
    """perf-notes.md's text between the markers."""
    results, entries, cur = _ctx(results)
    out = current_table(cur) + ["", "### Issue 31's targets, from the records above", ""] + targets(results, cur)
    out += profiles(results) + micro_batch_breakdown(results) + gallery_entries(results)
    out += history_table(results, entries, cur) + earlier_issues() + checks() + fp8_trials() + rows_check()
    out += moe_layer()
    return "\n".join(out)


def readme_highlights(results: list | None = None) -> str:
    """README's headline: each system's current row at micro batch 2 (the peers' shapes), with its ratio to the
    faster compiled torchtitan at the same global batch, then issue 31's targets."""
    results, _, cur = _ctx(results)
    out = ["| system (one H200, Qwen3-30B-A3B proxy, seq 4096, micro batch 2; current rows) | global batch | "
           "router | tokens/s/GPU | TFLOPs/GPU | vs compiled torchtitan | call |", "|---|---:|---|---:|---:|---:|---|"]
    rows = sorted((r for r in cur.best.values() if _one_h200(r)),
                  key=lambda r: (r["global_batch_size"], fp8_of(r) != "off", r["tokens_per_s_per_gpu"]))
    for r in rows:
        out.append(f"| {describe(r)} | {r['global_batch_size']} | {router_of(r)} | {fmt(r['tokens_per_s_per_gpu'])} | "
                   f"{fmt(r.get('tflops_per_gpu'))} | {_vs_torchtitan(cur, r)} | {call_of(r)} |")
    return "\n".join(out + [""] + targets(results, cur))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    results = load_results(GALLERY)
    text = tables(results)
    if not args.write:
        print(text)
        return
    for p, begin, end, body in ((GALLERY / "perf-notes.md", BEGIN, END, text),
                                (GALLERY.parent / "README.md", README_BEGIN, README_END, readme_highlights(results))):
        s = p.read_text()
        a, b = s.index(begin) + len(begin), s.index(end)
        p.write_text(s[:a] + "\n" + body + "\n" + s[b:])


if __name__ == "__main__":
    main()
