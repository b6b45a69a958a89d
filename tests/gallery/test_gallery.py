"""The benchmark gallery: entries match the reference table, the report renders and marks what was not run,
`gallery run` refuses what the hardware cannot do and runs a CPU entry end to end."""
import json

import pytest
import torch

from moelab.cli import main
from moelab.gallery import (RESULT_FIELDS, GalleryError, get_entry, load_entries, render_report,
                            run_entry)
from moelab.planner.plan import plan, resolve_loss
from moelab.presets import preset_names

# The reference table (../shared/seeds: DGX H100, BF16), transcribed independently of gallery/entries:
# entry -> (GPUs, global batch, [TP,PP,CP,EP,VP,FSDP], optimisations, TFLOPs/s/GPU, tokens/s/GPU)
REFERENCE = {
    "deepseek-v3-256gpu": (256, 512, "[1,4,1,64,8,64]", "TE + DeepEP", 250, 1002),
    "deepseek-v3-1024gpu": (1024, 8192, "[1,4,1,64,8,256]", "TE + DeepEP", 216, 865),
    "kimi-k2-256gpu": (256, 512, "[1,8,1,32,4,32]", "TE + DeepEP", 189, 924),
    "qwen3-moe-30b-a3b-8gpu": (8, 512, "[1,1,1,8,-,8]", "TE + DeepEP", 277, 12040),
    "gpt-oss-20b-8gpu": (8, 256, "[1,1,1,-,-,8]", "TE + DeepEP + FlexAttn", 279, 13058),
    "gpt-oss-120b-64gpu": (64, 512, "[1,1,1,-,-,64]", "TE + DeepEP + FlexAttn", 231, 7626),
}


def test_entries_match_the_reference_table():
    entries = {e.name: e for e in load_entries()}
    published = {n: e for n, e in entries.items() if e.published}
    assert set(published) == set(REFERENCE)
    for name, (gpus, gbs, layout, opts, tflops, tokens) in REFERENCE.items():
        e = published[name]
        assert (e.gpus, e.global_batch_size, e.layout_text, e.optimizations) == (gpus, gbs, layout, opts)
        assert (e.published["tflops_per_gpu"], e.published["tokens_per_s_per_gpu"]) == (tflops, tokens)
        L = e.layout
        assert L["tp"] * L["pp"] * L["cp"] * L["fsdp"] == e.gpus
    proxies = [e for e in entries.values() if e.proxy_of]
    assert proxies and all(e.proxy_of in published for e in proxies)
    assert all(e.preset.endswith("-proxy") for e in proxies)
    assert "tiny-cpu" in entries and entries["tiny-cpu"].device == "cpu"


def test_every_entry_with_a_preset_plans_on_its_layout():
    for e in load_entries():
        if e.preset not in preset_names():
            continue
        p = plan(e.config(), gpus=e.gpus, gpu_memory_gb=80)
        assert p.gpus == e.gpus
        assert {k: p.layout[k] for k in e.layout} == e.layout


def _result(system, workload, **kw):
    d = {"system": system, "workload": workload, "gpus": 1, "gpu_name": "NVIDIA H200",
         "tokens_per_s_per_gpu": 1234.0, "tflops_per_gpu": 56.7, "peak_memory_gb": 3.5,
         "flops_convention": "test", "command": "synthetic", "commit": "abc", "torch_version": "2.11",
         "date": "2026-11-30T00:00:00+00:00"}
    d.update(kw)
    return d


