"""The metrics stream: schema of a real run, routing sums, partial and corrupt lines."""
import json

import pytest

from moelab.config import load_config
from moelab.train.metrics import JsonlTail, MetricsError, MetricsWriter, read_events
from moelab.train.trainer import Trainer

STEP_FIELDS = {"step", "loss", "aux_loss", "lr", "grad_norm", "tokens", "step_time_s", "tokens_per_s",
               "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "memory", "routing"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    cfg = load_config("tiny", ["train.steps=6", "model.moe.capacity_factor=1.0"])
    summary = Trainer(cfg, out).run()
    return cfg, out, summary


def test_run_folder_and_event_sequence(tiny_run):
    cfg, out, summary = tiny_run
    assert (out / "config.yaml").exists() and (out / "summary.json").exists()
    events = read_events(out / "metrics.jsonl")
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("step") == 6
    assert events[0]["config"]["model"]["moe"]["num_experts"] == 16
    assert all(e["schema"] == 1 for e in events)
    assert json.loads((out / "summary.json").read_text())["status"] == "COMPLETED"


def test_step_events_carry_the_schema_and_routing_sums(tiny_run):
    cfg, out, _ = tiny_run
    steps = [e for e in read_events(out / "metrics.jsonl") if e["event"] == "step"]
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    moe_layers = cfg.model.num_layers - cfg.model.num_dense_layers
    for e in steps:
        assert STEP_FIELDS <= e.keys()
        assert e["tokens"] == tokens and e["tokens_per_s_per_gpu"] == pytest.approx(e["tokens_per_s"])
        assert e["memory"]["rss_gb"] > 0 and len(e["memory"]["per_rank"]) == 1
        counts = e["routing"]["tokens_per_expert"]
        assert len(counts) == moe_layers and all(len(c) == cfg.model.moe.num_experts for c in counts)
        for layer, dropped in zip(counts, e["routing"]["dropped_tokens"]):
            # every assignment is either computed by an expert or dropped
            assert sum(layer) + dropped == tokens * cfg.model.moe.top_k
    assert any(sum(e["routing"]["dropped_tokens"]) > 0 for e in steps)  # capacity 1.0 drops some


def test_a_half_written_last_line_is_tolerated_only_live(tmp_path):
    path = tmp_path / "metrics.jsonl"
    w = MetricsWriter(path)
    w.write("start", total_steps=2)
    w.write("step", step=1, loss=1.0)
    w.close()
    with open(path, "a") as f:
        f.write('{"event": "step", "ste')
    assert [e["event"] for e in read_events(path, live=True)] == ["start", "step"]
    with pytest.raises(MetricsError, match="metrics.jsonl:3: truncated last line"):
        read_events(path)
    tail = JsonlTail(path)
    assert len(tail.poll()) == 2
    with open(path, "a") as f:
        f.write('p": 2, "loss": 0.5}\n')
    assert tail.poll()[0]["step"] == 2  # the partial line completed on the next poll


def test_a_corrupt_line_is_reported_with_its_number(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "start"}\nnot json at all\n{"event": "end"}\n')
    with pytest.raises(MetricsError, match="metrics.jsonl:2: not valid JSON"):
        read_events(path)
    tail = JsonlTail(path)
    assert [e["event"] for e in tail.poll()] == ["start", "end"]
    assert "metrics.jsonl:2" in tail.errors[0]
    path.write_text('{"what": 1}\n')
    with pytest.raises(MetricsError, match="not a moelab event"):
        read_events(path)
