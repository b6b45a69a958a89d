"""The gallery's documents are renderings of its result files, and the two-GPU check script works (on CPU)."""
import importlib.util
import json
import os
import shutil
import subprocess

import pytest

from moelab.gallery import default_root, render_report

SCRIPTS = default_root() / "scripts"


def _module(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_perf_notes_tables_are_the_rendering_of_the_result_files():
    """A figure typed into gallery/perf-notes.md, or a result file changed without re-rendering, fails here."""
    perf = _module("perf_tables")
    notes = (default_root() / "perf-notes.md").read_text()
    between = notes[notes.index(perf.BEGIN) + len(perf.BEGIN):notes.index(perf.END)]
    assert between.strip() == perf.tables().strip(), "run: python gallery/scripts/perf_tables.py --write"


def test_gallery_readme_is_the_rendering_of_entries_and_results(tmp_path):
    root = tmp_path / "gallery"
    for part in ("entries", "results"):
        shutil.copytree(default_root() / part, root / part)
    rendered = render_report(root, plots=False)  # the same text, without the plots section that ends the file
    assert (default_root() / "README.md").read_text().startswith(rendered.rstrip("\n")), "run: moelab gallery report"


@pytest.mark.slow
def test_two_gpu_check_script_compares_layouts_with_one_process(tmp_path):
    """The script that recorded the two-GPU equivalence (gallery/results/check-two-gpu-equivalence-tiny.json),
    run on CPU processes for two layouts: its record names every comparison, its command and its commit."""
    env = {**os.environ, "DEVICE": "cpu", "LAYOUTS": "ep2 pp2"}
    out = tmp_path / "check"
    proc = subprocess.run(["bash", str(SCRIPTS / "check_two_gpu.sh"), str(out), "tiny", "2"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads((out / "check_two_gpu.json").read_text())
    assert r["passed"] and r["steps"] == 2 and r["commit"] and "LAYOUTS='ep2 pp2'" in r["command"]
    assert [(c["dtype"], c["layout"]) for c in r["comparisons"]] == [
        ("float32", "ep2"), ("float32", "pp2"), ("bfloat16", "ep2"), ("bfloat16", "pp2")]
    assert all(len(run["losses"]) == 2 for run in r["runs"].values())
    assert all(c["max_rel_loss_diff"] <= c["tolerance"] for c in r["comparisons"])


def test_readme_te_tables_are_the_rendering_of_the_te_result_files():
    """docs/benchmarks.md Transformer Engine tables are gallery/scripts/te/te_tables.py's rendering of the TE call's result
    files: a figure typed by hand, or a result file changed without re-rendering, fails here."""
    spec = importlib.util.spec_from_file_location("te_tables", SCRIPTS / "te" / "te_tables.py")
    te_tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(te_tables)
    readme = (te_tables.ROOT / "docs" / "benchmarks.md").read_text()
    inside = readme.split(te_tables.BEGIN, 1)[1].split(te_tables.END, 1)[0]
    assert inside.strip() == te_tables.render().strip()


def test_readme_perf_highlights_are_the_rendering_of_the_result_files():
    """README's headline benchmark table (each system at its best, ratios to the faster compiled torchtitan) is
    perf_tables.readme_highlights(): no figure typed by hand."""
    pt = _module("perf_tables")
    readme = (default_root().parent / "README.md").read_text()
    inside = readme.split(pt.README_BEGIN, 1)[1].split(pt.README_END, 1)[0]
    assert inside.strip() == pt.readme_highlights().strip(), "run: python gallery/scripts/perf_tables.py --write"


def test_rows_check_script_compares_both_forms_compiled(tmp_path, monkeypatch):
    """gpu_check_rows.py --small on CPU: both forms compiled, the combine's gradient is the gather, and both agree
    with the float64 reference to bf16 rounding."""
    monkeypatch.setattr("sys.argv", ["gpu_check_rows.py", "--out", str(tmp_path), "--small"])
    assert _module("gpu_check_rows").main() == 0
    r = json.loads((tmp_path / "check-rows.json").read_text())
    assert r["variant"] == "check-rows" and r["commit"] and "--small" in r["command"]
    assert sorted(r["results"]) == ["before", "now"]
    for v in r["results"].values():
        assert v["combine_grad_equals_gather"] and v["combine_rel_vs_float64"] < 1e-6
        assert v["dispatch_grad_rel_vs_float64"] < 4e-3  # the bf16 gradient's rounding
