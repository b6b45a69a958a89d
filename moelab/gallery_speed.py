"""The gallery's speed tables: the step-time model (moelab.planner.speed) against every 1- and 2-GPU moelab record
in gallery/results/ and against the reference table's published rows, rendered into gallery/README.md by
``moelab gallery report`` (moelab.gallery.render_report calls speed_section).

    lines = speed_section(load_entries(), load_results(), _planned_for_result, _REBUILD_KEYS)   # markdown
"""
from __future__ import annotations

MEASURED_TARGET = 0.10  # predicted within 10% of a 1- or 2-GPU record
PUBLISHED_TARGET = 0.20  # within 20% of a published row
_ONE_GPU_LAYOUT = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "vp": 1, "fsdp": 1}
# records the model's rates are calibrated on (moelab.planner.speed.H200_MEASURED, EAGER_FACTOR): not independent
CALIBRATION_RECORDS = ("qwen3-moe-30b-a3b-proxy--moelab--profile-bf16-compile-gbs2.json",
                       "qwen3-moe-30b-a3b-proxy--moelab--fake-gate-gbs2.json",
                       "qwen3-moe-30b-a3b-proxy--moelab--fake-gate-gbs2-compile.json")
_COMM = ("all_to_all", "fsdp", "cp", "pipeline_send", "bubble")


_OVERCOUNTED = {  # what the model charges that a faster run may not pay, by term
    "all_to_all": "no overlap and one row per routed expert assumed (DeepEP dispatches once per node and overlaps)",
    "fsdp": ("moelab overlaps none of FSDP's collectives and, without pp, gathers every block twice and "
             "reduce-scatters at every micro batch; a run that overlaps them, keeps weights gathered or syncs "
             "gradients once per step pays far less"),
    "elementwise": "eager elementwise cost (TE's fused kernels or train.compile remove most of it)",
    "bubble": "the bubble of an interleaved schedule at this many micro batches",
    "optimizer": "the fused AdamW's measured bandwidth",
}


def suspect(speed, ratio: float, fp8: bool = False, record: bool = True) -> str:
    """The term most likely wrong when predicted / measured = `ratio` misses: FP8 or another path the model times
    as something else (Speed.unmodelled); a record several
    times slower than any term explains (another code path); predicted too fast with communication in the step
    (FSDP2's copy-in/out and the exchange's host syncs, only partly counted); predicted too slow: the largest
    term (what it charges that the run did not pay); else the largest term (its rate was measured at other
    shapes)."""
    from moelab.planner.speed import PART_LABELS

    parts = speed.parts_s
    big = max(parts, key=parts.get)
    share = f"{PART_LABELS[big]} ({100 * parts[big] / speed.step_s:.0f}% of the step)"
    if fp8:
        return "FP8 GEMMs and quantisation (train.fp8 is not modelled: predicted as bf16)"
    also = "; not modelled: " + "; ".join(speed.unmodelled) if speed.unmodelled else ""
    if record and (ratio > 2 or ratio < 0.5):
        return "none alone: the run took a code path the model does not describe (see the record's command)"
    if ratio < 1:
        return share + ": " + _OVERCOUNTED.get(big, "its rate, measured at the Qwen3 proxy's shapes") + also
    if speed.unmodelled:
        return also[2:]
    comm = [k for k in _COMM if parts.get(k, 0) > 0]
    if comm:
        return (f"communication ({', '.join(PART_LABELS[k] for k in comm)}): FSDP2 copy-in/out and the exchange's "
                "host syncs are only partly counted")
    compute = max((k for k in parts if k not in _COMM), key=parts.get)
    return (f"{PART_LABELS[compute]} ({100 * parts[compute] / speed.step_s:.0f}% of the step): its rate, measured "
            "at the Qwen3 proxy's shapes")


def _measured_rows(entries: list, results: list, planned, rebuild_keys: tuple) -> list[str]:
    from moelab.config import ConfigError
    from moelab.presets import preset_names
    from moelab.planner.gpus import gpu_kind

    by_name = {e.name: e for e in entries}
    rows, hits = [], []
    for r in results:
        if r.get("system") != "moelab" or not r.get("tokens_per_s_per_gpu") or r.get("gpus") not in (1, 2):
            continue
        try:
            kind = gpu_kind(r.get("gpu_name"))
        except ConfigError:  # not a GPU the model knows (a CPU run)
            continue
        rec = dict(r)
        if rec.get("gpus") == 1 and not rec.get("layout"):
            rec["layout"] = _ONE_GPU_LAYOUT  # a one-GPU run of a preset: its layout is one GPU
        p = planned(rec, by_name, gpu=kind)
        head = f"| {r['_file'].removesuffix('.json')} | {r['gpus']} x {r.get('gpu_name', '-')} | "
        measured = r["tokens_per_s_per_gpu"]
        if p is None:
            missing = [k for k in rebuild_keys if rec.get(k) is None]
            why = (f"it names neither an entry nor a preset ({r['workload']})" if r["workload"] not in by_name
                   and r.get("preset", r["workload"]) not in preset_names() else
                   f"the record lacks {', '.join(missing)}" if missing and r["workload"] not in by_name
                   else "its config does not plan")
            rows.append(head + f"{measured:,.0f} | - | - | - | not predicted: {why} |")
            continue
        s = p.speed
        ratio = s.tokens_per_s_per_gpu / measured
        calibration = r["_file"] in CALIBRATION_RECORDS
        ok = abs(ratio - 1) <= MEASURED_TARGET
        if not calibration:
            hits.append(ok)
        note = ("calibration record (not independent)" if calibration else "within 10%" if ok
                else suspect(s, ratio, fp8=r.get("fp8") not in (None, "off")))
        rows.append(head + f"{measured:,.0f} | {s.tokens_per_s_per_gpu:,.0f} | {ratio:.2f} | "
                           f"{_largest(s)} | {note} |")
    summary = (f"{sum(hits)} of {len(hits)} predicted records (calibration records left out) within "
               f"{100 * MEASURED_TARGET:.0f}%." if hits else "No record could be predicted.")
    return rows + ["", summary]