def test_report_renders_from_results_and_marks_missing(gallery):
    (gallery / "results" / "a.json").write_text(json.dumps(_result("moelab", "tiny-cpu", gpu_name="cpu")))
    entry = get_entry("qwen3-moe-30b-a3b-proxy-1gpu", gallery)  # b ran its defaults: a row of the peers table
    today_loss = resolve_loss(entry.config().replace(**{"backend.loss": "auto"}), gpus=1, gpu_memory_gb=140.0)
    (gallery / "results" / "b.json").write_text(json.dumps(_result(
        "moelab", entry.name, tokens_per_s_per_gpu=31415.0, tflops_per_gpu=271.8, compile=True,
        optimizer="TritonAdamW", loss=today_loss, router="learned")))
    (gallery / "results" / "c.json").write_text(json.dumps(_result(
        "hf-transformers", "qwen3-moe-30b-a3b-proxy-1gpu", tokens_per_s_per_gpu=27182.0)))
    (gallery / "results" / "d.json").write_text(json.dumps(_result(  # a bench run of a preset, not an entry
        "moelab", "qwen3-moe-30b-a3b-proxy", peak_memory_gb=58.25, global_batch_size=2, micro_batch_size=2,
        seq_len=4096, dtype="bfloat16", param_dtype="bfloat16", layout={"tp": 1, "pp": 1, "cp": 1, "ep": 1, "vp": 1, "fsdp": 1})))
    (gallery / "results" / "notes.json").write_text("[1, 2]")  # not a result: ignored
    text = render_report(gallery)
    assert (gallery / "README.md").read_text() == text
    table = text.split("## Peers")[0]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert "31,415" in rows["qwen3-moe-30b-a3b-proxy-1gpu"] and "271.8" in rows["qwen3-moe-30b-a3b-proxy-1gpu"]
    assert "not run here: needs 256" in rows["deepseek-v3-256gpu"]
    assert "12,040" in rows["qwen3-moe-30b-a3b-8gpu"] and "not run here" in rows["qwen3-moe-30b-a3b-8gpu"]
    assert "not run here" in rows["gpt-oss-20b-proxy-1gpu"]
    peers = text.split("## Peers")[1].split("## Planned")[0]
    assert "hf-transformers" in peers and "27,182" in peers and "31,415" in peers
    memory = text.split("## Planned vs measured memory")[1]
    assert "tiny-cpu" in memory and "3.50" in memory
    preset_row = [line for line in memory.splitlines() if line.startswith("| qwen3-moe-30b-a3b-proxy (d.json)")]
    assert preset_row and "58.25" in preset_row[0]
    assert (gallery / "tflops.png").stat().st_size > 0 and (gallery / "memory.png").stat().st_size > 0


def test_report_without_results_invents_nothing(gallery):
    text = render_report(gallery, plots=False)
    table = text.split("## Peers")[0]
    measured_cols = [line.split(" | ")[8:12] for line in table.splitlines() if line.startswith("| ") and
                     not line.startswith("| entry") and not line.startswith("|---")]
    assert measured_cols and all(cols == ["-", "-", "-", "-"] for cols in measured_cols)
    assert "No peer results yet" in text


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine could run it")
def test_run_refuses_multi_gpu_entry_without_gpus(gallery, capsys):
    with pytest.raises(GalleryError, match="needs 2 CUDA GPU"):
        run_entry("qwen3-moe-30b-a3b-proxy-ep2", root=gallery)
    assert main(["gallery", "run", "deepseek-v3-256gpu", "--dir", str(gallery)]) == 2
    err = capsys.readouterr().err
    assert "needs 256 CUDA GPU(s)" in err and "proxy" in err
    assert list((gallery / "results").iterdir()) == []
    with pytest.raises(GalleryError, match="did you mean"):
        get_entry("tiny-cpy", gallery)


