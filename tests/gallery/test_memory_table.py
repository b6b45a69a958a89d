"""gallery/README.md's planned-vs-measured memory table is what `moelab gallery report` renders from
gallery/results/*.json with this checkout's planner (regenerated, never typed), every row says its error against
the 7% target, and each row plans the config its record ran (moelab.gallery.records.rebuild_config): the record's
loss, FP8 recipe, compile flag, router and overrides, not its entry's settings of today."""
import json
import shutil

from moelab.gallery import MEMORY_TARGET, default_root, load_entries, load_results, render_report
from moelab.gallery.records import planner_options, rebuild_config


def _memory(text: str) -> str:
    return text.split("## Planned vs measured memory")[1].split("\n## ")[0].strip()


def _rows(section: str) -> dict:
    """{result file: the row's cells} of a rendered memory section."""
    out = {}
    for line in section.splitlines():
        if line.startswith("| ") and ".json)" in line:
            cells = [c.strip() for c in line.strip("|").split("|")]
            out[cells[0].split("(")[-1].rstrip(")")] = cells
    return out


def test_the_committed_memory_table_is_rendered_from_the_result_files(tmp_path):
    root = tmp_path / "gallery"
    for folder in ("entries", "results"):
        shutil.copytree(default_root() / folder, root / folder)
    rendered = _memory(render_report(root, plots=False))
    committed = _memory((default_root() / "README.md").read_text())
    assert committed == rendered, "gallery/README.md is stale: run `moelab gallery report`"
    rows = _rows(rendered)
    with_peak = {r["_file"] for r in load_results(root) if r.get("system") == "moelab" and r.get("peak_memory_gb")}
    listed = {line.split(":")[0].lstrip("- ") for line in rendered.splitlines() if line.startswith("- ")}
    assert rows and set(rows) | listed == with_peak and not set(rows) & listed  # each record: planned or listed
    unexplained = rendered.split("misses without a cause the record shows: ")[-1] if "without a cause" in rendered \
        else ""
    for file, cells in rows.items():
        # | workload | GPUs | router | planned | measured | measured / planned | error | within | biggest | note |
        planned, measured, err, within = float(cells[3].replace(",", "")), float(cells[4].replace(",", "")), \
            cells[6], cells[7]
        assert abs(float(err.rstrip("%")) / 100 - (measured / planned - 1)) < 1e-3, file
        assert within == ("yes" if abs(measured / planned - 1) <= MEMORY_TARGET else "NO"), file
        assert within == "yes" or cells[9] != "-" or file in unexplained, file  # a miss names a cause or is listed


# 4 sequences a micro batch: the forward/backward peak (activations, the loss's logits) lies above the optimizer
# step's, so that the records' losses show in their planned peaks
BASE = {"system": "moelab", "workload": "qwen3-moe-30b-a3b-proxy", "gpus": 1, "gpu_name": "NVIDIA H200",
        "tokens_per_s_per_gpu": 1000.0, "peak_memory_gb": 50.0, "global_batch_size": 4, "micro_batch_size": 4,
        "seq_len": 4096, "dtype": "bfloat16", "param_dtype": "bfloat16", "compile": True, "fp8": "off",
        "router": "learned", "loss": "chunked", "command": "synthetic", "commit": "abc",
        "date": "2026-12-07T16:00:00Z"}


def _render(gallery, records: dict) -> dict:
    for name, changes in records.items():
        (gallery / "results" / f"{name}.json").write_text(json.dumps({**BASE, **changes}))
    text = _memory(render_report(gallery, plots=False))
    return {f.removesuffix(".json"): float(c[3].replace(",", "")) for f, c in _rows(text).items()}, text


def test_each_row_plans_what_its_record_ran(gallery):
    planned, text = _render(gallery, {
        "chunked": {}, "full": {"loss": "full"}, "cce": {"loss": "cce"}, "eager": {"compile": False},
        "fp8-accumulating": {"fp8": "rowwise", "global_batch_size": 16},
        "bf16-accumulating": {"global_batch_size": 16},
        "before-backend-loss": {"loss": None},  # records from before backend.loss ran the full loss
        "fake-gate": {"router": None, "fake_balanced_gate": True},
        "fake-gate-learned-beside": {"router": None, "fake_balanced_gate": True, "real_router": {"step_time_ms": 1}},
        "entry-run-eager": {"workload": "qwen3-moe-30b-a3b-proxy-1gpu", "compile": False, "loss": None},
        "mystery": {"workload": "no-such-model"}})
    assert planned["full"] > planned["chunked"] > planned["cce"]
    assert planned["eager"] > planned["chunked"]  # eager blocks keep what inductor recomputes
    assert planned["fp8-accumulating"] > planned["bf16-accumulating"]  # the FP8 expert weight cache
    assert planned["before-backend-loss"] == planned["full"]
    assert planned["fake-gate"] < planned["fake-gate-learned-beside"] == planned["chunked"]
    assert planned["entry-run-eager"] > planned["full"]  # its entry compiles now; the record ran eager
    assert "mystery" not in planned and "mystery.json: it names neither a gallery entry nor a preset" in text


