"""Which benchmark records are current: the rows of the peers tables (gallery/perf-notes.md's current table,
README's headline, the gallery's peers section) and the records the issue targets are computed from. Every other
record is history (gallery/perf-notes.md lists them all, each with the reason it is not current).

The rule (``current_records``), applied to every record, peers and moelab alike:

1. A record takes part when it measured a throughput, did not fail, was not made before a fix (``before_fix``:
   its name or variant says so), is not named in a newer record's ``supersedes`` list, is no run of a router
   sweep (gallery/scripts/router_sweep.py; those have their own table), and routed with the learned router (the
   peers train with theirs; fake-gate records are history).
2. A moelab record must have run today's defaults (``default_deviations``): ``train.compile=true``, bf16
   parameters (as the peers train), and the loss and optimizer kernel that ``backend.loss=auto`` and
   ``train.optimizer=auto`` resolve to today for the config it ran on its GPU (``resolve_loss``;
   ``AUTO_OPTIMIZER``). Side-by-sides of other losses, torch's AdamW, runs from before a default changed are
   history.
3. A slot is (system, workload, GPU, GPUs, sequence, global batch, micro batch, FP8 on or off) (``slot_of``). In
   each slot every configuration of a system (``configuration_of``: compile and its mode, FP8 recipe, loss,
   optimizer, experts implementation, backends set, parameter dtype, clipping) keeps its newest record (by date):
   a re-run replaces the older record of the same configuration, faster or not. The slot's row is the fastest of
   those.

    cur = current_records(load_results(), {e.name: e for e in load_entries()})
    cur.best[slot]          # the row of a slot
    cur.status(record)      # "" for a row, else why the record is history ("older than ...", "loss chunked ...")
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from moelab.gallery.records import (SWEEP, commit_of, fmt, gpu_memory_of, rebuild_config, record_settings,
                                   recorded_overrides, router_of)

# What train.optimizer=auto runs on a CUDA GPU with torch's CUDA wheels, which ship Triton
# (moelab.train.optim.optimizer_kind; tests/gallery/test_current.py holds the two together).
AUTO_OPTIMIZER = "adamw_triton"
_BEFORE_FIX = re.compile(r"before[\s_-]+(?:[\w-]+\s+){0,3}fix", re.IGNORECASE)


def before_fix(r: dict) -> bool:
    """A record measured before a bug was fixed: its file name or variant says so ("...-before-fix",
    "before the autocast fix")."""
    return bool(_BEFORE_FIX.search(f"{r.get('_file', '')} {r.get('variant', '')}"))


def stem(r_or_name) -> str:
    """A record's file name without .json (its name in the tables)."""
    name = r_or_name.get("_file", "?") if isinstance(r_or_name, dict) else str(r_or_name)
    return name.removesuffix(".json")


def call_of(r: dict) -> str:
    """The device call a record came from, short: "11", "issue 31 call 1"."""
    call = str(r.get("device_call") or "-")
    return call.split(" (")[0] if call.startswith("issue") else call.split(" ")[0]


def fp8_of(r: dict) -> str:
    """The FP8 recipe a record ran ("off" where it says nothing)."""
    v = r.get("fp8")
    return {None: "off", False: "off", True: "rowwise"}.get(v, str(v)) if not isinstance(v, str) else v


def slot_of(r: dict) -> tuple:
    """(system, workload, GPU, GPUs, sequence, global batch, micro batch, FP8 on): the records one row stands
    for."""
    return (r.get("system"), r.get("workload"), r.get("gpu_name"), r.get("gpus"), r.get("seq_len"),
            r.get("global_batch_size"), r.get("micro_batch_size"), fp8_of(r) != "off")


_BACKEND_CHOICES = ("backend.attention", "backend.experts", "backend.dispatcher", "backend.te_fp8")


