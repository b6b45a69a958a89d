"""notebooks/06_steer_and_fork.ipynb executed headless (nbclient) as CI runs it: the collapsing run is rescued
mid-run (a `control` event at the step the ranks applied it, after the rescue step), and the two forks from one
checkpoint after it complete and are compared by their bias rate."""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from moelab.contract.stream import read_events
from moelab.run.run import Run

pytestmark = pytest.mark.slow
NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "06_steer_and_fork.ipynb"


def test_steer_and_fork_notebook(tmp_path, monkeypatch):
    steps = 18
    monkeypatch.setenv("MOELAB_NOTEBOOK_STEPS", str(steps))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("MOELAB_NOTEBOOK_SCALE", raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", store_widget_state=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    nbformat.write(nb, str(tmp_path / NOTEBOOK.name))
    (parent,) = [p for p in (tmp_path / "runs").iterdir() if (p / "config.yaml").is_file()]
    run = Run.load(parent)
    assert run.status == "COMPLETED"
    (control,) = [e for e in read_events(parent / "metrics.jsonl") if e["event"] == "control"]
    assert control["field"] == "model.moe.bias_update_rate" and control["new"] == 0.005
    assert steps // 3 <= control["step"] < steps
    (sweep,) = [p for p in (tmp_path / "runs").iterdir() if (p / "sweep.json").is_file()]
    forks = sorted(p for p in sweep.iterdir() if (p / "fork.json").is_file())
    assert len(forks) == 2 and all(Run.load(f).status == "COMPLETED" for f in forks)
    html = "".join(str(o.get("data", {}).get("text/html", "")) for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs)
    assert "model.moe.bias_update_rate" in html and "final_loss" in html
