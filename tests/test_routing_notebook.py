"""notebooks/04_routing_lab.ipynb executed headless (nbclient) as CI runs it: the sweep completes and the
comparison table and plots are in the outputs."""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow
NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "04_routing_lab.ipynb"
STEPS = 12


def _outputs(nb, source_start: str) -> list:
    cells = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(source_start)]
    assert len(cells) == 1, source_start
    return cells[0].outputs


def test_routing_lab_notebook_shows_the_comparison(tmp_path, monkeypatch):
    monkeypatch.setenv("MOELAB_NOTEBOOK_STEPS", str(STEPS))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # concurrent runs on two cores
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    nbformat.write(nb, str(tmp_path / NOTEBOOK.name))  # kept for a look when the test fails
    shown = _outputs(nb, "sweep = base.sweep(")  # the sweep's dashboard (a widget, then its snapshot's place)
    assert "application/vnd.jupyter.widget-view+json" in shown[0]["data"]
    status = _outputs(nb, "sweep.wait()")
    assert "['COMPLETED', 'COMPLETED', 'COMPLETED', 'COMPLETED']" in status[-1]["data"]["text/plain"]
    assert "moelab-snapshot" in shown[1]["data"]["text/html"]  # dash.wait() filled it
    shown = _outputs(nb, "cmp = sweep.compare()")[0]["data"]
    html, text = shown["text/html"], shown["text/plain"]
    assert "moelab-comparison" in html and html.count("data:image/png;base64,") == 3
    assert "Comparison of 4 runs" in text
    for column in ("model.moe.aux_loss_coeff", "model.moe.bias_update_rate", "final_loss", "final_cv",
                   "dropped_pct", "dead_experts"):
        assert column in html, column
    table = _outputs(nb, "cap_cmp = compare(")[0]["data"]["text/plain"]
    assert "dropped_pct" in table
    assert "image/png" in _outputs(nb, "cap_cmp.plot_balance()")[0]["data"]
    assert len(list(tmp_path.glob("runs/routing-lab-sweep-*/0*/metrics.jsonl"))) == 4