def test_tiny_cpu_entry_runs_end_to_end(gallery, tmp_path, capsys):
    assert main(["gallery", "run", "tiny-cpu", "--steps", "3", "--warmup", "1", "--dir", str(gallery),
                 "--out", str(tmp_path / "run")]) == 0
    said = capsys.readouterr().out.strip()  # issue 42.18: where the result went, in one line (not its JSON)
    assert said.count("\n") == 0 and str(gallery / "results" / "tiny-cpu--moelab.json") in said, said
    assert "tokens/s per rank" in said
    result = json.loads((gallery / "results" / "tiny-cpu--moelab.json").read_text())
    for key in RESULT_FIELDS:
        assert key in result, key
    assert result["system"] == "moelab" and result["workload"] == "tiny-cpu" and result["gpus"] == 1
    assert result["tokens_per_s_per_gpu"] > 0 and result["torch_version"] == torch.__version__
    assert result["command"].startswith("moelab gallery run tiny-cpu")
    assert main(["gallery", "list", "--dir", str(gallery)]) == 0
    listed = [x for x in capsys.readouterr().out.splitlines() if x.startswith("tiny-cpu ")][0]
    assert "measured" in listed and "router learned" in listed
    assert main(["gallery", "report", "--dir", str(gallery), "--no-plots"]) == 0
    row = [l for l in (gallery / "README.md").read_text().splitlines() if l.startswith("| tiny-cpu |")][0]
    assert "not run here" not in row and f"{result['tokens_per_s_per_gpu']:,.0f}" in row


def test_bad_gallery_folder(tmp_path):
    with pytest.raises(GalleryError, match="no entries"):
        load_entries(tmp_path)
    (tmp_path / "entries").mkdir()
    (tmp_path / "entries" / "x.yaml").write_text("name: x\ntitle: x\npreset: tiny\ngpus: 1\nlayout: {tp: 1}\n"
                                                 "colour: red\n")
    with pytest.raises(GalleryError, match="unknown keys"):
        load_entries(tmp_path)


@pytest.mark.slow
def test_two_process_entry_runs_through_the_rank_entry(gallery, tmp_path):
    """The multi-GPU path (moelab's local launcher, the one rank entry point in its bench mode) on two CPU
    processes with gloo."""
    (gallery / "entries" / "tiny-cpu-ep2.yaml").write_text(
        "name: tiny-cpu-ep2\ntitle: tiny EP=2 on CPU\npreset: tiny\ngpus: 2\ndevice: cpu\n"
        "layout: {tp: 1, pp: 1, cp: 1, ep: 2, vp: 1, fsdp: 2}\n"
        "overrides: {backend.fake_balanced_gate: true}\n")
    result = run_entry("tiny-cpu-ep2", steps=2, warmup=1, out=tmp_path / "run", root=gallery)
    assert result["gpus"] == 2 and result["layout"]["ep"] == 2 and result["tokens_per_s_per_gpu"] > 0
    # a fake-gate entry: the learned router is the headline, the fake gate timed beside it and labelled
    assert result["router"] == "learned" and result["fake_router"]["router"] == "fake_balanced"
    assert json.loads((gallery / "results" / "tiny-cpu-ep2--moelab.json").read_text())["workload"] == "tiny-cpu-ep2"
    assert sorted(p.name for p in (tmp_path / "run" / "logs").iterdir()) == ["rank0.err", "rank0.out", "rank1.err",
                                                                           "rank1.out"]


def test_a_bench_run_of_the_same_config_counts_for_its_entry(gallery):
    """A `moelab bench` record of the entry's preset with the entry's settings fills the entry's row; one with
    other settings (here a larger global batch) does not."""
    cfg = get_entry("qwen3-moe-30b-a3b-proxy-1gpu", gallery).config()
    same = dict(global_batch_size=cfg.train.global_batch_size, micro_batch_size=cfg.train.micro_batch_size,
                seq_len=cfg.train.seq_len, dtype=cfg.train.dtype, param_dtype=cfg.train.param_dtype,
                activation_checkpointing=cfg.train.activation_checkpointing, compile=cfg.train.compile,
                router="learned", layout={"ep": 1})
    (gallery / "results" / "other.json").write_text(json.dumps(_result(
        "moelab", "qwen3-moe-30b-a3b-proxy", **{**same, "global_batch_size": 16}, tokens_per_s_per_gpu=99999.0)))
    text = render_report(gallery, plots=False)
    row = [l for l in text.splitlines() if l.startswith("| qwen3-moe-30b-a3b-proxy-1gpu |")][0]
    assert "not run here" in row and "99,999" not in row
    (gallery / "results" / "same.json").write_text(json.dumps(_result(
        "moelab", "qwen3-moe-30b-a3b-proxy", **same, tokens_per_s_per_gpu=44444.0)))
    text = render_report(gallery, plots=False)
    row = [l for l in text.splitlines() if l.startswith("| qwen3-moe-30b-a3b-proxy-1gpu |")][0]
    assert "44,444" in row and "same.json" in row
    ep2 = [l for l in text.splitlines() if l.startswith("| qwen3-moe-30b-a3b-proxy-ep2 |")][0]
    assert "not run here" in ep2
    # a newer A/B arm that ran other than today's code (clipping's multiply as its own pass) is not the row
    (gallery / "results" / "arm.json").write_text(json.dumps({**_result(
        "moelab", "qwen3-moe-30b-a3b-proxy-1gpu", **same, tokens_per_s_per_gpu=33333.0),
        "grad_clip": 1.0, "clip_in_update": False, "date": "2099-01-01T00:00:00Z"}))
    row = [l for l in render_report(gallery, plots=False).splitlines()
           if l.startswith("| qwen3-moe-30b-a3b-proxy-1gpu |")][0]
    assert "44,444" in row and "33,333" not in row


