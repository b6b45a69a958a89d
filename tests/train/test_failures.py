"""Failures end a run clearly: a non-finite loss stops it naming the step and the first parameter with a
non-finite gradient (or the step is skipped, when configured); a rank that raises leaves its traceback in an
`error` event and the run reads FAILED; bad data is refused; corrupt or truncated metrics lines are detected and
reported, never silently used (hypothesis over byte-level damage)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moelab.config import ConfigError, load_config
from moelab.run import Run
from moelab.contract.checkpoints import list_checkpoints
from moelab.contract.events import parse_event
from moelab.contract.stream import JsonlTail, MetricsError, MetricsWriter, read_events
from moelab.train.trainer import NonFiniteLoss, Trainer

SMALL = {"model.num_layers": 2, "train.seq_len": 16, "train.global_batch_size": 2, "train.micro_batch_size": 1,
         "train.device": "cpu"}
# Real divergence, no fault-injection knob: an absurd learning rate blows the weights up after one update.
DIVERGE = {"train.lr": 1e30, "train.warmup_steps": 0, "train.grad_clip": 0}


def _cfg(**extra):
    return load_config("tiny", {**SMALL, **extra})


def test_a_non_finite_loss_stops_the_run_naming_step_and_parameter(tmp_path):
    cfg = _cfg(**DIVERGE, **{"train.steps": 4, "train.checkpoint_every": 1})
    with pytest.raises(NonFiniteLoss, match="non-finite loss at step 2"):
        Trainer(cfg, tmp_path).run()
    error = read_events(tmp_path / "metrics.jsonl")[-1]
    assert error["event"] == "error" and error["step"] == 2 and error["rank"] == 0
    assert "First non-finite gradient: " in error["message"] and "NonFiniteLoss" in error["traceback"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000001"], "no checkpoint of a diverged state"
    run = Run.load(tmp_path)
    assert run.status == "FAILED" and "non-finite loss at step 2" in run.error
    print(f"\nRELIABILITY NaN stop: {error['message'][:120]}")


def test_on_nan_skip_skips_the_step_without_updating(tmp_path):
    cfg = _cfg(**DIVERGE, **{"train.steps": 4, "train.on_nan": "skip"})
    trainer = Trainer(cfg, tmp_path)
    summary = trainer.run()
    assert summary["status"] == "COMPLETED" and summary["skipped_steps"] == 3
    assert {int(s["step"]) for s in trainer.optimizer.state.values()} == {1}, "only step 1 updated the weights"
    steps = [e for e in read_events(tmp_path / "metrics.jsonl") if e["event"] == "step"]
    assert [e["skipped"] for e in steps] == [False, True, True, True]
    assert all(e["loss"] is None for e in steps[1:]), "non-finite values are written as null"


def test_a_token_file_with_out_of_range_ids_is_refused_before_training(tmp_path):
    """The whole file is scanned before any step (issue 21): the error names the field, the first bad id and its
    position, and the fix; no step runs."""
    data = tmp_path / "tokens.bin"
    np.full(4096, 60000, dtype=np.uint16).tofile(data)  # every id >= vocab_size 256
    cfg = _cfg(**{"data.kind": "tokens", "data.path": str(data), "train.steps": 2})
    with pytest.raises(ConfigError, match=r"data.path=.*token id 60000 at position 0 .*model.vocab_size=256"):
        Trainer(cfg, tmp_path / "run").run()
    assert not [e for e in read_events(tmp_path / "run/metrics.jsonl") if e["event"] == "step"]


def test_a_token_file_too_short_is_refused_before_training(tmp_path):
    data = tmp_path / "tokens.bin"
    np.arange(10, dtype=np.uint16).tofile(data)
    with pytest.raises(ConfigError, match="fewer than train.seq_len"):
        Trainer(_cfg(**{"data.kind": "tokens", "data.path": str(data)}), tmp_path / "run").run()
    assert not [e for e in read_events(tmp_path / "run/metrics.jsonl") if e["event"] == "step"]


# ---------------------------------------------------------------------- damaged metrics streams
def _stream(tmp_path, n: int) -> bytes:
    path = tmp_path / "m.jsonl"
    w = MetricsWriter(path)
    w.emit(parse_event(dict(event="start", total_steps=n, start_step=0)))
    for s in range(1, n + 1):
        w.emit(parse_event(dict(event="step", step=s, loss=1.0 / s, routing={"tokens_per_expert": [[s, s]]})))
    w.emit(parse_event(dict(event="end", step=n, status="COMPLETED", summary={})))
    w.close()
    return path.read_bytes()


HYPO = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def test_a_stream_cut_anywhere_is_a_clean_prefix_or_a_reported_cut(tmp_path):
    data = _stream(tmp_path, 6)
    full = read_events(tmp_path / "m.jsonl")
    path = tmp_path / "cut.jsonl"
    tried = []

    @HYPO
    @given(st.integers(0, len(data)))
    def check(k):
        tried.append(k)
        path.write_bytes(data[:k])
        complete = data[:k].count(b"\n")
        live = read_events(path, live=True)
        assert live == full[:complete], "live readers see exactly the complete lines"
        if k and data[k - 1:k] != b"\n":
            with pytest.raises(MetricsError, match="truncated last line"):
                read_events(path)
        else:
            assert read_events(path) == full[:complete]
        tail = JsonlTail(path)
        assert tail.poll() == full[:complete] and not tail.errors

    check()
    print(f"\nRELIABILITY metrics stream cut at {len(set(tried))} byte positions: every cut detected or clean")


def test_damaged_bytes_are_an_error_naming_the_line_never_a_crash(tmp_path):
    data = _stream(tmp_path, 6)
    path = tmp_path / "bad.jsonl"
    tally = [0, 0]

    @HYPO
    @given(st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(0, 255)), min_size=1, max_size=4))
    def check(edits):
        damaged = bytearray(data)
        for pos, byte in edits:
            damaged[pos] = byte
        path.write_bytes(bytes(damaged))
        tally[0] += 1
        try:
            events = read_events(path, live=True, strict=True)
        except MetricsError as e:
            tally[1] += 1
            assert f"{path}:" in str(e)  # names the file and line
        else:
            assert all(isinstance(e, dict) and "event" in e for e in events)
        tail = JsonlTail(path)
        tail.poll()  # never raises; bad lines go to tail.errors

    check()
    print(f"\nRELIABILITY damaged metrics streams: {tally[0]} tried, {tally[1]} reported as corrupt "
          f"(the rest still parse: a changed digit is valid JSON)")


@pytest.mark.parametrize("line, words", [
    (b'{"event": "step", "step": 3', "not valid JSON"),
    (b'[1, 2, 3]', "not a moelab event"),
    (b'{"event": "explode"}', "not a moelab event"),
    (b'{"event": "step", "schema": "1"}', "not a version number"),
    (b'{"event": "step", "schema": 99}', "newer than this moelab reads"),
    (b'\xff\xfe\x00', "not valid JSON"),
])
def test_a_corrupt_line_in_the_middle_is_reported_with_its_number(tmp_path, line, words):
    data = _stream(tmp_path, 3).split(b"\n")
    data.insert(2, line)
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(data))
    with pytest.raises(MetricsError, match=f"bad.jsonl:3: .*{words}"):
        read_events(path, strict=True)
    tail = JsonlTail(path)
    assert len(tail.poll()) == 5 and len(tail.errors) == 1 and ":3:" in tail.errors[0]


def test_a_tail_follows_a_rewound_stream_without_duplicates(tmp_path):
    from moelab.contract.stream import rewind_metrics

    data = _stream(tmp_path, 5)
    path = tmp_path / "m.jsonl"
    tail = JsonlTail(path)
    first = tail.poll()
    assert [e.get("step") for e in first if e["event"] == "step"] == [1, 2, 3, 4, 5]
    rewind_metrics(path, 3)  # what a resume from step 3 does
    w = MetricsWriter(path)
    w.emit(parse_event(dict(event="start", start_step=3)))
    w.emit(parse_event(dict(event="step", step=4, loss=0.5)))
    w.close()
    again = tail.poll()
    assert tail.rewinds == 1
    assert [(e["event"], e.get("step")) for e in again] == [("start", None), ("step", 4)]
    assert json.loads(data.split(b"\n")[0])["event"] == "start"
