"""gallery/README.md's planned-vs-measured memory table is what `moelab gallery report` renders from
gallery/results/*.json with this checkout's planner (regenerated, never typed), and every row says its error
against the 7% target."""
import shutil

from moelab.gallery import MEMORY_TARGET, default_root, load_results, render_report


def _memory(text: str) -> str:
    return text.split("## Planned vs measured memory")[1].split("\n## ")[0].strip()


def test_the_committed_memory_table_is_rendered_from_the_result_files(tmp_path):
    root = tmp_path / "gallery"
    for folder in ("entries", "results"):
        shutil.copytree(default_root() / folder, root / folder)
    rendered = _memory(render_report(root, plots=False))
    committed = _memory((default_root() / "README.md").read_text())
    assert committed == rendered, "gallery/README.md is stale: run `moelab gallery report`"
    rows = [line for line in rendered.splitlines() if line.startswith("| ") and ".json)" in line]
    with_peak = [r for r in load_results(root) if r.get("system") == "moelab" and r.get("peak_memory_gb")]
    assert rows and len(rows) <= len(with_peak)
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        # | workload | GPUs | router | planned | measured | measured / planned | error | within | biggest term |
        planned, measured, err, within = float(cells[3].replace(",", "")), float(cells[4].replace(",", "")), \
            cells[6], cells[7]
        assert abs(float(err.rstrip("%")) / 100 - (measured / planned - 1)) < 1e-3, line
        assert within == ("yes" if abs(measured / planned - 1) <= MEMORY_TARGET else "NO"), line
