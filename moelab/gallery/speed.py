"""The gallery's speed tables: the step-time model (moelab.planner.speed) against every 1- and 2-GPU moelab record
in gallery/results/ and against the reference table's published rows, rendered into gallery/README.md by
``moelab gallery report`` (moelab.gallery.render_report calls speed_section).

    lines = speed_section(load_entries(), load_results(), _planned_for_result, _REBUILD_KEYS)   # markdown

A row whose prediction misses names the term most likely wrong (``suspect`` for records, ``published_note``
for the reference rows), from what the model knows: what it does not model, what the record's code did that
today's does not (``record_history``), the communication it hides or leaves exposed, the largest term.
"""
from __future__ import annotations

# a code change that alters what a record ran against what the model describes (today's code), by its commit and
# date: records older than it ran the old behaviour (moelab.gallery.records: LEAN_FSDP, DEFAULTS_BEFORE)
from moelab.gallery.records import LEAN_FSDP

MEASURED_TARGET = 0.10  # predicted within 10% of a 1- or 2-GPU record
PUBLISHED_TARGET = 0.20  # within 20% of a published row
_ONE_GPU_LAYOUT = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "vp": 1, "fsdp": 1}


def record_history(r: dict, p) -> list[str]:
    """What the record's code did that today's code (and so the model) does not, where it bears on speed."""
    date, L = str(r.get("date") or ""), p.layout
    if not (date and date < LEAN_FSDP[1] and r.get("gpus", 1) > 1):
        return []
    then = []
    if (L["ep"] > 1 and L["efsdp"] == 1) or L["fsdp"] * L["cp"] == 1:
        then.append("wrapped the one-rank meshes too (a copy-in / copy-out of those weights every micro batch: "
                    "22.6 ms of the EP=2 profile's 237 ms step, logs/...profile-ep2-eager.txt)")
    if L["ep"] > 1:
        then.append("gathered implicitly under EP (each block's gather waits for the host past the dispatcher's "
                    "device-to-host copy)")
    if L["pp"] > 1:
        then.append("resharded every block but the last after forward under pp")
    return [f"ran before lean FSDP ({LEAN_FSDP[0]}): FSDP2 then " + " and ".join(then)] if then else []


def untimed_trial(r: dict) -> list[str]:
    """The one-GPU step trials the record ran (moelab.gallery.current.step_trials) that the model does not time (it
    times today's step)."""
    from moelab.gallery.current import step_trials

    split = step_trials(r).get("overlap_split_sms")
    return [f"the update beside the forward on {split[0]} SMs (issue 41 call 35's trial, taken out after it; the "
            "model times the update on the whole GPU)"] if split else []


def suspect(speed, ratio: float, history: list | None = None, record: bool = True) -> str:
    """The term most likely wrong when predicted / measured = `ratio` misses: a path the model times as something
    else (Speed.unmodelled); a record several times off (another code path); what the record's code did that
    today's does not (`history`); predicted too fast: the communication the model hides (had it run in line, the
    ratio it would give) or leaves exposed (the exchange's host synchronisations are only partly counted);
    predicted too slow: the largest term (what it charges that the run did not pay); else the largest compute
    term (its rate was measured at the Qwen3 proxy's shapes)."""
    from moelab.planner.speed import COMM_PARTS, PART_LABELS

    parts = speed.parts_s
    if speed.unmodelled:
        return "not modelled: " + "; ".join(speed.unmodelled)
    if record and (ratio > 2 or ratio < 0.5):
        return "none alone: the run took a code path the model does not describe (see the record's command)"
    out = list(history or [])
    if ratio > 1:
        hidden = sum(speed.hidden_s.values())
        exposed = [k for k in COMM_PARTS if parts.get(k, 0) > 0]
        if hidden > 0.02 * speed.step_s:
            in_line = ratio * speed.step_s / (speed.step_s + hidden)
            out.append(f"overlap: the model hides {_ms(hidden)} of " + ", ".join(
                PART_LABELS[k] for k in speed.hidden_s) + f" behind compute; run in line it would predict "
                f"{in_line:.2f} of the measured")
        if exposed:
            out.append("communication (" + ", ".join(PART_LABELS[k] for k in exposed) + "): the exchanges' "
                       "host synchronisations and NCCL's share of the SMs are not counted")
        out += [x for x in speed.extrapolated if x.startswith("CP")]
        if not out:
            compute = max((k for k in parts if k not in COMM_PARTS), key=parts.get)
            out += [f"{PART_LABELS[compute]} ({100 * parts[compute] / speed.step_s:.0f}% of the step): its rate, "
                    "measured at the Qwen3 proxy's shapes", *speed.extrapolated]
        return "; ".join(out)
    big = max(parts, key=parts.get)
    out.append(f"{PART_LABELS[big]} ({100 * parts[big] / speed.step_s:.0f}% of the step): "
               + _OVERCOUNTED.get(big, "its rate, measured at the Qwen3 proxy's shapes"))
    return "; ".join(out)


