"""How the readers show themselves in a notebook: metrics with a datetime and the seconds since start, runs()
as a table, a run that has not started without a "0/?" step count."""
import shutil

import pandas as pd

import moelab
from moelab.run import Run


def test_metrics_time_is_a_datetime_with_the_seconds_since_start(tiny_folder):
    events = [e for e in Run.load(tiny_folder).events if e["event"] == "step"]
    m = Run.load(tiny_folder).metrics
    assert pd.api.types.is_datetime64_any_dtype(m["time"])
    assert m["time"].iloc[0] == pd.Timestamp(events[0]["time"], unit="s")
    assert m["elapsed_s"].iloc[0] == 0.0
    assert m["elapsed_s"].tolist() == [e["time"] - events[0]["time"] for e in events]


def test_runs_is_a_table_of_runs(tiny_folder, tmp_path):
    shutil.copytree(tiny_folder, tmp_path / "runs" / "tiny-a")
    (tmp_path / "runs" / "queued").mkdir()
    shutil.copy(tiny_folder / "config.yaml", tmp_path / "runs" / "queued" / "config.yaml")
    (tmp_path / "runs" / "queued" / "metrics.jsonl").write_text("")
    found = moelab.runs(tmp_path / "runs")
    assert all(isinstance(r, Run) for r in found) and len(found) == 2  # still a list of Runs
    table = found.table
    assert list(table["name"]) == ["tiny-a", "queued"] or list(table["name"]) == ["queued", "tiny-a"]
    row = table.set_index("name").loc["tiny-a"]
    assert (row["status"], row["step"], row["total_steps"]) == ("COMPLETED", 6, 6)
    assert "<table" in found._repr_html_() and "tiny-a" in repr(found) and "Run(" not in repr(found)
    queued = next(r for r in found if r.name == "queued")
    assert "not started" in repr(queued) and "/?" not in repr(queued)
    assert repr(moelab.runs(tmp_path / "nothing")) == "[]"
