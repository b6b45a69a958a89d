"""The metrics stream: schema of a real run, routing sums, partial and corrupt lines."""
import json

import pytest

from moelab.config import load_config
from moelab.contract.events import parse_event
from moelab.contract.stream import JsonlTail, MetricsError, MetricsWriter, read_events
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
    w.emit(parse_event(dict(event="start", total_steps=2)))
    w.emit(parse_event(dict(event="step", step=1, loss=1.0)))
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
        read_events(path, strict=True)
    tail = JsonlTail(path)
    assert [e["event"] for e in tail.poll()] == ["start", "end"]
    assert "metrics.jsonl:2" in tail.errors[0]
    path.write_text('{"what": 1}\n')
    with pytest.raises(MetricsError, match="not a moelab event"):
        read_events(path, strict=True)


# ---------------------------------------------------------------------- one damaged line in the middle
DAMAGE = {  # what a bad sector, a stray editor or a half-flushed copy leaves in the middle of the stream
    "garbage": b"\x00\x00\x00\x00",
    "cut json": b'{"event": "step", "schema": 1, "ste',
    "step lost its fields": b'{"event": "step", "schema": 1, "time": 1.0}',
    "memory not an object": b'{"event": "step", "schema": 1, "step": 3, "memory": [1, 2]}',
}


def _damage(run_dir, step: int, bad: bytes) -> int:
    """Replace the line of `step`'s step event in run_dir/metrics.jsonl by `bad`; returns its line number."""
    lines = (run_dir / "metrics.jsonl").read_bytes().split(b"\n")
    line = next(i for i, b in enumerate(lines, 1) if b'"event": "step"' in b and f'"step": {step},'.encode() in b)
    lines[line - 1] = bad
    (run_dir / "metrics.jsonl").write_bytes(b"\n".join(lines))
    return line


@pytest.mark.parametrize("kind", DAMAGE)
def test_every_reader_skips_a_damaged_line_and_reports_it_once(tiny_run, tmp_path, kind):
    import warnings

    from moelab import Run
    from moelab.live.state import load_state
    from moelab.contract.stream import MetricsWarning
    from moelab.contract.summary import summarize

    import shutil

    cfg, out, _ = tiny_run
    run_dir = shutil.copytree(out, tmp_path / "run")
    line = _damage(run_dir, 3, DAMAGE[kind])
    path = run_dir / "metrics.jsonl"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):  # a dashboard or `Run.status` reads the stream again and again
            events = read_events(path)
        run = Run.load(run_dir)
        assert run.status == "COMPLETED" and list(run.metrics["step"]) == [1, 2, 4, 5, 6]
    reported = [str(w.message) for w in caught if issubclass(w.category, MetricsWarning)]
    assert len(reported) == 1 and f"{path}:{line}: " in reported[0] and "skipped" in reported[0], reported
    assert [e.get("step") for e in events if e["event"] == "step"] == [1, 2, 4, 5, 6]
    with pytest.raises(MetricsError, match=f"{path}:{line}: "):
        read_events(path, strict=True)

    state = load_state(run_dir)  # the dashboard's reader
    assert state.steps == [1, 2, 4, 5, 6] and state.status == "COMPLETED"
    assert len(state.corrupt) == 1 and f"{path}:{line}: " in state.corrupt[0]

    steps = [e for e in events if e["event"] == "step"]
    summary = summarize(cfg, steps, "COMPLETED")
    assert summary["steps"] == 6 and summary["final_loss"] == steps[-1]["loss"]


def test_the_summary_leaves_out_step_records_it_cannot_read(tiny_run):
    from moelab.contract.summary import summarize

    cfg, out, summary = tiny_run
    steps = [e for e in read_events(out / "metrics.jsonl") if e["event"] == "step"]
    broken = [dict(steps[0], routing={"tokens_per_expert": None}), {"step": 2, "loss": 1.0},
              dict(steps[2], memory={}), *steps[3:]]
    got = summarize(cfg, broken, "COMPLETED")
    assert got["unreadable_steps"] == 3 and got["steps"] == 6
    assert got["first_loss"] == steps[3]["loss"] and got["final_loss"] == summary["final_loss"]
    assert "unreadable_steps" not in summarize(cfg, steps, "COMPLETED")