_OVERCOUNTED = {  # what the model charges that a faster run may not pay, by term
    "all_to_all": "moelab's flat all-to-all sends one row per routed expert (top_k rows, where the fake gate puts a "
                  "token's experts on one or two ranks that DeepEP reaches with a row each), runs in line "
                  "(parallel.ep_overlap off) and again in full recompute; the published runs use DeepEP and overlap it",
    "all_to_all hierarchical": "moelab's hierarchical exchange sends a token once per other node, but runs its two "
                               "collectives one after the other, in line (parallel.ep_overlap off) and again in full "
                               "recompute; DeepEP forwards between NVLink and InfiniBand at once and overlaps it",
    "fsdp": "FSDP2 traffic as moelab runs it (moelab.planner.comm.fsdp_counts): without pp every micro batch "
            "reduce-scatters, blocks are gathered again in backward, and with ep = 1 every block's experts are "
            "gathered; a run with expert parallelism, weights kept gathered or one reduce per step pays far less",
    "fsdp_copies": "FSDP2's copy-in / copy-out at the H200's measured copy rate",
    "elementwise": "elementwise work per token x hidden at the Qwen3 proxy's compiled rate (x the eager factor "
                   "without train.compile); Transformer Engine's fused kernels do less",
    "bubble": "the bubble of the pipeline schedule at this many micro batches",
    "optimizer": "the AdamW kernel's measured bandwidth",
}