def configuration_of(r: dict) -> tuple:
    """How a system ran in its slot: compiled (and how), FP8 recipe, loss, optimizer kernel, experts
    implementation, the backends it set (`--set backend.experts=...`; the resolved defaults are no choice),
    parameter dtype, gradient clipping (`grad_clip`: a peer clipping as its trainer does, gpu_perf.sh's CLIP).
    Two records with one configuration measure the same thing, whichever script wrote them."""
    ran = record_settings(r) if r.get("system") == "moelab" else {}  # (the defaults of moelab's past days)
    chosen = tuple(sorted((k, v) for k, v in recorded_overrides(r).items() if k in _BACKEND_CHOICES))
    # a record that says it ran without train.optimizer_overlap is another configuration (records before the
    # field ran without it too, as the code then did: they stay in the slot of today's code); so is each step trial
    return (bool(r.get("compile")), r.get("compile_mode"), fp8_of(r), ran.get("loss"), ran.get("optimizer"),
            r.get("experts_implementation"), chosen, r.get("param_dtype"), r.get("optimizer_overlap") is False,
            tuple(sorted(step_trials(r))), float(r.get("grad_clip") or 0.0))


def step_trials(r: dict) -> dict:
    """How a record's step ran other than today's, in the one-GPU step's A/B trials (issue 41): the step on a
    higher-priority stream than the optimizer's update (call 26, not kept), the update queued before the step's
    read (call 28, `step_before_read`, not kept), the norm's own pass over the experts' gradients (`norm_in_gemms`
    false), the compiled full loss beside its in-place kernel (`loss_in_place` false), the micro batches copied
    from pageable memory (call 31, `batch_copy`), the update beside the forward on a few SMs (call 35,
    `overlap_split_sms`, taken out after it), SonicMoE's GEMMs on tiles other than moelab.backends.sonic.TILES
    (`sonic_tiles`, a sweep's choice run as MOELAB_SONIC_TILES: calls 14-15's, call 39's 64-row tiles), clipping's
    multiply as its own pass over the gradients (`clip_in_update` false at a `grad_clip` above 0: gpu_perf --clip's
    bf16-clip-pass), the weight-gradient GEMMs' add into .grad other than moelab.backends.sonic.ADD_VIA in a step
    of several micro batches (`sonic_add`, run as MOELAB_SONIC_ADD).
    {setting: (ran, today)}; records before these fields ran as today's code in these respects, or as the code
    then did."""
    out = {}
    if r.get("overlap_priority") == "high":
        out["overlap_priority"] = ("high", "equal")
    if r.get("optimizer_overlap") and r.get("step_before_read") is True:
        out["update_before_read"] = (True, False)
    if r.get("norm_in_gemms") is False:
        out["norm_in_gemms"] = (False, True)
    if r.get("loss_in_place") is False and record_settings(r).get("loss") == "full":
        out["loss_in_place"] = (False, True)
    if r.get("batch_copy") == "pageable":
        out["batch_copy"] = ("pageable", "pinned")
    if r.get("overlap_split_sms"):
        out["overlap_split_sms"] = (r["overlap_split_sms"], 0)
    tiles = _tiles_trial(r.get("sonic_tiles"))
    if tiles:
        out["sonic_tiles"] = tiles
    if r.get("grad_clip") and r.get("clip_in_update") is False:
        out["clip_in_update"] = (False, True)
    from moelab.backends.sonic import ADD_VIA
    adds = (r.get("global_batch_size") or 0) > (r.get("micro_batch_size") or 0) * (r.get("gpus") or 1)
    if adds and r.get("sonic_add", ADD_VIA) != ADD_VIA:  # one micro batch a step never adds into .grad
        out["sonic_add"] = (r["sonic_add"], ADD_VIA)
    return out


def _tiles_trial(ran: "dict | None") -> "tuple[str, str] | None":
    """(the tiles a record's MOELAB_SONIC_TILES set, today's for those GEMMs) where any differs from
    moelab.backends.sonic.TILES on Hopper (QuACK's default where the table names none), else None."""
    from moelab.backends.sonic import TILE_FIELDS, TILES

    def name(gemm, tile):
        if tile is None:
            return f"{gemm} QuACK's default"
        t = dict(zip(TILE_FIELDS, tile))
        kind = "pingpong" if t["pingpong"] else "cooperative"
        return f"{gemm} {t['tile_m']}x{t['tile_n']} {kind} cluster {t['cluster_m']}x{t['cluster_n']}"
    table = TILES.get(9, {})
    changed = sorted(g for g, t in (ran or {}).items() if list(table.get(g) or ()) != list(t))
    if not changed:
        return None
    return (", ".join(name(g, ran[g]) for g in changed), ", ".join(name(g, table.get(g)) for g in changed))


