"""The benchmark gallery: the reference table's rows and their one-GPU layer proxies, run where the hardware
allows, with results kept as JSON and a README rendered from them.

    moelab gallery list
    moelab gallery run qwen3-moe-30b-a3b-proxy-1gpu --steps 20     # -> gallery/results/<entry>--moelab.json
    moelab gallery report                                           # -> gallery/README.md and gallery/*.png

Layout of gallery/: ``entries/*.yaml`` (one entry per published row or proxy run: preset, GPUs, the published
layout [TP, PP, CP, EP, VP, FSDP], batch, optimisations, the published figures), ``results/*.json`` (one file
per system and workload, written only by real runs: this module for moelab, the benchmark helpers for peers),
``README.md`` and plots (rendered, never edited by hand). No figure in a result is typed in: a row without a
result says "not run here" and why.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from moelab.config import Config, ConfigError, load_config

LAYOUT_KEYS = ("tp", "pp", "cp", "ep", "vp", "fsdp")
RESULT_FIELDS = ("system", "workload", "gpus", "gpu_name", "tokens_per_s_per_gpu", "tflops_per_gpu",
                 "peak_memory_gb", "flops_convention", "command", "commit", "torch_version", "date")


class GalleryError(RuntimeError):
    """An entry that cannot run here, or a gallery folder that is not well formed; the message says why."""


def default_root() -> Path:
    """gallery/ of the moelab checkout (this package's parent folder), or $MOELAB_GALLERY."""
    return Path(os.environ.get("MOELAB_GALLERY") or Path(__file__).resolve().parents[1] / "gallery")


@dataclass
class Entry:
    """One gallery row. ``device`` is "cuda" or "cpu"; ``published`` holds the reference table's figures
    (None for proxies); ``proxy_of`` names the published entry whose layer shapes a proxy keeps."""
    name: str
    title: str
    preset: str
    gpus: int
    layout: dict
    global_batch_size: int | None = None  # None: the preset's batch per data-parallel rank, times fsdp
    micro_batch_size: int | None = None
    seq_len: int | None = None
    device: str = "cuda"
    hardware: str = ""
    optimizations: str = ""
    published: dict | None = None
    proxy_of: str | None = None
    overrides: dict = field(default_factory=dict)
    notes: str = ""

    @classmethod
    def from_yaml(cls, path: Path) -> "Entry":
        d = yaml.safe_load(path.read_text()) or {}
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise GalleryError(f"{path}: unknown keys {sorted(unknown)}; valid keys: {sorted(known)}")
        missing = [k for k in ("name", "title", "preset", "gpus", "layout") if k not in d]
        if missing:
            raise GalleryError(f"{path}: missing keys {missing}")
        layout = {k: int(d["layout"].get(k, 1)) for k in LAYOUT_KEYS}
        if set(d["layout"]) - set(LAYOUT_KEYS):
            raise GalleryError(f"{path}: layout keys must be among {LAYOUT_KEYS}")
        if d.get("device", "cuda") not in ("cuda", "cpu"):
            raise GalleryError(f"{path}: device must be 'cuda' or 'cpu'")
        return cls(**{**d, "layout": layout})

    @property
    def layout_text(self) -> str:
        """The reference table's notation: [TP,PP,CP,EP,VP,FSDP] with '-' for an unused EP or VP."""
        L = self.layout
        return "[" + ",".join("-" if k in ("ep", "vp") and L[k] == 1 else str(L[k]) for k in LAYOUT_KEYS) + "]"

    def config(self) -> Config:
        """The moelab config of this entry: its preset with the layout, batch and overrides applied."""
        o = {f"parallel.{k}": v for k, v in self.layout.items()}
        if self.layout["vp"] > 1:
            o["parallel.pp_schedule"] = "interleaved_1f1b"
        if self.global_batch_size:
            o["train.global_batch_size"] = self.global_batch_size
        else:
            preset = load_config(self.preset)
            o["train.global_batch_size"] = preset.train.global_batch_size * self.layout["fsdp"]
        if self.micro_batch_size:
            o["train.micro_batch_size"] = self.micro_batch_size
        if self.seq_len:
            o["train.seq_len"] = self.seq_len
        if self.device == "cpu":
            o["train.device"] = "cpu"
        o.update(self.overrides)
        cfg = load_config(self.preset, o)
        return cfg.replace(name=self.name)


def load_entries(root: "str | Path | None" = None) -> list[Entry]:
    root = Path(root) if root else default_root()
    entries = [Entry.from_yaml(p) for p in sorted((root / "entries").glob("*.yaml"))]
    names = [e.name for e in entries]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise GalleryError(f"{root / 'entries'}: duplicate entry names {sorted(dup)}")
    return entries


def get_entry(name: str, root: "str | Path | None" = None) -> Entry:
    entries = {e.name: e for e in load_entries(root)}
    if name not in entries:
        import difflib

        close = difflib.get_close_matches(name, list(entries), n=1)
        raise GalleryError(f"no gallery entry {name!r}" + (f"; did you mean {close[0]!r}?" if close else "")
                           + f" Entries: {', '.join(entries)}")
    return entries[name]


def load_results(root: "str | Path | None" = None) -> list[dict]:
    """Every result JSON under root/results (files that are not result objects are skipped)."""
    root = Path(root) if root else default_root()
    out = []
    for p in sorted((root / "results").glob("*.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(d, dict) and "system" in d and "workload" in d:
            out.append({**d, "_file": p.name})
    return out


# ---------------------------------------------------------------------- running
def hardware_check(entry: Entry) -> str | None:
    """None if this machine can run `entry`, else what it needs and what is here."""
    if entry.device == "cpu":
        return None
    try:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        have = f"{n} CUDA GPU(s)" + (f" ({torch.cuda.get_device_name(0)})" if n else "")
    except Exception:  # a torch without CUDA support
        n, have = 0, "no CUDA"
    if n < entry.gpus:
        hw = f" ({entry.hardware})" if entry.hardware else ""
        return (f"gallery entry {entry.name!r} needs {entry.gpus} CUDA GPU(s){hw}; this machine has {have}. "
                f"Run it on a machine with {entry.gpus}+ GPUs, or run a proxy entry "
                f"(`moelab gallery list` shows them).")
    return None


def git_commit(repo: "str | Path | None" = None) -> str:
    """`git rev-parse HEAD`, with "-dirty" when tracked files differ from it; "unknown" outside a checkout."""
    repo = Path(repo) if repo else Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def _measure(cfg: Config, gpus: int, steps: int, warmup: int, run_dir: Path) -> tuple[dict, str]:
    """Run the benchmark path and return (figures, method). One GPU or CPU: moelab.bench.bench when it exists,
    else the trainer's summary; several GPUs: torchrun over moelab.launch.entry (the trainer's summary)."""
    if gpus == 1:
        try:
            from moelab.bench import bench
        except ImportError:
            bench = None
        if bench is not None:
            return dict(bench(cfg, steps=steps, warmup=warmup)), "moelab.bench"
        from moelab.train.trainer import Trainer

        return Trainer(cfg.replace(**{"train.steps": steps}), run_dir).run(), "trainer summary"
    from moelab.config import save_config

    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg.replace(**{"train.steps": steps}), run_dir / "config.yaml")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
           "-m", "moelab.launch.entry", str(run_dir)]
    proc = subprocess.run(cmd)
    if proc.returncode:
        raise GalleryError(f"{' '.join(cmd)} failed with exit code {proc.returncode}; see {run_dir}/metrics.jsonl")
    return json.loads((run_dir / "summary.json").read_text()), "trainer summary (torchrun)"


def run_entry(name: str, steps: int = 20, warmup: int = 5, out: "str | Path | None" = None,
              root: "str | Path | None" = None, command: str | None = None) -> dict:
    """Run gallery entry `name` here and save its result JSON in root/results; returns the result.

        result = run_entry("tiny-cpu", steps=6)
    """
    root = Path(root) if root else default_root()
    entry = get_entry(name, root)
    problem = hardware_check(entry)
    if problem:
        raise GalleryError(problem)
    cfg = entry.config()
    run_dir = Path(out) if out else Path("runs") / "gallery" / entry.name
    import torch

    from moelab.flops import FLOPS_CONVENTION

    figures, method = _measure(cfg, entry.gpus, steps, warmup, run_dir)
    gpu_name = (torch.cuda.get_device_name(0) if entry.device == "cuda" else
                __import__("platform").processor() or "cpu")
    result = {
        "system": "moelab", "workload": entry.name, "gpus": entry.gpus, "gpu_name": gpu_name,
        "tokens_per_s_per_gpu": figures.get("tokens_per_s_per_gpu"), "tflops_per_gpu": figures.get("tflops_per_gpu"),
        "peak_memory_gb": figures.get("peak_memory_gb"), "mfu": figures.get("mfu"),
        "flops_convention": figures.get("flops_convention", FLOPS_CONVENTION),
        "command": command or f"moelab gallery run {entry.name} --steps {steps}",
        "commit": git_commit(), "torch_version": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": method, "steps": steps, "warmup": warmup, "preset": entry.preset,
        "layout": entry.layout, "global_batch_size": cfg.train.global_batch_size,
        "micro_batch_size": cfg.train.micro_batch_size, "seq_len": cfg.train.seq_len, "dtype": cfg.train.dtype,
    }
    results = root / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{entry.name}--moelab.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


# ---------------------------------------------------------------------- the report
def _fmt(v, digits: int = 0) -> str:
    if v is None:
        return "-"
    return f"{v:,.{digits}f}"


def _planned(entry: Entry, gpu_memory_gb: float | None = None):
    """The planner's answer for an entry, or the reason there is none (a preset not there yet)."""
    from moelab.plan import plan

    try:
        return plan(entry.config(), gpus=entry.gpus, gpu_memory_gb=gpu_memory_gb)
    except ConfigError as e:
        return str(e)


def _moelab_result(results: list[dict], name: str) -> dict | None:
    mine = [r for r in results if r.get("system") == "moelab" and r.get("workload") == name]
    return max(mine, key=lambda r: str(r.get("date", ""))) if mine else None


def _gpu_memory_of(gpu_name: str) -> float | None:
    """Memory of a GPU named in a result, for the planner's verdict (None: the planner's default)."""
    name = (gpu_name or "").upper()
    for key, gb in (("H200", 139.8), ("H100", 79.6), ("A100", 79.2), ("B200", 178.4)):
        if key in name:
            return gb
    return None


def render_report(root: "str | Path | None" = None, plots: bool = True) -> str:
    """Render root/README.md (and root/*.png) from the entries and results; returns the markdown."""
    root = Path(root) if root else default_root()
    entries, results = load_entries(root), load_results(root)
    by_name = {e.name: e for e in entries}
    lines = ["# moelab benchmark gallery", "",
             "Generated by `moelab gallery report` from `gallery/entries/*.yaml` (the published layouts and "
             "figures of the reference table, DGX H100, BF16) and `gallery/results/*.json` (runs of this "
             "checkout on real hardware; one file per system and workload). Do not edit by hand.", "",
             "Published figures come from the reference table; every measured figure comes from a result file. "
             "A row without a result says why it was not run here.", "",
             "## Published vs measured here", "",
             "| entry | model | GPUs | layout [TP,PP,CP,EP,VP,FSDP] | global batch | optimisations | published "
             "TFLOPs/GPU | published tokens/s/GPU | measured TFLOPs/GPU | measured tokens/s/GPU | measured on | "
             "planned memory/GPU | status |",
             "|---|---|---:|---|---:|---|---:|---:|---:|---:|---|---:|---|"]
    for e in entries:
        r = _moelab_result(results, e.name)
        pub = e.published or {}
        p = _planned(e, _gpu_memory_of(r["gpu_name"]) if r else None)
        planned = f"{p.memory_per_gpu_bytes / 2**30:,.1f} GiB" if not isinstance(p, str) else "preset not available"
        gbs = e.global_batch_size or (p.global_batch_size if not isinstance(p, str) else "-")
        model = e.title + (f" (proxy of {by_name[e.proxy_of].title})" if e.proxy_of in by_name else "")
        if r:
            status = f"measured {str(r.get('date', ''))[:10]}, {r.get('commit', '?')[:12]}"
            measured = [_fmt(r.get("tflops_per_gpu"), 1), _fmt(r.get("tokens_per_s_per_gpu")),
                        f"{r.get('gpus')} x {r.get('gpu_name')}"]
        else:
            status = "not run here: " + (hardware_need(e))
            measured = ["-", "-", "-"]
        lines.append(f"| {e.name} | {model} | {e.gpus} | {e.layout_text} | {gbs} | "
                     f"{e.optimizations or '-'} | {_fmt(pub.get('tflops_per_gpu'))} | "
                     f"{_fmt(pub.get('tokens_per_s_per_gpu'))} | {' | '.join(measured)} | {planned} | {status} |")
    lines += ["", "Planned memory is `moelab plan` for the entry's layout (an upper bound: see moelab/plan.py); "
              "TFLOPs follow moelab's FLOPs convention (`moelab.flops.FLOPS_CONVENTION`), which counts the "
              "router that the published convention leaves out.", ""]

    # peers: every workload that has a result from a system other than moelab
    peer_workloads = sorted({r["workload"] for r in results if r.get("system") != "moelab"})
    lines += ["## Peers on the same workload and GPU", ""]
    if not peer_workloads:
        lines += ["No peer results yet (result files with a `system` other than \"moelab\").", ""]
    for w in peer_workloads:
        lines += [f"### {w}", "", "| system | GPUs | GPU | tokens/s/GPU | TFLOPs/GPU | peak memory GB | torch | "
                  "commit | command |", "|---|---:|---|---:|---:|---:|---|---|---|"]
        rows = sorted((r for r in results if r["workload"] == w), key=lambda r: (r["system"] != "moelab",
                                                                                   r["system"]))
        for r in rows:
            lines.append(f"| {r['system']} | {r.get('gpus', '-')} | {r.get('gpu_name', '-')} | "
                         f"{_fmt(r.get('tokens_per_s_per_gpu'))} | {_fmt(r.get('tflops_per_gpu'), 1)} | "
                         f"{_fmt(r.get('peak_memory_gb'), 1)} | {r.get('torch_version', '-')} | "
                         f"{str(r.get('commit', '-'))[:12]} | `{r.get('command', '-')}` |")
        lines.append("")

    # planned vs measured memory
    lines += ["## Planned vs measured memory per GPU", "",
              "| entry | GPU | planned GiB | measured peak GiB | measured / planned | planner's biggest term |",
              "|---|---|---:|---:|---:|---|"]
    mem_rows = []
    for e in entries:
        r = _moelab_result(results, e.name)
        if not r or r.get("peak_memory_gb") is None:
            continue
        p = _planned(e, _gpu_memory_of(r.get("gpu_name", "")))
        if isinstance(p, str):
            continue
        planned = p.memory_per_gpu_bytes / 2**30
        mem_rows.append((e.name, planned, r["peak_memory_gb"]))
        lines.append(f"| {e.name} | {r.get('gpu_name')} | {planned:,.2f} | {r['peak_memory_gb']:,.2f} | "
                     f"{r['peak_memory_gb'] / planned:.2f} | {p.biggest_term} |")
    if not mem_rows:
        lines.append("| (no result with a measured peak memory yet) | | | | | |")
    lines.append("")

    if plots:
        lines += _plots(root, entries, results, mem_rows)
    text = "\n".join(lines) + "\n"
    (root / "README.md").write_text(text)
    return text


def hardware_need(e: Entry) -> str:
    if e.device == "cpu":
        return "no result file yet (runs on any CPU: `moelab gallery run " + e.name + "`)"
    hw = f" {e.hardware}" if e.hardware else ""
    if e.gpus > 2:
        return f"needs {e.gpus}{hw} GPUs"
    return f"no result file yet (needs {e.gpus}{hw} GPU{'s' if e.gpus > 1 else ''})"


def _plots(root: Path, entries: list[Entry], results: list[dict], mem_rows: list) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    names = [e.name for e in entries]
    pub = [(e.published or {}).get("tflops_per_gpu") for e in entries]
    meas = [(_moelab_result(results, n) or {}).get("tflops_per_gpu") for n in names]
    if any(v is not None for v in pub + meas):
        fig, ax = plt.subplots(figsize=(9, 0.35 * len(names) + 1.5))
        y = range(len(names))
        ax.barh([i - 0.2 for i in y], [v or 0 for v in pub], height=0.4, label="published (H100)")
        ax.barh([i + 0.2 for i in y], [v or 0 for v in meas], height=0.4, label="measured here")
        ax.set_yticks(list(y), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("TFLOPs/s per GPU (missing bar: no figure)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(root / "tflops.png", dpi=90)
        plt.close(fig)
        out += ["## Plots", "", "![TFLOPs per GPU](tflops.png)", ""]
    if mem_rows:
        fig, ax = plt.subplots(figsize=(7, 0.4 * len(mem_rows) + 1.5))
        y = range(len(mem_rows))
        ax.barh([i - 0.2 for i in y], [r[1] for r in mem_rows], height=0.4, label="planned")
        ax.barh([i + 0.2 for i in y], [r[2] for r in mem_rows], height=0.4, label="measured peak")
        ax.set_yticks(list(y), [r[0] for r in mem_rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("GiB per GPU")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(root / "memory.png", dpi=90)
        plt.close(fig)
        out += ["![Planned vs measured memory](memory.png)", ""]
    return out


# ---------------------------------------------------------------------- CLI
def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="gallery_command", required=True)
    q = sub.add_parser("list", help="list the entries and whether each has a result")
    q.add_argument("--dir", help="gallery folder (default: the checkout's gallery/)")
    q = sub.add_parser("run", help="run an entry here and save its result in gallery/results/")
    q.add_argument("name")
    q.add_argument("--steps", type=int, default=20)
    q.add_argument("--warmup", type=int, default=5)
    q.add_argument("--out", help="run folder (default runs/gallery/<name>)")
    q.add_argument("--dir", help="gallery folder (default: the checkout's gallery/)")
    q = sub.add_parser("report", help="render gallery/README.md and plots from entries and results")
    q.add_argument("--dir", help="gallery folder (default: the checkout's gallery/)")
    q.add_argument("--no-plots", action="store_true")


def main(args) -> int:
    try:
        if args.gallery_command == "list":
            results = load_results(args.dir)
            for e in load_entries(args.dir):
                r = _moelab_result(results, e.name)
                state = (f"measured {_fmt(r.get('tokens_per_s_per_gpu'))} tok/s/GPU" if r
                         else hardware_need(e))
                print(f"{e.name:34s} {e.gpus:5d} GPU  {e.layout_text:18s} {state}")
        elif args.gallery_command == "run":
            cmd = " ".join(["moelab", "gallery", "run", args.name, "--steps", str(args.steps)])
            r = run_entry(args.name, steps=args.steps, warmup=args.warmup, out=args.out, root=args.dir,
                          command=cmd)
            print(json.dumps(r, indent=1))
        elif args.gallery_command == "report":
            render_report(args.dir, plots=not args.no_plots)
            print(f"wrote {Path(args.dir) if args.dir else default_root()}/README.md")
        return 0
    except GalleryError as e:
        print(f"moelab gallery: {e}", file=sys.stderr)
        return 2