def _ms(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{1e3 * s:.1f} ms"


def _comm(s) -> str:
    """Exposed / hidden communication of a prediction."""
    from moelab.planner.speed import COMM_PARTS

    exposed = sum(s.parts_s.get(k, 0.0) for k in COMM_PARTS)
    return f"{_ms(exposed)} / {_ms(sum(s.hidden_s.values()))}" if exposed or s.hidden_s else "-"


def _measured_rows(entries: list, results: list, planned, rebuild_keys: tuple) -> list[str]:
    from moelab.config import ConfigError
    from moelab.presets import preset_names
    from moelab.gallery.records import record_settings, router_of
    from moelab.planner.gpus import gpu_kind
    from moelab.planner.rates import CALIBRATION_RECORDS

    by_name = {e.name: e for e in entries}
    rows, hits, unmodelled, differ = [], [], 0, 0
    for r in results:
        if r.get("system") != "moelab" or not r.get("tokens_per_s_per_gpu") or r.get("gpus") not in (1, 2):
            continue
        try:
            kind = gpu_kind(r.get("gpu_name"))
        except ConfigError:  # not a GPU the model knows (a CPU run)
            continue
        ran = record_settings(r)
        rec = {**r, **ran}  # what the record ran, for the config rebuilt from it
        if rec.get("gpus") == 1 and not rec.get("layout"):
            rec["layout"] = _ONE_GPU_LAYOUT  # a one-GPU run of a preset: its layout is one GPU
        p = planned(rec, by_name, gpu=kind)
        head = (f"| {r['_file'].removesuffix('.json')} | {r['gpus']} x {r.get('gpu_name', '-')} | "
                f"{router_of(r, by_name)} | ")
        measured = r["tokens_per_s_per_gpu"]
        if p is None:
            missing = [k for k in rebuild_keys if rec.get(k) is None]
            why = (f"it names neither an entry nor a preset ({r['workload']})" if r["workload"] not in by_name
                   and r.get("preset", r["workload"]) not in preset_names() else
                   f"the record lacks {', '.join(missing)}" if missing and r["workload"] not in by_name
                   else "its config does not plan")
            rows.append(head + f"{measured:,.0f} | - | - | - | - | not predicted: {why} |")
            continue
        s = p.speed
        if s is None:  # a record that ran is planned over its GPU's memory: no speed to compare
            rows.append(head + f"{measured:,.0f} | - | - | - | - | not predicted: {p.verdict} |")
            continue
        ratio = s.tokens_per_s_per_gpu / measured
        cells = f"{measured:,.0f} | {s.tokens_per_s_per_gpu:,.0f} | {ratio:.2f} | {_largest(s)} | {_comm(s)} | "
        wrong = {k: (s.settings[k], v) for k, v in ran.items() if k in s.settings and s.settings[k] != v}
        if wrong:  # the config rebuilt from the record does not run what the record ran: no comparison
            differ += 1
            rows.append(head + f"{measured:,.0f} | {s.tokens_per_s_per_gpu:,.0f} | - | {_largest(s)} | {_comm(s)} | "
                        "not compared: the rebuilt config runs " + ", ".join(
                            f"{k}={mine} where the record ran {k}={theirs}" for k, (mine, theirs) in wrong.items())
                        + " (moelab.gallery.entries._config_for_result) |")
            continue
        calibration = r["_file"] in CALIBRATION_RECORDS
        ok = abs(ratio - 1) <= MEASURED_TARGET
        unmod = s.unmodelled + untimed_trial(r)
        if unmod:
            unmodelled += 1
        elif not calibration:
            hits.append(ok)
        note = ("calibration record (not independent)" if calibration else "not modelled: " + "; ".join(unmod)
                if unmod else "within 10%" if ok else suspect(s, ratio, record_history(r, p)))
        rows.append(head + cells + note + " |")
    summary = (f"{sum(hits)} of {len(hits)} records whose every term is modelled within {100 * MEASURED_TARGET:.0f}% "
               f"(calibration records left out); {unmodelled} run something the model does not time (not "
               f"modelled); {differ} not compared (the config rebuilt from the record differs from what it ran)."
               if hits or unmodelled or differ else "No record could be predicted.")
    return rows + ["", summary]


def _largest(s) -> str:
    """The largest term of a prediction and its share of the step."""
    from moelab.planner.speed import PART_LABELS

    return f"{PART_LABELS[s.bottleneck]} {100 * s.parts_s[s.bottleneck] / s.step_s:.0f}%"


def published_note(s, ratio: float, bound: float) -> str:
    """Why a published row misses: predicted too slow, the one term of moelab's step the published run (TE +
    DeepEP, its own schedule) may not pay, the largest, with its share of the step; predicted too fast, the term
    the model may undercharge (_faster_note); and whether the bound (compiled, every communication hidden)
    reaches the published figure."""
    from moelab.planner.speed import PART_LABELS

    if abs(ratio - 1) <= PUBLISHED_TARGET:
        return "within 20%" + ("; not modelled: " + "; ".join(s.unmodelled) if s.unmodelled else "")
    if ratio > 1:  # predicted faster: what the published run paid that the model does not charge
        return _faster_note(s)
    # predicted slower: the one term the published run may not pay, the largest such share of the step
    terms = sorted(((k, v) for k, v in s.parts_s.items() if k in _OVERCOUNTED and v > 0.1 * s.step_s),
                   key=lambda kv: -kv[1])[:1]
    out = [f"{PART_LABELS[k]} ({100 * v / s.step_s:.0f}% of the step): "
           + _OVERCOUNTED.get(f"{k} {s.settings.get('ep_dispatch')}", _OVERCOUNTED[k]) for k, v in terms]
    if not out:
        big = max(s.parts_s, key=s.parts_s.get)
        out.append(f"{PART_LABELS[big]} ({100 * s.parts_s[big] / s.step_s:.0f}% of the step): its rate, measured "
                   "at the Qwen3 proxy's shapes on an H200")
    if s.unmodelled:
        out.append("not modelled: " + "; ".join(s.unmodelled))
    note = "; ".join(out)
    if abs(bound - 1) <= PUBLISHED_TARGET:
        note += (". Compiled with every communication hidden it is within 20%: the miss is the schedule "
                 "(overlap, fusion), not the kernel rates")
    return note


def _faster_note(s) -> str:
    """A published row the model predicts too fast: the exposed communication term that crosses nodes, whose rate
    is a published figure for a few nodes (contention on a larger fabric, stragglers and the launch of more ranks
    are not modelled), else the largest term."""
    from moelab.planner.speed import PART_LABELS

    crossing = [k for k in ("all_to_all", "fsdp", "pipeline_send") if s.parts_s.get(k, 0) > 0.05 * s.step_s]
    k = max(crossing, key=s.parts_s.get) if crossing else max(s.parts_s, key=s.parts_s.get)
    why = ("the only terms that cross nodes run at InfiniBand rates published for a few nodes (DeepEP's "
           "internode figures, EP 16-64); nothing in the model grows with the cluster at a fixed layout, so "
           "contention on a larger fabric and stragglers among more ranks are not charged" if crossing
           else "its rate, measured at the Qwen3 proxy's shapes on an H200")
    return f"predicted faster: {PART_LABELS[k]} ({100 * s.parts_s[k] / s.step_s:.0f}% of the step): {why}"


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
            rows.append(f"| {e.name} | {e.gpus} | {e.layout_text} | {pub:,.0f} | - | - | - | - | - | "
                        f"not planned: {err} |")
            continue
        except AttributeError:  # no speed: the plan does not fit
            rows.append(f"| {e.name} | {e.gpus} | {e.layout_text} | {pub:,.0f} | - | - | - | - | - | "
                        f"not predicted: the entry's layout does not fit an {e.hardware} |")
            continue
        ratio = s.tokens_per_s_per_gpu / pub
        rows.append(f"| {e.name} | {e.gpus} | {e.layout_text} | {pub:,.0f} | {s.tokens_per_s_per_gpu:,.0f} | "
                    f"{ratio:.2f} | {bound:,.0f} ({bound / pub:.2f}) | {_largest(s)} | {_comm(s)} | "
                    f"{published_note(s, ratio, bound / pub)} |")
    return rows


def speed_section(entries: list, results: list, planned, rebuild_keys: tuple) -> list[str]:
    """Markdown: predicted against measured (1- and 2-GPU records) and against published (the reference rows).
    `planned(record, entries_by_name, gpu=)`: the plan of the config a record ran, or None (moelab.gallery.entries's
    _planned_for_result); `rebuild_keys`: the record fields that rebuilding a preset's config needs."""
    return [
        "## Predicted vs measured throughput", "",
        "`moelab.planner.speed` (`moelab plan CONFIG --gpu h200`) for the config each moelab record ran, on its GPU "
        "kind, against the tokens/s/GPU it measured. The model's kernel rates come from the profile records and "
        "the kernel checks (`moelab.planner.rates.H200_MEASURED`), not from these throughputs; the records it is "
        "calibrated on are marked. Communication is split as moelab's schedule runs it: exposed (in the step) and "
        "hidden behind compute. Target: within 10%; a miss names the term most likely wrong, including what the "
        "record's code did that today's (the model's) does not.", "",
        "| record | GPUs | router | measured tokens/s/GPU | predicted | predicted / measured | largest term | "
        "communication exposed / hidden | note |",
        "|---|---|---|---:|---:|---:|---|---|---|",
        *_measured_rows(entries, results, planned, rebuild_keys), "",
        "## Predicted vs published throughput (reference table, H100)", "",
        "Each gallery entry with published figures, planned as the entry is written (its layout, batch and "
        "overrides; the published runs used Transformer Engine and DeepEP) on the entry's GPU kind, with the "
        "expert exchange moelab runs there (parallel.ep_dispatch=auto: hierarchical where the EP group spans "
        "nodes; moelab.planner.dispatch). InfiniBand was not measured here: the model takes its datasheet rate "
        "times the share DeepEP's published internode figures reach (moelab.planner.rates.PUBLISHED). Target: "
        "within 20%; a miss names the one term most likely wrong and why. The bound column plans the entry with "
        "`train.compile=true` and every communication term hidden behind compute (Speed.comm_hidden_tokens_per_s_per_gpu): what the same kernel rates give when the "
        "schedule overlaps as the published runs' may. No constant is fitted to these figures.", "",
        "| entry | GPUs | layout | published tokens/s/GPU | predicted | predicted / published | bound: compiled, "
        "communication hidden (/ published) | largest term | communication exposed / hidden | note |",
        "|---|---:|---|---:|---:|---:|---:|---|---|---|",
        *_published_rows(entries), "",
    ]