def default_deviations(r: dict, entries: "dict | None" = None) -> dict:
    """What a moelab record ran that today's default benchmark config would not, {setting: (ran, today)}: compile
    (true), parameter dtype (bfloat16, as the peers train), loss (what backend.loss=auto resolves to for the
    config the record ran, on its GPU: moelab.planner.plan.resolve_loss) and optimizer kernel (AUTO_OPTIMIZER).
    A record whose config cannot be rebuilt deviates as {"config": (why, "rebuildable")}.

        default_deviations(record)   # {} or e.g. {'loss': ('chunked', 'full'), 'optimizer': ('adamw', 'adamw_triton')}
    """
    from moelab.planner.plan import resolve_loss

    out = {}
    if not r.get("compile"):
        out["compile"] = (bool(r.get("compile")), True)
    if r.get("param_dtype", "bfloat16") != "bfloat16":
        out["param_dtype"] = (r["param_dtype"], "bfloat16")
    ran = record_settings(r)
    if ran.get("optimizer") != AUTO_OPTIMIZER:
        out["optimizer"] = (ran.get("optimizer", "unrecorded"), AUTO_OPTIMIZER)
    if r.get("optimizer_overlap") is False:  # timed without the overlap beside the default (gpu_perf --overlap-off)
        out["optimizer_overlap"] = ("off", "auto")
    out.update(step_trials(r))  # the one-GPU step's A/B variants
    cfg, why = rebuild_config(r, entries or {})
    if cfg is None:
        out["config"] = (why, "rebuildable")
        return out
    if r.get("grad_clip") is not None:  # gpu_perf --clip's: clipping other than its entry's or preset's
        base, _ = rebuild_config({k: v for k, v in r.items() if k != "grad_clip"}, entries or {})
        if base is not None and float(r["grad_clip"]) != base.train.grad_clip:
            out["grad_clip"] = (r["grad_clip"], base.train.grad_clip)
    today = resolve_loss(cfg.replace(**{"backend.loss": "auto"}), gpus=int(r.get("gpus") or 1),
                         gpu_memory_gb=gpu_memory_of(r.get("gpu_name")), on_cuda=True)
    if ran.get("loss") != today:
        out["loss"] = (ran.get("loss", "unrecorded"), today)
    return out


def _unusable(r: dict, superseded: dict, entries: "dict | None") -> str:
    """Why a record cannot be a row of any table of current records (rule 1), "" when it can."""
    if "error" in r:
        return "failed: " + str(r["error"])[:60]
    if not r.get("tokens_per_s_per_gpu"):
        return "no throughput"
    if before_fix(r):
        return "measured before a fix"
    if stem(r) in superseded:
        return f"superseded by {superseded[stem(r)]}"
    if r.get("sweep") == SWEEP:
        return "one run of a router sweep (its own table)"
    kind = router_of(r, entries).kind
    if kind != "learned":
        return f"router {kind} (current rows use the learned router)"
    return ""


def _not_default(dev: dict) -> str:
    """Why a moelab record's deviations keep it from being current (rule 2), "" when it has none."""
    named = {k: v for k, v in dev.items() if k != "config"}
    if named:
        return "not today's defaults: " + ", ".join(f"{k} {a} (today {b})" for k, (a, b) in named.items())
    return f"cannot tell its defaults: {dev['config'][0][:80]}" if dev else ""


@dataclass
class Current:
    """The current records: `best` {slot: the slot's row}, `candidates` {slot: the newest record of each
    configuration, fastest first}, why each other record is history (`status`), which records pass rule 1
    (`usable`) and what each usable moelab record ran that today's defaults would not (`deviations`).

        cur = current_records(results, entries); cur.status(r)   # "" for a row
    """
    best: dict
    candidates: dict
    reasons: dict = field(default_factory=dict)  # id(record) -> why it is not a row
    unusable: set = field(default_factory=set)  # id(record) of the records rule 1 leaves out
    deviated: dict = field(default_factory=dict)  # id(record) -> default_deviations of a usable moelab record

    def status(self, r: dict) -> str:
        return self.reasons.get(id(r), "")

    def usable(self, r: dict) -> bool:
        return id(r) not in self.unusable

    def deviations(self, r: dict) -> dict:
        return self.deviated.get(id(r), {})


