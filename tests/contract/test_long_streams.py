"""Issue 33.6: readers of long runs read a bounded amount. `moelab status`, moelab.runs() and a Run's progress
and status read the end of the stream (and its first start), whatever its length; Run.metrics thins a long run
evenly (the last step kept); the dashboard's state keeps a bounded number of points. The bytes read are counted
by the kernel (/proc/self/io rchar), not by the code under test."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from moelab.contract.events import EndEvent, Memory, RankMemory, Routing, StartEvent, StepEvent
from moelab.contract.stream import encode, scan_events, tail_events

STEPS = 6_000


def write_long_run(folder: Path, steps: int = STEPS, end: bool = True) -> int:
    """A run folder whose stream holds `steps` realistic step events (8 MoE layers x 32 experts); returns its
    size in bytes. The lines are the trainer's own encoding of StepEvent."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("name: long\n")
    template = encode(StepEvent(
        step=999_999_999, loss=2.0, grad_norm=0.5, lr=1e-4, tokens=4096, step_time_s=0.1, tokens_per_s=40960.0,
        tokens_per_s_per_gpu=40960.0, tflops_per_gpu=1.0,
        routing=Routing(tokens_per_expert_ME=[[128] * 32] * 8, routed_per_expert_ME=[[130] * 32] * 8,
                        dropped_tokens_M=[2.0] * 8),
        memory=Memory(rss_gb=1.0, max_peak_allocated_gb=1.0, per_rank=[RankMemory(0, 0.0, 0.0, 1.0)])))
    with open(folder / "metrics.jsonl", "wb") as f:
        f.write(encode(StartEvent(config={"name": "long"}, total_steps=steps)))
        for n in range(1, steps + 1):
            f.write(template.replace(b"999999999", str(n).encode(), 1))
        if end:
            f.write(encode(EndEvent(step=steps, status="COMPLETED", summary={"final_loss": 2.0})))
    return (folder / "metrics.jsonl").stat().st_size


def bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.fixture(scope="module")
def long_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    sizes = [write_long_run(root / f"run{i}", end=i == 0) for i in range(3)]
    return root, sizes


def test_status_progress_and_the_run_list_read_the_end_of_the_stream(long_runs, capsys):
    pytest.importorskip("pandas")
    import moelab
    from moelab import Run
    from moelab.cli import main

    root, sizes = long_runs
    assert min(sizes) > 15 << 20  # 3.3 kB a step line
    before = bytes_read()
    run = Run.load(root / "run0")
    assert run.status == "COMPLETED" and run.progress()["step"] == STEPS and run.progress()["total_steps"] == STEPS
    live = Run.load(root / "run1")  # no end yet: running, at its last step
    assert live.status == "RUNNING" and live.progress()["step"] == STEPS
    table = moelab.runs(root).table
    assert list(table["step"]) == [STEPS] * 3 and list(table["total_steps"]) == [STEPS] * 3
    assert main(["status", str(root)]) == 0
    assert capsys.readouterr().out.count(f"step {STEPS}/{STEPS}") == 3
    read = bytes_read() - before
    assert read < 16 << 20, f"read {read:,} bytes of {sum(sizes):,} for status, progress and the run list"


def test_tail_events_finds_the_last_step_and_the_first_start_in_a_bounded_read(long_runs):
    root, sizes = long_runs
    before = bytes_read()
    last, head = tail_events(root / "run0" / "metrics.jsonl", kinds=("start", "step", "end"), max_bytes=64 << 10)
    assert bytes_read() - before < 200 << 10
    assert [e.step for e in last if isinstance(e, StepEvent)][-1] == STEPS and isinstance(last[-1], EndEvent)
    assert [e.total_steps for e in head] == [STEPS]


def test_a_line_longer_than_the_window_is_still_found(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(encode(StartEvent(total_steps=1)) + encode(StepEvent(step=1, comm={"pad": "x" * 300_000})))
    last, _ = tail_events(path, kinds=("step",), max_bytes=4096)
    assert [e.step for e in last] == [1]


def test_run_metrics_thins_a_long_run_evenly_and_keeps_the_last_step(long_runs, monkeypatch):
    pytest.importorskip("pandas")
    from moelab.run import run as run_module

    root, _ = long_runs
    monkeypatch.setattr(run_module, "METRICS_ROWS", 1000)
    steps = list(run_module.Run.load(root / "run0").metrics_table(max_rows=1000)["step"])
    assert 500 < len(steps) <= 1000 and steps[0] == 1 and steps[-1] == STEPS  # an integer stride
    gaps = {b - a for a, b in zip(steps[:-2], steps[1:-1])}
    assert len(gaps) == 1, "evenly spaced"
    every = scan_events(root / "run0" / "metrics.jsonl", kinds=("step",), max_steps=None)
    assert [e.step for e in every] == list(range(1, STEPS + 1))


def test_the_dashboard_state_keeps_a_bounded_number_of_points(tmp_path, monkeypatch):
    from moelab.live import state as state_module

    monkeypatch.setattr(state_module, "MAX_POINTS", 100)
    write_long_run(tmp_path / "run", steps=1000)
    st = state_module.load_state(tmp_path / "run")
    assert len(st.steps) <= 100 and st.steps[-1] == 1000 and st.step == 1000
    assert st.steps == sorted(st.steps) and st.steps[0] == 1
    lengths = {len(h) for h in st._histories()}
    assert lengths == {len(st.steps)}, "every history thinned with the steps"
    assert st.routing_total_ME[0][0] == 128 * 1000 or st.routing_total_ME[0][0] == 130 * 1000  # totals stay exact


def test_the_dashboard_reads_a_long_stream_in_bounded_chunks(tmp_path):
    from moelab.contract.stream import JsonlTail

    write_long_run(tmp_path / "run", steps=2000)
    tail = JsonlTail(tmp_path / "run" / "metrics.jsonl", typed=True, chunk_bytes=256 << 10)
    polls = []
    while events := tail.poll():
        polls.append(len(events))
    assert len(polls) > 5 and sum(polls) == 2002 and max(polls) < 200
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["event"] == "end"
