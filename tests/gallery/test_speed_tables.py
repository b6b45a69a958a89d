"""The gallery's speed tables (moelab.gallery.speed): what a record ran is read from its fields and its date, a
prediction is compared only with a config that runs the same, a miss names a term, every published row is
either within its target or says which terms of moelab's step it likely does not pay."""
import pytest

from moelab.config import load_config
from moelab.gallery import load_entries
from moelab.gallery.records import record_settings
from moelab.gallery.speed import published_note, speed_section
from moelab.planner.plan import plan

PROXY = "qwen3-moe-30b-a3b-proxy"
NEW, OLD = "2026-12-02T00:00:00Z", "2026-11-30T00:00:00Z"


def record(name="r", **kw):
    d = {"_file": f"{name}.json", "system": "moelab", "workload": PROXY, "gpus": 1, "gpu_name": "NVIDIA H200",
         "tokens_per_s_per_gpu": 60000.0, "date": NEW}
    return {**d, **kw}


def test_record_settings_read_the_fields_and_the_code_of_the_records_day():
    assert record_settings(record(loss="chunked (the default at 5ad9062)", optimizer="TritonAdamW", fp8="rowwise")
                           ) == {"loss": "chunked", "optimizer": "adamw_triton", "fp8": "rowwise",
                                 "optimizer_overlap": "off"}
    assert record_settings(record(optimizer="auto: adamw_triton (the default at 5ad9062)"))["optimizer"] == \
        "adamw_triton"
    # the defaults then
    assert record_settings(record(date=OLD)) == {"loss": "full", "optimizer": "adamw", "optimizer_overlap": "off"}
    assert record_settings(record(date=OLD, loss="chunked"))["loss"] == "chunked"  # a field wins
    assert record_settings(record("x-triton-adamw-gbs2", date=OLD))["optimizer"] == "adamw_triton"
    assert record_settings(record("x-triton-adamw-gbs2", optimizer_overlap=False))["optimizer"] == "adamw_triton"
    assert record_settings(record("x-triton-adamw-gbs2", optimizer="AdamW"))["optimizer"] == "adamw"  # a field wins
    assert record_settings(record()) == {"optimizer_overlap": "off"}  # before train.optimizer_overlap
    today = "2026-12-06T15:00:00Z"
    assert record_settings(record(date=today)) == {}
    assert record_settings(record(date=today, optimizer_overlap=False)) == {"optimizer_overlap": "off"}
    assert record_settings(record(date=OLD, optimizer_overlap=True)) == {"loss": "full", "optimizer": "adamw",
                                                                        "optimizer_overlap": "auto"}


def table(records, planned):
    lines = speed_section(load_entries(), records, planned, ("global_batch_size",))
    rows = lines[:lines.index("## Predicted vs published throughput (reference table, H100)")]
    return [x for x in rows if x.startswith("| ")] + [x for x in rows if "records whose every term" in x]


def test_a_prediction_is_compared_only_with_a_config_that_runs_what_the_record_ran():
    def planned(rec, by_name, gpu):  # a rebuild that ignores the record's loss and optimizer
        return plan(load_config(PROXY, {"train.compile": True, "backend.loss": "full"}), gpus=1, gpu=gpu)
    rows = table([record("same", loss="full", optimizer="TritonAdamW"), record("other", loss="liger")], planned)
    same = [x for x in rows if x.startswith("| same |")][0]
    other = [x for x in rows if x.startswith("| other |")][0]
    assert same.split(" | ")[5] != "-" and "not compared" not in same  # a ratio
    assert "not compared: the rebuilt config runs loss=full where the record ran loss=liger" in other
    assert "1 not compared" in rows[-1]


def test_unmodelled_terms_are_named_and_kept_out_of_the_count():
    def planned(rec, by_name, gpu):
        return plan(load_config(PROXY, {"train.compile": True, "backend.loss": rec.get("loss", "full")}), gpus=1,
                    gpu=gpu)
    rows = table([record("lib", loss="cce"), record("mine", loss="full"), record("split", overlap_split_sms=16)],
                 planned)
    assert "not modelled: backend.loss=cce" in [x for x in rows if x.startswith("| lib |")][0]
    assert "not modelled: the update beside the forward on 16 SMs" in [x for x in rows if x.startswith("| split |")][0]
    assert " of 1 records whose every term is modelled" in rows[-1]
    assert "2 run something the model does not time" in rows[-1]


def test_a_two_gpu_miss_names_the_code_it_ran_and_the_overlap_it_is_credited_with():
    over = {"train.dtype": "bfloat16", "train.param_dtype": "bfloat16", "parallel.ep": 2, "parallel.fsdp": 2,
            "train.global_batch_size": 4, "backend.loss": "full", "train.optimizer": "adamw"}

    def planned(rec, by_name, gpu):
        return plan(load_config(PROXY, over), gpus=2, gpu=gpu)
    p = planned(None, None, "h200")
    rec = record("ep2", gpus=2, date=OLD, tokens_per_s_per_gpu=p.speed.tokens_per_s_per_gpu / 1.3)
    note = [x for x in table([rec], planned) if x.startswith("| ep2 |")][0]
    assert "1.30" in note and "ran before lean FSDP" in note and "one-rank meshes" in note
    assert "communication (all-to-all" in note


@pytest.mark.parametrize("name", ["deepseek-v3-256gpu", "gpt-oss-120b-64gpu"])
def test_a_published_miss_names_one_term_with_its_share_of_the_step(name):
    e = {x.name: x for x in load_entries()}[name]
    s = plan(e.config(), gpus=e.gpus, gpu="h100").speed
    note = published_note(s, ratio=0.5, bound=0.6)
    assert note.count("% of the step)") == 1 and "within 20%" not in note  # one term, with its share
    assert published_note(s, ratio=1.1, bound=1.2).startswith("within 20%")
    assert "the miss is the schedule" in published_note(s, ratio=0.5, bound=0.9)
    # predicted too fast: the term that crosses nodes at a rate published for a few nodes
    fast = published_note(s, ratio=1.3, bound=1.5)
    assert fast.startswith("predicted faster: ") and fast.count("% of the step)") == 1
    assert "InfiniBand rates published for a few nodes" in fast


def test_every_published_row_is_within_its_target_or_names_one_term():
    rows = [x for x in speed_section(load_entries(), [], lambda *a, **k: None, ())
            if x.startswith("| ") and x.split(" | ")[3].replace(",", "").isdigit()]
    assert len(rows) == 6
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        ratio, note = float(cells[5]), cells[-1]
        assert note.startswith("within 20%") == (abs(ratio - 1) <= 0.20), row
        if abs(ratio - 1) > 0.20:
            assert note.count("% of the step)") == 1, row  # the one term, with its share of the step
