"""The typed events: every kind round-trips through JSON, unknown fields are kept, a newer schema and
malformed events are refused, and a stream holding every kind reads back the same through every reader."""
from __future__ import annotations

import json

import pytest

from moelab.contract.events import (EVENTS, SCHEMA_VERSION, CheckpointEvent, ControlEvent, EndEvent,
                                    ErrorEvent, EvalEvent, Health, Memory, MetricsError, RankMemory, Routing,
                                    RunEnv, StartEvent, StepEvent, WarningEvent, parse_event)
from moelab.contract.stream import MetricsWriter, read_events, scan_events, tail_events

CONFIG = {"name": "every-kind", "train": {"steps": 3}}


def step(n: int, loss: float) -> StepEvent:
    return StepEvent(step=n, loss=loss, grad_norm=0.5, lr=1e-3, aux_loss=0.01, z_loss=0.001, tokens=64,
                     step_time_s=0.1, tokens_per_s=640.0, tokens_per_s_per_gpu=640.0, tflops_per_gpu=0.001, mfu=None,
                     comm={"dispatch_rows": 12},
                     routing=Routing(tokens_per_expert_ME=[[10, 6, 0, 0]], routed_per_expert_ME=[[12, 6, 0, 0]],
                                     dropped_tokens_M=[2.0], entropy_M=[0.7], logit_norm_M=[1.2],
                                     capacity_factor_M=[1.25]),
                     health=Health(dead_experts=[[0, 3]] if n == 3 else [], overloaded=[[0, 0, 0.67]]),
                     memory=Memory(peak_allocated_gb=0.0, peak_reserved_gb=0.0, rss_gb=0.5, max_peak_allocated_gb=0.6,
                                   per_rank=[RankMemory(0, 0.0, 0.0, 0.5), RankMemory(1, 0.0, 0.0, 0.6)]))


def every_kind() -> list:
    """A run's stream with one or more events of every kind, in a plausible order."""
    return [
        StartEvent(config=CONFIG, total_steps=3, start_step=0, flops_per_token=1e6, flops_convention="6N",
                   total_params=1000, activated_params=400,
                   env=RunEnv(torch="2.13", python="3.11", host="h", device="cpu", gpu_name="cpu", world_size=2,
                              layout={"ep": 2}, pid=42, slurm_job_id=None)),
        step(1, 3.0),
        ControlEvent(step=1, field="train.lr", old=1e-3, new=5e-4, who="notebook"),
        step(2, 2.5),
        EvalEvent(step=2, loss=2.6, perplexity=13.46, batches=2, tokens=128),
        CheckpointEvent(step=2, path="checkpoints/step_000002"),
        step(3, 2.0),
        WarningEvent(step=3, kind="dead_expert", layer=0, expert=3, message="MoE layer 0: expert 3 ..."),
        ErrorEvent(step=3, rank=1, message="RuntimeError: boom", traceback="Traceback ...\nRuntimeError: boom"),
        EndEvent(step=3, status="PREEMPTED", summary={"name": "every-kind", "final_loss": 2.0}),
    ]


def test_every_kind_round_trips_and_the_schema_is_the_code():
    assert set(EVENTS) == {"start", "step", "eval", "warning", "checkpoint", "end", "error", "control"}
    for ev in every_kind():
        line = json.loads(json.dumps(ev.to_json()))
        assert line["event"] == ev.EVENT and line["schema"] == SCHEMA_VERSION
        assert parse_event(line) == ev
    w = WarningEvent(step=1, kind="preempted", message="stop").to_json()
    assert "layer" not in w and "expert" not in w  # only the kinds that have them
    assert StepEvent(step=1).to_json()["mfu"] is None  # null where unknown, the key always there
    assert step(1, 1.0).to_json()["routing"]["tokens_per_expert"] == [[10, 6, 0, 0]]  # the schema's keys on disk


def test_unknown_fields_are_kept_and_written_back():
    line = {**step(1, 1.0).to_json(), "new_metric": 7}
    line["routing"]["experts_seen"] = [4]
    ev = parse_event(line)
    assert ev.extra == {"new_metric": 7} and ev.routing.extra == {"experts_seen": [4]}
    assert ev.to_json() == line


