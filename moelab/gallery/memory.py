"""gallery/README.md's planned-vs-measured memory table: every moelab record with an allocator peak, planned as
the config it ran (moelab.gallery.records.rebuild_config), each miss with the cause its record shows.

    lines, rows = memory_section(load_results(), {e.name: e for e in load_entries()})

What a row plans: the rebuilt config on the record's GPUs, as the code of the record's day ran it: a record older
than a code change the planner can plan the old way gets the planner option of its day
(moelab.gallery.records.planner_options, by the record's date against the change's commit; today: before 6131a2c
FSDP2 wrapped one-rank meshes too, plan(fsdp_one_rank="wrapped")), and its note says so where the option bears
on its layout (`day_notes`: DAY_NOTES). A record that timed the learned router beside a fake-gate headline
(`real_router`; `fake_router` is the fake gate beside a learned headline) ran both in one process, so its peak is
the learned router's, which keeps more for backward (moelab.planner.saved): it is planned with the learned router.

Causes of a miss (`miss_causes`), rules over a record and its plan, never per-record figures:
- An FP8 expert weight cache left by an earlier run in the same process: fp8_expert_weight_cache.refreshes_so_far
  > 0 in a run of one micro batch per step, which on its own never allocates the cache. The planner does not
  count another run's memory; a run of that setting alone (on GPU) is to replace the record.
Records with a peak that cannot be rebuilt are listed with the reason.
"""
from __future__ import annotations

from moelab.gallery.records import CODE_BEFORE, gpu_memory_of, planner_options, rebuild_config, router_of

MEMORY_TARGET = 0.07  # issue 32: the plan's peak within 7% of the measured peak


def _one_rank_units(p) -> str:
    """Which FSDP2 units of plan `p` sit alone on a one-rank mesh of a several-GPU run ("" if none)."""
    L = p.layout
    if p.gpus < 2:
        return ""
    dense = L["fsdp"] * L["cp"] * L["tp"] == 1
    experts = L["ep"] > 1 and L["efsdp"] == 1
    return " and ".join(what for what, alone in (("each pipeline stage's blocks on its dense mesh", dense),
                                                 ("the experts on the expert-FSDP mesh", experts)) if alone)


# per planner option of a record's day that bears on memory (moelab.gallery.records.CODE_BEFORE; sonic_wgrad,
# sonic_tiles, grad_norm, into_grad, expert_norm and clip_multiply move time only): what that code did and how the plan
# counts it (the paragraph under the table), what the option plans and what the code then did (the note's words),
# and which units of a plan it bears on ("" where none)
DAY_NOTES = {
    "fsdp_one_rank": ("FSDP2 then wrapped units on one-rank meshes too (each unit's weights gathered into its own "
                      "buffers, its gradients reduced through fp32 buffers); since then such units stay plain "
                      "(moelab.parallel.fsdp). Such records are planned with moelab.planner.plan's "
                      "fsdp_one_rank=wrapped, which counts those units as the code then held them",
                      "FSDP2 wrapping", "wrapped one-rank meshes too", _one_rank_units),
    "local_weighting": ("the local dispatcher applied the routing weights to the expert outputs at combine and kept "
                        "them for the weights' gradient (top_k x hidden x 2 bytes per token and MoE layer), and "
                        "unsorted them by index_copy; since then the experts weight each row's activation before the "
                        "down projection and the rows move by gathers (moelab.model.moe, moelab.model.rows). Such "
                        "records are planned with moelab.planner.plan's local_weighting=combine",
                        "routing-weight placement", "weighted the expert outputs at combine",
                        lambda p: "the MoE layers on one rank" if p.layout.get("ep", 1) == 1 else ""),
    "full_loss": ("backend.loss=full then kept the logits and, in backward, their gradient in a second buffer of "
                  "the same size (the compiled loss); since then one kernel writes the gradient over the logits "
                  "(moelab.backends.loss_kernel). Such records are planned with moelab.planner.plan's "
                  "full_loss=compiled", "full loss", "kept the logits' gradient beside them",
                  lambda p: "the last stage's logits" if p.loss == "full" and p.layout.get("tp", 1) == 1 else ""),
}


def day_notes(r: dict, p) -> list[str]:
    """What the note of record `r`, planned as `p` with the options of its day, says about them: each option
    that bears on the plan's layout (see the module docstring)."""
    out = []
    for key, value, commit, _ in CODE_BEFORE:
        if key not in DAY_NOTES:
            continue
        _, topic, then, units = DAY_NOTES[key]
        which = units(p)
        if which and planner_options(r).get(key) == value:
            out.append(f"planned with the {topic} of its day: its code (before {commit}) {then} ({which})")
    return out