def test_speed_tables_render_from_the_result_files(gallery):
    """The predicted-vs-measured table has a row per 1- or 2-GPU moelab record on a known GPU, with the record's
    figure and the model's; the published table has the six reference rows; editing a file changes the table."""
    from moelab.config import load_config
    from moelab.gallery.records import planner_options
    from moelab.planner.plan import plan as plan_of

    rec = _result("moelab", "qwen3-moe-30b-a3b-proxy", tokens_per_s_per_gpu=40000.0, global_batch_size=2,
                  micro_batch_size=2, seq_len=4096, dtype="bfloat16", param_dtype="bfloat16", compile=True,
                  date="2026-12-02T00:00:00+00:00")  # after the loss and optimizer defaults changed
    (gallery / "results" / "s.json").write_text(json.dumps(rec))
    (gallery / "results" / "cpu.json").write_text(json.dumps(_result("moelab", "tiny-cpu", gpu_name="cpu")))
    (gallery / "results" / "bare.json").write_text(json.dumps(_result("moelab", "qwen3-moe-30b-a3b-proxy")))
    speed = render_report(gallery, plots=False).split("## Predicted vs measured throughput")[1]
    measured, published = speed.split("## Predicted vs published")
    row = [x for x in measured.splitlines() if x.startswith("| s |")][0].split(" | ")
    # planned as the code of its day ran (moelab.gallery.records.CODE_BEFORE: torch's gradient norm then)
    assert planner_options(rec)["grad_norm"] == "torch"
    predicted = plan_of(load_config("qwen3-moe-30b-a3b-proxy", {"train.compile": True, "train.param_dtype": "bfloat16"}),
                        gpus=1, gpu="h200", **planner_options(rec)).speed.tokens_per_s_per_gpu
    assert row[3] == "40,000" and row[4] == f"{predicted:,.0f}" and row[5] == f"{predicted / 40000:.2f}"
    assert row[2] == "learned (inferred)"  # the record predates the router field: its preset's default
    assert "not predicted: the record lacks" in [x for x in measured.splitlines() if x.startswith("| bare |")][0]
    assert "| cpu |" not in measured  # a CPU run is no GPU record
    rows = [x for x in published.splitlines() if x.startswith("| ") and not x.startswith("| entry")]
    assert {x.split(" | ")[0].lstrip("| ") for x in rows} == set(REFERENCE)
    assert all(x.split(" | ")[3] == f"{REFERENCE[x.split(' | ')[0].lstrip('| ')][5]:,}" for x in rows)
    (gallery / "results" / "s.json").write_text(json.dumps({**rec, "tokens_per_s_per_gpu": 80000.0}))
    again = render_report(gallery, plots=False).split("## Predicted vs published")[0]
    assert f"| 80,000 | {predicted:,.0f} | {predicted / 80000:.2f} |" in again