@pytest.mark.parametrize("bad, why", [
    ({"event": "step", "loss": 1.0}, "without an integer step"),
    ({"event": "step", "step": "3"}, "without an integer step"),
    ({"event": "checkpoint", "step": True, "path": "x"}, "without an integer step"),
    ({"event": "eval", "step": 2.5}, "without an integer step"),
    ({"event": "step", "step": 1, "routing": [1, 2]}, "routing is list, not an object"),
    ({"event": "start", "config": "tiny"}, "config is str, not an object"),
    ({"event": "end", "step": 3, "status": "STOPPED"}, "not one of"),
    ({"event": "control", "step": 3}, "without 'field'"),
    ({"event": "step", "step": 1, "schema": SCHEMA_VERSION + 1}, "newer than this moelab reads"),
    ({"event": "progress", "step": 1}, "not a moelab event"),
])
def test_malformed_events_are_refused_with_the_reason(bad, why):
    with pytest.raises(MetricsError, match=why):
        parse_event(bad)


def test_end_statuses_are_what_the_trainer_writes():
    for status in ("COMPLETED", "PREEMPTED", "CANCELLED"):
        assert parse_event(EndEvent(step=1, status=status).to_json()).status == status


# ---------------------------------------------------------------------- every reader
@pytest.fixture
def stream_folder(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.yaml").write_text("name: every-kind\n")
    w = MetricsWriter(folder / "metrics.jsonl")
    written = every_kind()
    for ev in written:
        w.emit(ev)
    return folder, written


def test_every_kind_reads_back_through_every_reader(stream_folder, capsys):
    from moelab.cli import main
    from moelab.live.state import load_state
    from moelab.loggers.mirror import scalars
    from moelab.run.run import Run
    from moelab.config import load_config
    from moelab.contract.summary import summarize

    stream_folder, written = stream_folder
    path = stream_folder / "metrics.jsonl"
    # the stream module's readers: all of it, typed or as JSON, from the end, line by line
    assert read_events(path, typed=True) == written
    assert read_events(path) == [e.to_json() for e in written]
    assert scan_events(path) == written
    last, head = tail_events(path)
    assert last == written and head == []
    # Run: table, evals, summary, error, progress, status (an external run: the stream decides)
    run = Run.load(stream_folder)
    metrics = run.metrics
    assert list(metrics["step"]) == [1, 2, 3] and list(metrics["loss"]) == [3.0, 2.5, 2.0]
    assert list(metrics["memory.max_peak_allocated_gb"]) == [0.6] * 3
    assert run.evals.to_dict("records") == [{"step": 2, "loss": 2.6, "perplexity": 13.46, "batches": 2, "tokens": 128}]
    assert run.summary == {"name": "every-kind", "final_loss": 2.0}
    assert run.error.startswith("rank 1 at step 3: RuntimeError: boom\nTraceback")
    assert run.routing().tolist() == [[[10, 6, 0, 0]]] * 3
    assert run.progress()["step"] == 3 and run.progress()["total_steps"] == 3 and run.status == "PREEMPTED"
    # the dashboard's state
    st = load_state(stream_folder)
    assert st.steps == [1, 2, 3] and st.loss == [3.0, 2.5, 2.0] and st.total_steps == 3
    assert st.eval_steps == [2] and st.eval_loss == [2.6] and st.device == "cpu"
    assert [w.kind for w in st.warnings] == ["dead_expert"] and st.errors[0].rank == 1
    assert st.controls == [written[2]] and st.event_status == "PREEMPTED" and st.summary["final_loss"] == 2.0
    assert st.memory_peak_R == [0.5, 0.6] and st.routing_total_ME == [[36.0, 18.0, 0.0, 0.0]]
    assert st.health.dead_experts == [[0, 3]] and st.mfu_text() == "n/a on CPU: no peak FLOP/s"
    # the summary, from the typed step events
    cfg = load_config("tiny")
    summary = summarize(cfg, [e for e in written if isinstance(e, StepEvent)], "PREEMPTED", evals=[written[4]])
    assert summary["final_loss"] == 2.0 and summary["dropped_tokens"] == 6.0 and summary["eval_loss"] == 2.6
    # the TensorBoard / W&B export's scalars
    assert scalars(written[1])["train/loss"] == 3.0 and scalars(written[4]) == {"eval/loss": 2.6,
                                                                               "eval/perplexity": 13.46}
    assert scalars(written[2]) == {}
    # `moelab status`
    assert main(["status", str(stream_folder)]) == 0
    out = capsys.readouterr().out
    assert "[PREEMPTED]  step 3/3  loss 2.0000" in out