def _largest(s) -> str:
    """The largest term of a prediction and its share of the step."""
    from moelab.planner.speed import PART_LABELS

    return f"{PART_LABELS[s.bottleneck]} {100 * s.parts_s[s.bottleneck] / s.step_s:.0f}%"


def _published_rows(entries: list) -> list[str]:
    from moelab.config import ConfigError
    from moelab.planner.plan import plan

    rows = []
    for e in entries:
        pub = (e.published or {}).get("tokens_per_s_per_gpu")
        if not pub:
            continue
        try:
            s = plan(e.config(), gpus=e.gpus, gpu=e.hardware or "h100").speed
            # as the published runs ran: fused elementwise work (compiled here) and communication overlapped
            bound = plan(e.config().replace(**{"train.compile": True}), gpus=e.gpus,
                         gpu=e.hardware or "h100").speed.comm_hidden_tokens_per_s_per_gpu
        except ConfigError as err:
            rows.append(f"| {e.name} | {e.gpus} | {e.layout_text} | {pub:,.0f} | - | - | - | - | not planned: {err} |")
            continue
        ratio = s.tokens_per_s_per_gpu / pub
        note = "within 20%" if abs(ratio - 1) <= PUBLISHED_TARGET else suspect(s, ratio, record=False)
        if abs(ratio - 1) > PUBLISHED_TARGET and abs(bound / pub - 1) <= PUBLISHED_TARGET:
            note += (". Compiled with every communication hidden it is within 20%: the miss is the schedule "
                     "(overlap, fusion), not the kernel rates")
        rows.append(f"| {e.name} | {e.gpus} | {e.layout_text} | {pub:,.0f} | {s.tokens_per_s_per_gpu:,.0f} | "
                    f"{ratio:.2f} | {bound:,.0f} ({bound / pub:.2f}) | {_largest(s)} | {note} |")
    return rows


def speed_section(entries: list, results: list, planned, rebuild_keys: tuple) -> list[str]:
    """Markdown: predicted against measured (1- and 2-GPU records) and against published (the reference rows).
    `planned(record, entries_by_name, gpu=)`: the plan of the config a record ran, or None (moelab.gallery's
    _planned_for_result); `rebuild_keys`: the record fields that rebuilding a preset's config needs."""
    return [
        "## Predicted vs measured throughput", "",
        "`moelab.planner.speed` (`moelab plan CONFIG --gpu h200`) for the config each moelab record ran, on its GPU "
        "kind, against the tokens/s/GPU it measured. The model's kernel rates come from the compiled profile "
        "record and the kernel checks (`moelab.planner.speed.H200_MEASURED`), not from these throughputs; the "
        "records it is calibrated on are marked. Target: within 10%; a miss names the term most likely wrong.", "",
        "| record | GPUs | measured tokens/s/GPU | predicted | predicted / measured | largest term | note |",
        "|---|---|---:|---:|---:|---|---|",
        *_measured_rows(entries, results, planned, rebuild_keys), "",
        "## Predicted vs published throughput (reference table, H100)", "",
        "Each gallery entry with published figures, planned as the entry is written (its layout, batch and "
        "overrides; the published runs used Transformer Engine and DeepEP) on the entry's GPU kind. InfiniBand was "
        "not measured here: the model takes its datasheet rate times the efficiency NVLink reached on the H200s "
        "(moelab.planner.speed). Target: within 20%. The bound column plans the entry with `train.compile=true` "
        "and every communication term hidden behind compute (Speed.comm_hidden_tokens_per_s_per_gpu): what "
        "the same kernel rates give when the schedule overlaps as the published runs' may.", "",
        "| entry | GPUs | layout | published tokens/s/GPU | predicted | predicted / published | bound: compiled, "
        "communication hidden (/ published) | largest term | note |",
        "|---|---:|---|---:|---:|---:|---:|---|---|",
        *_published_rows(entries), "",
    ]
