"""The measured tables of gallery/perf-notes.md, rendered from gallery/results/*.json (no figure typed by hand).

    python gallery/scripts/perf_tables.py --write     # replaces the text between the markers in perf-notes.md
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from moelab.gallery_records import by_router, router_of

GALLERY = Path(__file__).resolve().parents[1]
R = GALLERY / "results"
W = "qwen3-moe-30b-a3b-proxy"
BEGIN, END = "<!-- tables: begin (gallery/scripts/perf_tables.py) -->", "<!-- tables: end -->"


def load(name: str) -> dict:
    return json.loads((R / f"{name}.json").read_text())


def row(name: str, label: str) -> str:
    r = load(name)
    return (f"| {label} | {r['global_batch_size']} | {router_of(r)} | {r['tokens_per_s_per_gpu']:,.0f} | {r['tflops_per_gpu']:.1f} | "
            f"{r['step_time_ms']:.1f} | {r['peak_memory_gb']:.1f} | {r['device_call'].split(' ')[0]} | `{name}.json` |")


HEAD = ("| system / variant | global batch | router | tokens/s/GPU | TFLOPs/GPU | step ms | peak GiB | call | "
        "result file |\n|---|---:|---|---:|---:|---:|---:|---|---|")


def maybe(name: str) -> dict | None:
    p = R / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def row_or_missing(name: str, label: str, gbs: int) -> str:
    """A row of the issue-17 table; a record not collected yet, or one that failed, says so (no figure)."""
    r = maybe(name)
    if r is None or "error" in r:
        why = "not measured yet" if r is None else f"error: {r['error'][:60]}"
        return f"| {label} | {gbs} | - | - | - | - | - | - | `{name}.json` ({why}) |"
    return row(name, label)


def fastest_torchtitan(gbs: int) -> str:
    """The faster of torchtitan's compile modes measured at this global batch (the peer at its best): the
    trainer's apply_compile (`compile-trainer`, or `compile` in records before the mode was named) or each
    whole block compiled (`compile-blocks`)."""
    names = [f"torchtitan--compile-{m}gbs{gbs}" for m in ("blocks-", "trainer-", "")]
    found = [(r["tokens_per_s_per_gpu"], n) for n in names
             if (r := maybe(f"{W}--{n}")) is not None and "error" not in r]
    return max(found)[1] if found else names[0]


def issue17() -> list[str]:
    """Issue 17: peers compiled as their trainers do and moelab bf16 / FP8 from one call (gpu_perf.sh)."""
    out = ["### One call (gallery/scripts/gpu_perf.sh): peers as their users run them, moelab bf16 and FP8", "",
           "Same harness, shapes and FLOPs convention (FP8 runs count the same model FLOPs; MFU against the bf16 "
           "peak); learned router; bf16 parameters; seq 4096, micro batch 2.", "", HEAD]
    rows = [("hf-transformers--grouped_mm-eager-gbs2", "HF transformers, grouped_mm experts, eager", 2),
            ("torchtitan--eager-gbs2", "torchtitan 0.2.2 model code, eager", 2)]
    for gbs in (2, 16):
        rows += [(f"torchtitan--compile-trainer-gbs{gbs}", "torchtitan 0.2.2, compiled by its trainer's apply_compile "
                  "+ loss", gbs),
                 (f"torchtitan--compile-blocks-gbs{gbs}", "torchtitan 0.2.2, each whole block compiled + loss", gbs),
                 (f"torchtitan--compile-fp8-rowwise-gbs{gbs}", "torchtitan 0.2.2 compiled + torchao float8 rowwise",
                  gbs),
                 (f"moelab--bf16-compile-gbs{gbs}", "moelab, train.compile", gbs),
                 (f"moelab--fp8-rowwise-compile-gbs{gbs}", "moelab, train.compile + train.fp8=rowwise", gbs)]
    out += [row_or_missing(f"{W}--{n}", label, gbs) for n, label, gbs in rows]
    for gbs in (2, 16):  # experiments: a row only where measured
        for v, label in (("fp8-rowwise_lm_head-compile", "moelab, train.compile + train.fp8=rowwise_lm_head"),
                         ("bf16-triton-adamw-compile", "moelab, train.compile, TritonAdamW (experiment)")):
            if maybe(f"{W}--moelab--{v}-gbs{gbs}"):
                out.append(row_or_missing(f"{W}--moelab--{v}-gbs{gbs}", label, gbs))
    out += ["", "| target | records | ratio | met |", "|---|---|---:|---|"]

    def target(a, b, goal, what):
        ra, rb = maybe(f"{W}--{a}"), maybe(f"{W}--{b}")
        if ra is None or rb is None or "error" in ra or "error" in rb:
            out.append(f"| {what} >= {goal}x | `{a}` / `{b}` | - | not measured yet |")
            return
        x = ra["tokens_per_s_per_gpu"] / rb["tokens_per_s_per_gpu"]
        out.append(f"| {what} >= {goal}x | `{a}` / `{b}` | {x:.2f} | {'yes' if x >= goal else 'no'} |")

    for gbs in (2, 16):
        target(f"moelab--bf16-compile-gbs{gbs}", fastest_torchtitan(gbs), 1.15,
               f"bf16, global batch {gbs}: moelab / compiled torchtitan (its faster compile mode)")
    for gbs in (2, 16):
        target(f"moelab--fp8-rowwise-compile-gbs{gbs}", fastest_torchtitan(gbs), 1.35,
               f"FP8, global batch {gbs}: moelab FP8 / compiled torchtitan bf16")
        target(f"moelab--fp8-rowwise-compile-gbs{gbs}", f"torchtitan--compile-fp8-rowwise-gbs{gbs}", 1.0,
               f"FP8, global batch {gbs}: moelab FP8 / compiled torchtitan + torchao FP8")
    pa, pb = (maybe(f"{W}-parity-small--moelab--parity-fp8-{m}") for m in ("off", "rowwise"))
    if pa and pb and pa.get("losses") and pb.get("losses"):
        d = abs(pb["final_loss_mean20"] - pa["final_loss_mean20"]) / pa["final_loss_mean20"]
        out.append(f"| FP8 loss parity: final loss (mean of the last 20 of {len(pb['losses'])} steps) within 1% of "
                   f"bf16 | {pb['final_loss_mean20']:.4f} vs {pa['final_loss_mean20']:.4f} | {100 * d:.2f}% | "
                   f"{'yes' if d <= 0.01 else 'no'} |")
    else:
        out.append("| FP8 loss parity within 1% (300 steps) | `parity-fp8-off` / `parity-fp8-rowwise` | - | "
                   "not measured yet |")
    for tag, what in (("bf16", "bf16"), ("fp8-rowwise", "train.fp8=rowwise")):
        prof = maybe(f"{W}--moelab--profile-{tag}-compile-gbs2")
        if prof:
            out += ["", f"Profile of moelab's compiled {what} step (global batch 2, `profile-{tag}-compile-gbs2`): "
                    f"step {prof['step_ms']:.1f} ms, kernels {prof['gpu_busy_ms']:.1f} ms, idle {prof['idle_ms']:.1f} "
                    "ms", "", "| category | ms |", "|---|---:|"]
            out += [f"| {k} | {v:.1f} |" for k, v in prof["by_category_ms"].items()]
    return out


def tables() -> str:
    out = issue17() + ["", "### Peers and moelab, Qwen3-30B-A3B layer proxy, one H200, seq 4096, micro batch 2", "", HEAD]
    for name, label in [
        (f"{W}--hf-transformers--eager-gbs2", "HF transformers 5.17, experts eager (loop)"),
        (f"{W}--hf-transformers--grouped_mm-gbs2", "HF transformers 5.17, experts grouped_mm"),
        (f"{W}--torchtitan--gbs2", "torchtitan 0.2.2 model code, eager"),
        (f"{W}--moelab--cli-fp32-params-autocast", "moelab, fp32 params + autocast (default precision), fake gate"),
        (f"{W}--moelab--real-router-gbs2", "moelab, bf16 params, learned router"),
        (f"{W}--moelab--fake-gate-gbs2", "moelab, bf16 params, fake balanced gate"),
        (f"{W}--moelab--real-router-gbs2-compile", "moelab, bf16 params, compile, learned router"),
        (f"{W}--moelab--fake-gate-gbs2-compile", "moelab, bf16 params, compile, fake balanced gate"),
        (f"{W}--hf-transformers--grouped_mm-gbs16", "HF transformers 5.17, experts grouped_mm"),
        (f"{W}--torchtitan--gbs16", "torchtitan 0.2.2 model code, eager"),
        (f"{W}--moelab--real-router-gbs16-compile", "moelab, bf16 params, compile, learned router"),
        (f"{W}--moelab--fake-gate-gbs16-compile", "moelab, bf16 params, compile, fake balanced gate"),
    ]:
        out.append(row(name, label))
    out += ["", "### Targets of issues 7 and 11 (against EAGER torchtitan; the peer to beat is the compiled one, "
            "above)", "", "| target | measured | ratio | met |", "|---|---|---:|---|"]

    def ratio(a, b, target, what):
        ra, rb = load(a), load(b)
        x = ra["tokens_per_s_per_gpu"] / rb["tokens_per_s_per_gpu"]
        out.append(f"| {what} >= {target}x | `{a}` / `{b}` | {x:.2f} | {'yes' if x >= target else 'no'} |")

    for gbs in (2, 16):
        ratio(f"{W}--moelab--real-router-gbs{gbs}-compile", f"{W}--hf-transformers--grouped_mm-gbs{gbs}", 1.5,
              f"learned router, global batch {gbs}: moelab / HF")
        ratio(f"{W}--moelab--real-router-gbs{gbs}-compile", f"{W}--torchtitan--gbs{gbs}", 1.1,
              f"learned router, global batch {gbs}: moelab / eager torchtitan")
        ratio(f"{W}--moelab--fake-gate-gbs{gbs}-compile", f"{W}--hf-transformers--grouped_mm-gbs{gbs}", 1.5,
              f"fake gate, global batch {gbs}: moelab / HF")
    for name in (f"{W}--moelab--fake-gate-gbs2-compile", f"{W}--moelab--real-router-gbs16-compile",
                 f"{W}--moelab--fake-gate-gbs16-compile"):
        t = load(name)["tflops_per_gpu"]
        out.append(f"| TFLOPs/GPU >= 350 | `{name}` | {t:.1f} | {'yes' if t >= 350 else 'no'} |")
    ep, one = load(f"{W}-ep2--moelab"), load(f"{W}-1gpu--moelab--eager-fake-gate")
    for key, what in (("fake_balanced", "fake gate"), ("learned", "learned router")):
        a, b = by_router(ep)[key]["tokens_per_s_per_gpu"], by_router(one)[key]["tokens_per_s_per_gpu"]
        out.append(f"| EP=2 per-GPU >= 0.9 x one GPU ({what}, no compile, global batch 2 per GPU) | "
                   f"`{W}-ep2--moelab` / `{W}-1gpu--moelab` | {a / b:.2f} | {'yes' if a / b >= 0.9 else 'no'} |")
    for name, key in ((f"{W}--moelab--real-router-gbs2-compile", f"{W}--moelab--real-router-gbs2-compile-no-metrics"),
                      (f"{W}--moelab--real-router-gbs2", f"{W}--moelab--real-router-gbs2-no-metrics")):
        on, off = load(name)["step_time_ms"], load(key)["step_time_ms"]
        out.append(f"| metrics cost < 1% of the step | `{name}` vs `{key}` | {100 * (on - off) / on:+.2f}% | "
                   f"{'yes' if (on - off) / on < 0.01 else 'no'} |")

    out += ["", "### Fast-path variants (same model, same call unless the call column says otherwise)", "", HEAD]
    for v, label in [("fake-gate-gbs2", "eager, bf16 params"),
                     ("fake-gate-gbs2-grouped_gemm", "+ backend.experts=grouped_gemm (cuBLAS loop build)"),
                     ("real-router-gbs2-grouped_gemm", "learned router + grouped_gemm"),
                     ("fake-gate-gbs2-fast-permute", "RowGather permutation (sort-free backward)"),
                     ("fake-gate-gbs2-cudnn-sdpa", "cuDNN attention forced first"),
                     ("fake-gate-gbs2-compile-eager-loss", "torch.compile per block, loss eager"),
                     ("fake-gate-gbs2-compile", "torch.compile per block + compiled loss")]:
        out.append(row(f"{W}--moelab--{v}", label))

    out += ["", "### Layouts on two H200s against one (issue 10): per-GPU throughput", "",
            "| layout | result file | router | tokens/s/GPU | one-GPU baseline | router | tokens/s | ratio | "
            "peak GiB (2 GPUs / 1) | call |", "|---|---|---|---:|---|---|---:|---:|---|---|"]
    for label, two, one in [
        ("EP=2 x FSDP=2, eager", f"{W}-ep2--moelab", f"{W}-1gpu--moelab--eager-fake-gate"),
        ("EP=2 x FSDP=2, compile", f"{W}--moelab--ep2-compile", f"{W}--moelab--1gpu-compile"),
        ("PP=2, 1F1B, 4 micro batches (global batch 8 against 2)", f"{W}-pp2--moelab", f"{W}-1gpu--moelab--eager-fake-gate"),
        ("CP=2 (FSDP over the CP ranks), seq 8192", f"{W}-cp2--moelab", f"{W}-1gpu-seq8192--moelab"),
        ("CP=2 x EP=2, seq 8192", f"{W}-cp2-ep2--moelab", f"{W}-1gpu-seq8192--moelab")]:
        a, b = load(two), load(one)
        calls = sorted({a["device_call"].split(" ")[0], b["device_call"].split(" ")[0]})
        out.append(f"| {label} | `{two}.json` | {router_of(a)} | {a['tokens_per_s_per_gpu']:,.0f} | `{one}.json` | "
                   f"{router_of(b)} | {b['tokens_per_s_per_gpu']:,.0f} | {a['tokens_per_s_per_gpu'] / b['tokens_per_s_per_gpu']:.2f} | "
                   f"{a['peak_memory_gb']:.1f} / {b['peak_memory_gb']:.1f} | {', '.join(calls)} |")

    out += ["", "### Gallery proxies (`moelab gallery run ENTRY`, steps and warm-up in each record's command)", "",
            "| entry | GPUs | global batch | compile | router | tokens/s/GPU | TFLOPs/GPU | learned router tokens/s/GPU | "
            "peak GiB | commit | call |", "|---|---:|---:|---|---|---:|---:|---:|---:|---|---|"]
    for p in sorted(R.glob("*--moelab*.json")):
        r = json.loads(p.read_text())
        if not str(r.get("command", "")).startswith("moelab gallery run"):
            continue
        rr = by_router(r).get("learned", {}).get("tokens_per_s_per_gpu")
        out.append(f"| {r['workload']} | {r['gpus']} | {r['global_batch_size']} | {r.get('compile', '-')} | "
                   f"{router_of(r)} | {r['tokens_per_s_per_gpu']:,.0f} | {r['tflops_per_gpu']:.1f} | "
                   f"{f'{rr:,.0f}' if rr else '-'} | {r['peak_memory_gb']:.1f} | {str(r.get('commit', '-'))[:7]} | "
                   f"{str(r.get('device_call', '-')).split(' ')[0]} |")

    k = json.loads((R / "backends-experts-kernels.json").read_text())
    out += ["", f"### Experts kernels, forward + backward, {k['shape']} (`backends-experts-kernels.json`)", "",
            "| kernel | matches fp32 reference (3 random draws) | max rel. error | balanced ms | TFLOP/s | "
            "skewed (Dirichlet 2) ms | TFLOP/s |", "|---|---|---:|---:|---:|---:|---:|"]
    for name, v in k["kernels"].items():
        err = max(max(x for key, x in c.items() if key != "ok") for c in v["check"])
        out.append(f"| {name} | {v['correct']} | {err:.1e} | {v['balanced']['ms']:.2f} | {v['balanced']['tflops']:.0f} "
                   f"| {v['skewed_dirichlet2']['ms']:.2f} | {v['skewed_dirichlet2']['tflops']:.0f} |")
    c = json.loads((R / "check-two-gpu-equivalence-tiny.json").read_text())
    out += ["", f"### Two-GPU equivalence, tiny preset, 20 steps (`check-two-gpu-equivalence-tiny.json`, call "
            f"{c['device_call'].split(' ')[0]}, commit {c['commit'][:7]})", "",
            "| dtype | layout | max relative loss difference vs one GPU | tolerance | passed |",
            "|---|---|---:|---:|---|"]
    for x in c["comparisons"]:
        out.append(f"| {x['dtype']} | {x['layout']} | {x['max_rel_loss_diff']:.1e} | {x['tolerance']:.0e} | "
                   f"{x['passed']} |")
    return "\n".join(out)


README_BEGIN = "<!-- perf-highlights: begin (gallery/scripts/perf_tables.py) -->"
README_END = "<!-- perf-highlights: end -->"


def readme_highlights() -> str:
    """README's headline table: each system at its best from the one-call records, with its ratio to the faster
    compiled torchtitan at the same global batch (the peer to beat)."""
    out = ["| system (one H200, Qwen3-30B-A3B proxy, seq 4096, micro batch 2) | global batch | router | "
           "tokens/s/GPU | TFLOPs/GPU | vs compiled torchtitan | call |", "|---|---:|---|---:|---:|---:|---|"]
    rows = [("hf-transformers--grouped_mm-eager-gbs2", "HF transformers, grouped_mm experts", 2),
            ("torchtitan--eager-gbs2", "torchtitan 0.2.2, eager", 2)]
    for gbs in (2, 16):
        rows += [(fastest_torchtitan(gbs), "torchtitan 0.2.2, compiled (its faster mode)", gbs),
                 (f"moelab--bf16-compile-gbs{gbs}", "moelab, `train.compile`", gbs)]
    rows += [("moelab--bf16-triton-adamw-compile-gbs2", "moelab, `train.compile`, TritonAdamW (experiment)", 2),
             ("moelab--fp8-rowwise-compile-gbs16", "moelab, `train.compile` + `train.fp8=rowwise`", 16)]
    for name, label, gbs in rows:
        r, peer = maybe(f"{W}--{name}"), maybe(f"{W}--{fastest_torchtitan(gbs)}")
        if r is None or "error" in r:
            out.append(f"| {label} | {gbs} | - | not measured | | | |")
            continue
        ratio = f"{r['tokens_per_s_per_gpu'] / peer['tokens_per_s_per_gpu']:.2f}x" if peer else "-"
        out.append(f"| {label} | {gbs} | {router_of(r)} | {r['tokens_per_s_per_gpu']:,.0f} | {r['tflops_per_gpu']:.0f} | "
                   f"{ratio} | {r['device_call'].split(' ')[0]} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    text = tables()
    if not args.write:
        print(text)
        return
    for p, begin, end, body in ((GALLERY / "perf-notes.md", BEGIN, END, text),
                                (GALLERY.parent / "README.md", README_BEGIN, README_END, readme_highlights())):
        s = p.read_text()
        a, b = s.index(begin) + len(begin), s.index(end)
        p.write_text(s[:a] + "\n" + body + "\n" + s[b:])


if __name__ == "__main__":
    main()