def current_records(records: list, entries: "dict | None" = None) -> Current:
    """Apply the module's rule to `records` (dicts with `_file`, as moelab.gallery.load_results gives them)."""
    superseded = {stem(n): stem(r) for r in records for n in (r.get("supersedes") or [])}
    cur, newest = Current({}, {}), {}
    for r in records:
        why = _unusable(r, superseded, entries)
        if why:
            cur.unusable.add(id(r))
        elif r.get("system") == "moelab":
            cur.deviated[id(r)] = default_deviations(r, entries)
            why = _not_default(cur.deviated[id(r)])
        if why:
            cur.reasons[id(r)] = why
            continue
        k = (slot_of(r), configuration_of(r))
        if k in newest:
            old, new = sorted((newest[k], r), key=lambda x: str(x.get("date", "")))
            cur.reasons[id(old)] = f"older than {stem(new)} (same configuration)"
            newest[k] = new
        else:
            newest[k] = r
    for (slot, _), r in newest.items():
        cur.candidates.setdefault(slot, []).append(r)
    for slot, rs in cur.candidates.items():
        rs.sort(key=lambda x: -x["tokens_per_s_per_gpu"])
        cur.best[slot] = rs[0]
        for r in rs[1:]:
            cur.reasons[id(r)] = f"slower than {stem(rs[0])} (the slot's fastest current configuration)"
    return cur


def peers_section(results: list, entries: "dict | None" = None) -> list[str]:
    """Markdown: per workload with a peer's record, the current row (current_records) of each system in each slot
    a peer has a row in."""
    cur = current_records(results, entries)
    peer_slots = {s[1:] for s in cur.best if s[0] != "moelab"}
    workloads = sorted({s[0] for s in peer_slots}, key=str)
    lines = ["## Peers on the same workload and GPU", "",
             "Each system's current row per workload, GPU, batch, micro batch, sequence and FP8 on or off "
             "(moelab.gallery.current): failed runs, runs before a fix, superseded ones, router sweeps and fake "
             "routers are left out; moelab's records count only where they ran today's defaults (`train.compile`, "
             "bf16 parameters, the loss and optimizer `auto` resolves to); of each configuration the newest "
             "record counts, and the row is the fastest configuration. gallery/perf-notes.md keeps every record, "
             "each with the reason it is not current.", ""]
    if not workloads:
        return lines + ["No peer results yet (result files with a `system` other than \"moelab\").", ""]
    for w in workloads:
        lines += [f"### {w}", "", "| system | variant | GPUs | global batch | micro batch | FP8 | router | GPU | "
                  "tokens/s/GPU | TFLOPs/GPU | peak memory GiB | torch | commit | record | command |",
                  "|---|---|---:|---:|---:|---|---|---|---:|---:|---:|---|---|---|---|"]
        slots = sorted((s for s in cur.best if s[1:] in peer_slots and s[1] == w),
                       key=lambda s: (*(x or 0 for x in s[3:7]), s[7], s[0] != "moelab", s[0]))
        for s in slots:
            r = cur.best[s]
            lines.append(f"| {r['system']} | {r.get('variant', '-')} | {r.get('gpus', '-')} | "
                         f"{r.get('global_batch_size', '-')} | {r.get('micro_batch_size', '-')} | {fp8_of(r)} | "
                         f"{router_of(r, entries)} | {r.get('gpu_name', '-')} | "
                         f"{fmt(r.get('tokens_per_s_per_gpu'))} | {fmt(r.get('tflops_per_gpu'), 1)} | "
                         f"{fmt(r.get('peak_memory_gb'), 1)} | {r.get('torch_version', '-')} | "
                         f"{commit_of(r)} | {r.get('_file', '-')} | `{r.get('command', '-')}` |")
        shown = {id(cur.best[s]) for s in slots}
        left = [r for r in results if r.get("workload") == w and id(r) not in shown]
        lines += ["", f"{len(left)} other records of {w} are not current or have no peer in their slot "
                  "(history: gallery/perf-notes.md).", ""]
    return lines