def test_moelab_status_and_resume_work_past_a_damaged_line(tmp_path, capsys):
    """A run with checkpoints and one damaged step line: `moelab status` shows it, `moelab resume` continues from
    the newest checkpoint, keeps the damaged line as it was and records a warning naming it."""
    from moelab.cli import main as cli_main

    run_dir = tmp_path / "run"
    cfg = load_config("tiny", ["train.steps=4", "train.checkpoint_every=2", "model.num_layers=2",
                               "train.seq_len=32"])
    assert Trainer(cfg, run_dir).run()["status"] == "COMPLETED"
    line = _damage(run_dir, 1, DAMAGE["garbage"])

    assert cli_main(["status", str(run_dir)]) == 0
    assert "[COMPLETED]" in capsys.readouterr().out
    assert cli_main(["resume", str(run_dir), "--steps", "6"]) == 0
    events = read_events(run_dir / "metrics.jsonl")
    assert [e["step"] for e in events if e["event"] == "step"] == [2, 3, 4, 5, 6]
    warned = [e for e in events if e["event"] == "warning" and e["kind"] == "damaged_metrics_line"]
    assert len(warned) == 1 and f"line(s) {line} " in warned[0]["message"]
    assert (run_dir / "metrics.jsonl").read_bytes().split(b"\n")[line - 1] == DAMAGE["garbage"]
    assert events[-1]["event"] == "end" and events[-1]["status"] == "COMPLETED"


def _append(path, *items) -> None:
    """Append to a stream: events as {"event": kind, **fields} through the writer, bytes as they are."""
    for item in items:
        if isinstance(item, bytes):
            with open(path, "ab") as f:
                f.write(item)
        else:
            w = MetricsWriter(path)
            w.emit(parse_event(item))
            w.close()


def test_a_tail_reports_a_damaged_line_once_across_a_rewind(tmp_path):
    from moelab.contract.stream import rewind_metrics

    path = tmp_path / "metrics.jsonl"
    _append(path, {"event": "start", "total_steps": 4}, {"event": "step", "step": 1, "loss": 1.0}, b"not json\n",
            {"event": "step", "step": 2, "loss": 0.5}, b"not json\n", {"event": "step", "step": 3, "loss": 0.25})
    tail = JsonlTail(path)
    assert [e.get("step") for e in tail.poll()] == [None, 1, 2, 3]
    assert [m.split(": ")[0][-2:] for m in tail.errors] == [":3", ":5"]  # two copies: two damaged lines
    rewind_metrics(path, 2)  # a resume rewrites the file: the damaged lines are read again from the top
    assert tail.poll() == [] and tail.rewinds == 1 and len(tail.errors) == 2


def test_a_torn_last_line_stays_silent_until_it_is_completed(tmp_path):
    import warnings

    path = tmp_path / "metrics.jsonl"
    _append(path, {"event": "start", "total_steps": 2}, b'{"event": "step", "schema": 1, "step": 1, "lo')
    tail = JsonlTail(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        assert len(read_events(path, live=True)) == 1 and len(tail.poll()) == 1 and not tail.errors
        with open(path, "ab") as f:
            f.write(b'ss": 2.0}\n')
        assert read_events(path)[-1]["loss"] == 2.0 and tail.poll()[0]["loss"] == 2.0 and not tail.errors


def test_a_rewind_keeps_a_damaged_line_and_names_where_it_now_is(tmp_path):
    from moelab.contract.stream import rewind_metrics

    path = tmp_path / "metrics.jsonl"
    _append(path, {"event": "start"}, *({"event": "step", "step": s, "loss": 1.0} for s in (1, 2, 3, 4)),
            b"\x00garbage\n", {"event": "step", "step": 5, "loss": 1.0})
    records, notes = rewind_metrics(path, 2)
    assert [r["step"] for r in records] == [1, 2]
    assert path.read_bytes().split(b"\n")[3] == b"\x00garbage"  # line 4 of the rewritten file (was line 6)
    assert notes == [{"kind": "damaged_metrics_line", "message": f"{path}: line(s) 4 are not valid events (not "
                      f"valid JSON (Expecting value: line 1 column 1 (char 0))); kept as they are and skipped by "
                      f"every reader"}]