def test_rebuild_takes_the_records_settings_over_its_entrys():
    entries = {e.name: e for e in load_entries()}
    entry = entries["qwen3-moe-30b-a3b-proxy-1gpu"].config()
    assert entry.train.compile and entry.backend.loss == "auto"
    record = {**BASE, "workload": "qwen3-moe-30b-a3b-proxy-1gpu", "compile": False, "loss": "full (as then)",
              "fp8": "rowwise", "micro_batch_size": 1, "optimizer": "TritonAdamW",
              "command": "moelab bench x --set model.moe.top_k=4 --set train.steps=9"}
    cfg, why = rebuild_config(record, entries)
    assert why == "" and not cfg.train.compile and cfg.backend.loss == "full" and cfg.train.fp8 == "rowwise"
    assert cfg.train.micro_batch_size == 1 and cfg.train.optimizer == "adamw_triton" and cfg.model.moe.top_k == 4
    assert rebuild_config(BASE, entries)[0] is not None  # a preset's run on one GPU: no layout needed
    cfg, why = rebuild_config({k: v for k, v in BASE.items() if k != "param_dtype"}, entries)
    assert cfg is None and "lacks param_dtype" in why  # a script's variant that does not say its dtypes


def test_a_record_from_before_lean_fsdp_is_planned_as_its_code_wrapped(gallery):
    """EP over both GPUs (the experts on a one-rank expert-FSDP mesh): a record measured before 6131a2c is planned
    with FSDP2 wrapping that mesh, as its code did (planner_options, by its date), and its note says so; the same
    record measured since plans today's code. Only the date decides."""
    two = {"gpus": 2, "global_batch_size": 8, "layout": {"tp": 1, "pp": 1, "cp": 1, "ep": 2, "vp": 1, "fsdp": 2}}
    old_date = "2026-11-30T10:00:00Z"
    assert planner_options({"date": old_date}) == {"fsdp_one_rank": "wrapped", "local_weighting": "combine",
                                                  "sonic_wgrad": "autograd", "sonic_tiles": "quack",
                                                  "grad_norm": "torch", "into_grad": "autograd",
                                                  "expert_norm": "pass", "full_loss": "compiled",
                                                  "clip_multiply": "pass"}
    assert planner_options(BASE) == planner_options({}) == {}
    # a record of today's code timed with the norm's own pass (gpu_perf's bf16-norm-pass)
    assert planner_options({**BASE, "norm_in_gemms": False}) == {"expert_norm": "pass"}
    # ... and with the compiled full loss beside its in-place kernel (gpu_perf's bf16-loss-compiled)
    assert planner_options({**BASE, "loss_in_place": False}) == {"full_loss": "compiled"}
    # ... and clipping with its multiply's own pass (gpu_perf's bf16-clip-pass)
    assert planner_options({**BASE, "grad_clip": 1.0, "clip_in_update": False}) == {"clip_multiply": "pass"}
    assert planner_options({**BASE, "grad_clip": 1.0, "clip_in_update": True}) == {}
    planned, text = _render(gallery, {"ep2-old": {**two, "date": old_date}, "ep2-new": two,
                                      "1gpu-old": {"date": old_date}, "1gpu-new": {}})
    assert planned["ep2-old"] > planned["ep2-new"]
    # one GPU: no FSDP2 then or now, but that code kept the expert outputs (local_weighting=combine)
    assert planned["1gpu-old"] > planned["1gpu-new"]
    rows = _rows(text)
    assert rows["ep2-old.json"][9] == ("planned with the FSDP2 wrapping of its day: its code (before 6131a2c) "
                                       "wrapped one-rank meshes too (the experts on the expert-FSDP mesh)")
    assert rows["ep2-new.json"][9] == rows["1gpu-new.json"][9] == "-"
    assert rows["1gpu-old.json"][9] == ("planned with the routing-weight placement of its day: its code (before "
                                        "a3f8c38) weighted the expert outputs at combine (the MoE layers on one rank)")
    assert "fsdp_one_rank=wrapped" in text  # the paragraph on the code change the note names