def miss_causes(r: dict, p) -> list[str]:
    """The causes the record `r` shows for its peak differing from plan `p` (see the module docstring)."""
    out = []
    cache = r.get("fp8_expert_weight_cache") or {}
    if r.get("fp8") not in (None, "off") and p.micro_batches_per_step == 1 and cache.get("refreshes_so_far"):
        out.append(f"the FP8 expert weight cache of an earlier run in the same process (its command: "
                   f"`{r.get('command', '?')}`; fp8_expert_weight_cache.refreshes_so_far="
                   f"{cache['refreshes_so_far']}), which one micro batch per step never allocates on its own "
                   "(moelab.model.fp8_cache): the peak is not this run's alone; left as measured until a GPU run "
                   "of this setting alone replaces the record")
    return out


def _peak_config(r: dict, cfg):
    """The config whose run the record's allocator peak covers: the learned router where it ran beside the
    fake gate (see the module docstring)."""
    if cfg.backend.fake_balanced_gate and (r.get("real_router") or r.get("fake_router")):
        return cfg.replace(**{"backend.fake_balanced_gate": False, "backend.fake_gate_noise": 0.0}), True
    return cfg, False


def memory_section(results: list, by_name: dict) -> tuple[list[str], list]:
    """Markdown: planned against measured memory per GPU; also the (name, planned GiB, measured GiB) rows for the
    plot."""
    from moelab.config import ConfigError
    from moelab.planner.plan import plan

    lines = ["## Planned vs measured memory per GPU", "",
             "Every moelab result with a measured peak (allocator peak, GiB), planned as the config it ran: its "
             "gallery entry or preset with every setting the record states (batch, sequence, dtypes, "
             "checkpointing, compile, router, FP8, loss, backends, optimizer, layout, its `--set` overrides; "
             "records from before backend.loss ran the full loss), rebuilt by "
             "`moelab.gallery.records.rebuild_config`, as the code of its day ran it (a record older than a code "
             "change gets the planner option of its day: `moelab.gallery.records.planner_options`; its note says "
             "so). A record that timed the learned router beside a fake-gate "
             "headline is planned with the learned router, whose run its peak covers (router column: \"+ learned "
             "beside\"). A note names what the record shows about a miss (`moelab.gallery.memory.miss_causes`).",
             "", "| workload (result file) | GPUs | router | planned GiB | measured peak GiB | measured / planned | "
             f"error | within {MEMORY_TARGET:.0%} | planner's biggest term | note |",
             "|---|---|---|---:|---:|---:|---:|---|---|---|"]
    mem_rows, misses, unexplained, left_out = [], 0, [], []
    for r in results:
        if r.get("system") != "moelab" or not r.get("peak_memory_gb"):
            continue
        cfg, why = rebuild_config(r, by_name)
        if cfg is None:
            left_out.append(f"- {r['_file']}: {why}")
            continue
        cfg, beside = _peak_config(r, cfg)
        try:
            p = plan(cfg, gpus=int(r.get("gpus", 1)), gpu_memory_gb=gpu_memory_of(r.get("gpu_name")),
                     **planner_options(r))
        except (ConfigError, KeyError, TypeError, ValueError) as e:
            left_out.append(f"- {r['_file']}: its config does not plan ({str(e)[:160]})")
            continue
        planned, measured = p.memory_per_gpu_bytes / 2**30, r["peak_memory_gb"]
        mem_rows.append((r["_file"].removesuffix(".json"), planned, measured))
        err = measured / planned - 1
        held = abs(err) <= MEMORY_TARGET
        causes = miss_causes(r, p)
        misses += not held
        if not held and not causes:
            unexplained.append(r["_file"])
        router = str(router_of(r, by_name)) + (" + learned beside" if beside else "")
        lines.append(f"| {r['workload']} ({r['_file']}) | {r.get('gpus')} x {r.get('gpu_name')} | {router} | "
                     f"{planned:,.2f} | {measured:,.2f} | {measured / planned:.2f} | {err:+.1%} | "
                     f"{'yes' if held else 'NO'} | {p.biggest_term} | {'; '.join(day_notes(r, p) + causes) or '-'} |")
    if not mem_rows:
        lines.append("| (no result with a measured peak memory yet) | | | | | | | | | |")
    else:
        ratios = [m / p for _, p, m in mem_rows]
        lines += ["", f"Measured / planned over these {len(ratios)} runs: {min(ratios):.2f} to {max(ratios):.2f}; "
                  f"{len(ratios) - misses} of {len(ratios)} within the {MEMORY_TARGET:.0%} target (error = measured "
                  "/ planned - 1); "
                  + (f"misses without a cause the record shows: {', '.join(unexplained)}." if unexplained else
                     ("the miss has its cause in its note." if misses == 1 else
                      f"each of the {misses} misses has its cause in its note.") if misses else "no miss.")]
    named = [f"{commit} ({landed[:10]}): {DAY_NOTES[key][0]}." for key, _, commit, landed in CODE_BEFORE
             if key in DAY_NOTES and any(f"before {commit}" in line for line in lines)]
    if named:
        lines += ["", "Code changes the notes name (a record measured before one ran other code than moelab's "
                  "today, and is planned as that code ran): " + " ".join(named)]
    if left_out:
        lines += ["", "Records with a measured peak that are not planned (their config cannot be rebuilt "
                  "faithfully):", "", *left_out]
    lines.append("")
    return lines, mem_rows
