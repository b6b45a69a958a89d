"""The Transformer Engine tables of docs/benchmarks.md, rendered from the result files of the TE device call
(gallery/results/te-checks.json and qwen3-moe-30b-a3b-proxy-2layers--moelab--te-call-*.json; written by
gallery/scripts/te/check_te_gpu.py). A test holds docs/benchmarks.md tables equal to this rendering.

    python gallery/scripts/te/te_tables.py            # print the tables
    python gallery/scripts/te/te_tables.py --write    # rewrite them in docs/benchmarks.md between the te-tables markers
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "gallery" / "results"
BEGIN, END = "<!-- te-tables: begin (gallery/scripts/te/te_tables.py) -->", "<!-- te-tables: end -->"
VARIANTS = [("sdpa-eager", "torch SDPA, eager"), ("te-eager", "TE attention (TE Linear, RMSNorm, DPA), eager"),
            ("sdpa-compile", "torch SDPA, `train.compile`"), ("te-compile", "TE attention, `train.compile`"),
            ("te-compile-fp8-current", "TE attention + FP8 current scaling, `train.compile`"),
            ("te-compile-fp8-block", "TE attention + FP8 block scaling, `train.compile`"),
            ("te-experts-eager", "TE GroupedLinear experts, eager")]


def render() -> str:
    checks = json.loads((RESULTS / "te-checks.json").read_text())
    lines = [f"TE {checks['te_version']} on one {checks['gpu']}, torch {checks['torch_version']}, commit "
             f"{checks['commit']}, device call {checks['device_call']}.", "",
             "| attention case | TE vs fp32 reference (out / dq / dk / dv) | torch bf16 vs fp32 reference |",
             "|---|---|---|"]
    for c in checks["attention"]:
        if "te_rel_err" not in c:
            lines.append(f"| {c['case']} | failed: {c.get('error', '?')[:80]} | |")
            continue
        fmt = lambda d: " / ".join(f"{d[k]:.1e}" for k in ("out", "dq", "dk", "dv")) + (  # noqa: E731
            f" (sinks {d['dsinks']:.1e})" if "dsinks" in d else "")
        lines.append(f"| {c['case']} | {fmt(c['te_rel_err'])} | {fmt(c['torch_bf16_rel_err'])} |")
    rows = {}
    for p in sorted(RESULTS.glob("qwen3-moe-30b-a3b-proxy-2layers--moelab--te-call-*.json")):
        r = json.loads(p.read_text())
        rows[r["variant"]] = r
    base = rows.get("sdpa-compile")
    lines += ["", "| Qwen3-30B-A3B proxy, 2 layers, seq 4096, micro batch 2, learned router | tokens/s | TFLOPs "
              "| vs SDPA compiled |", "|---|---:|---:|---:|"]
    for key, label in VARIANTS:
        r = rows.get(key)
        if r is None:
            lines.append(f"| {label} | not measured | | |")
            continue
        ratio = f"{r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.2f}x" if base else ""
        lines.append(f"| {label} | {r['tokens_per_s_per_gpu']:,.0f} | {r['tflops_per_gpu']:.0f} | {ratio} |")
    return "\n".join(lines)


def write(readme: Path = ROOT / "docs" / "benchmarks.md") -> None:
    text = readme.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(head + BEGIN + "\n" + render() + "\n" + END + tail)


if __name__ == "__main__":
    write() if "--write" in sys.argv else print(render())
