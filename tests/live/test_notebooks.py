"""Every example notebook, executed headless with nbclient (widget state stored), as CI runs it; the assertions
read the final widget state saved in the notebook: progress complete, stats filled, chart images present."""
from __future__ import annotations

import base64
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow
NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
PNG = b"\x89PNG\r\n\x1a\n"


def execute(name: str, tmp_path: Path, monkeypatch, steps: int, timeout: int = 600):
    """Run a notebook in a fresh kernel whose working directory (and so runs/) is tmp_path. The kernel inherits
    this process' environment: that is how the notebook's size knobs are set."""
    monkeypatch.setenv("MOELAB_NOTEBOOK_STEPS", str(steps))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # concurrent jobs on two cores
    monkeypatch.delenv("MOELAB_NOTEBOOK_SCALE", raising=False)
    monkeypatch.delenv("MOELAB_UI", raising=False)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", store_widget_state=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    nbformat.write(nb, str(tmp_path / name))  # kept for a look when a test fails
    return nb


def widgets(nb) -> dict:
    """{model name: [state, ...]} from the notebook's saved widget state, binary buffers decoded."""
    out: dict = {}
    for model in nb.metadata["widgets"][WIDGET_STATE]["state"].values():
        state = dict(model["state"])
        for buf in model.get("buffers", []):
            state[buf["path"][0]] = base64.b64decode(buf["data"])
        out.setdefault(model["model_name"], []).append(state)
    return out


def outputs(nb, source_start: str) -> list:
    cells = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(source_start)]
    assert len(cells) == 1, source_start
    return cells[0].outputs


def text(outs) -> str:
    return "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for o in outs)


def assert_dashboards_complete(nb, steps: int, runs: int) -> dict:
    w = widgets(nb)
    bars = w["IntProgressModel"]
    assert len(bars) == runs
    for bar in bars:
        assert bar["value"] == bar["max"] == steps and bar["bar_style"] == "success", bar
    html = [h["value"] for h in w["HTMLModel"]]
    stats = [h for h in html if "tokens/s/rank" in h and "peak memory per rank" in h]
    assert len(stats) >= runs and all("COMPLETED" in s and "–" not in s.split("MFU")[0] for s in stats)
    images = [i["value"] for i in w["ImageModel"]]
    sweeps = 1 if runs > 1 else 0  # a sweep's overlaid curves
    assert len(images) == 2 * runs + sweeps and all(png.startswith(PNG) and len(png) > 5000 for png in images)
    layers = [d["_options_labels"] for d in w["DropdownModel"] if d["description"] == "layer"]  # not the controls
    assert layers == [["MoE layer 0", "MoE layer 1", "MoE layer 2"]] * runs
    return w


def test_quickstart_notebook(tmp_path, monkeypatch):
    steps = 20
    nb = execute("01_quickstart.ipynb", tmp_path, monkeypatch, steps)
    assert_dashboards_complete(nb, steps, runs=1)
    shown = outputs(nb, "dash = run.dashboard()")
    assert [o["output_type"] for o in shown] == ["display_data"] * 2 and WIDGET_VIEW in shown[0]["data"]
    snapshot = shown[1]["data"]["text/html"]  # left by dash.wait(), for a reopened or exported notebook
    assert "moelab-snapshot" in snapshot and snapshot.count("data:image/png;base64,") == 2
    assert f"{steps}</b> / {steps} steps" in snapshot and "COMPLETED" in snapshot
    assert "the kernel is free while the run trains" in text(outputs(nb, "print(f\"the kernel is free"))
    assert "tokens/s/GPU" in text(outputs(nb, "# the step time")) and "on 1 x H100" in text(outputs(nb, "# the step time"))
    assert f"COMPLETED at step {steps}/{steps}" in text(outputs(nb, "from moelab.contract.summary"))
    for call in ("run.plot_routing()", "run.plot_routing(layer=0)", "run.plot_throughput()", "run.plot_memory()"):
        assert any("image/png" in o.get("data", {}) for o in outputs(nb, call)), call
    assert len(list((tmp_path / "runs").glob("tiny-*/metrics.jsonl"))) == 1


def test_gallery_notebook(tmp_path, monkeypatch):
    steps = 12
    nb = execute("03_gallery.ipynb", tmp_path, monkeypatch, steps)
    assert_dashboards_complete(nb, steps, runs=1)
    table = outputs(nb, "import os")[0]["data"]["text/html"]
    assert "tiny-cpu" in table and "qwen3-moe-30b-a3b-8gpu" in table and "12040" in table
    assert "COMPLETED" in text(outputs(nb, "run.wait()"))
    compared = outputs(nb, "s = run.summary")[0]["data"]["text/html"]
    assert "this run" in compared and "tokens/s/GPU" in compared


@pytest.mark.slurm
def test_slurm_notebook(tmp_path, monkeypatch, slurm_cluster):
    steps = 12
    nb = execute("02_slurm.ipynb", tmp_path, monkeypatch, steps)
    w = assert_dashboards_complete(nb, steps, runs=4)  # the run, then the sweep's three
    sweep_table = [h["value"] for h in w["HTMLModel"] if "<th" in h["value"] and "max/mean" in h["value"]]
    assert len(sweep_table) == 1 and sweep_table[0].count("COMPLETED") == 3
    assert [t["titles"] for t in w["TabModel"]] == [["0", "0.01", "0.1"]]
    compared = outputs(nb, "cmp = sweep.compare()")[0]["data"]["text/html"]
    assert compared.count("COMPLETED") == 3 and "max_over_mean" in compared and "final_cv" in compared
