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

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from moelab.config import Config, ConfigError, load_config
from moelab.gallery.memory import MEMORY_TARGET, memory_section  # noqa: F401  (MEMORY_TARGET: read from here)
from moelab.gallery.current import peers_section, step_trials
from moelab.gallery.records import (REBUILD_KEYS as _REBUILD_KEYS, fmt as _fmt, gpu_memory_of, planner_options,
                                   rebuild_config, router_of, router_sweep_section, stale_note)

LAYOUT_KEYS = ("tp", "pp", "cp", "ep", "vp", "fsdp")
RESULT_FIELDS = ("system", "workload", "gpus", "gpu_name", "tokens_per_s_per_gpu", "tflops_per_gpu",
                 "peak_memory_gb", "flops_convention", "command", "commit", "torch_version", "date")


class GalleryError(RuntimeError):
    """An entry that cannot run here, or a gallery folder that is not well formed; the message says why.

        run_entry("deepseek-v3-1024gpu")   # GalleryError: ... needs 1024 CUDA GPU(s) ...
    """


def default_root() -> Path:
    """gallery/ of the moelab checkout (this package's parent folder), or $MOELAB_GALLERY."""
    return Path(os.environ.get("MOELAB_GALLERY") or Path(__file__).resolve().parents[2] / "gallery")


@dataclass
class Entry:
    """One gallery row. ``device`` is "cuda" or "cpu"; ``published`` holds the reference table's figures
    (None for proxies); ``proxy_of`` names the published entry whose layer shapes a proxy keeps.

        get_entry("tiny-cpu").config()          # the entry's Config, overrides applied
    """
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
    table_layout: str | None = None  # the reference table's layout text, where it prints '-' for a size it ran

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
        """The reference table's notation: [TP,PP,CP,EP,VP,FSDP] with '-' for an unused EP or VP (or the table's
        own text, `table_layout`, where it prints '-' for an EP its run set)."""
        if self.table_layout:
            return self.table_layout
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
    if not (root / "entries").is_dir():
        raise GalleryError(f"{root} is not a gallery folder: it has no entries/ folder of *.yaml entries")
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
        hint = ("run a one-GPU proxy entry instead (`moelab gallery list` shows them)" if not entry.proxy_of
                else "`moelab gallery list` shows what else there is")
        return (f"gallery entry {entry.name!r} needs {entry.gpus} CUDA GPU(s){hw}; this machine has {have}. "
                f"Run it on a machine with {entry.gpus}+ GPUs, or {hint}.")
    return None


def _measure(cfg: Config, gpus: int, steps: int, warmup: int, run_dir: Path, command: str) -> dict:
    """Run the path of `moelab bench` (moelab.train.bench.bench) and return its record. Several GPUs: one process per
    GPU through moelab's local launcher, each the one rank entry point in its bench mode
    (``python -m moelab.launch.entry RUN_DIR --bench STEPS WARMUP COMMAND``); logs in RUN_DIR/logs/."""
    from moelab.config import save_config
    from moelab.launch.local import RankFailed, launch
    from moelab.contract.folder import RunFolder

    if gpus == 1:
        return _bench_here(cfg, steps, warmup, command)
    folder = RunFolder(run_dir)
    folder.path.mkdir(parents=True, exist_ok=True)
    save_config(cfg, folder.config)
    argv = [sys.executable, "-m", "moelab.launch.entry", str(folder.path), "--bench", str(steps), str(warmup),
            command]
    try:
        launch(argv, gpus, folder.logs, metrics_path=folder.metrics)
    except RankFailed as e:
        raise GalleryError(f"{' '.join(argv)} failed: {e}") from None
    return json.loads(folder.bench.read_text())


def _bench_here(cfg: Config, steps: int, warmup: int, command: str) -> dict:
    from moelab.train.bench import bench

    return dict(bench(cfg, steps=steps, warmup=warmup, command=command))


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
    if entry.device == "cuda":  # the planner's word before spending GPU time (an upper bound: warn, not refuse)
        p = _planned(entry)
        if not isinstance(p, str) and not p.fits:
            print(f"moelab gallery: warning: the planner expects {entry.name} not to fit: {p.verdict}",
                  file=sys.stderr)
    run_dir = Path(out) if out else Path("runs") / "gallery" / entry.name
    command = command or f"moelab gallery run {entry.name} --steps {steps} --warmup {warmup}"
    record = _measure(cfg, entry.gpus, steps, warmup, run_dir, command)
    # the bench record as it is, named after the entry; CPU runs have no allocator peak to report
    result = {**record, "system": "moelab", "workload": entry.name, "preset": entry.preset, "command": command}
    if entry.device == "cpu":
        result["peak_memory_gb"] = None
    missing = [k for k in RESULT_FIELDS if k not in result]
    if missing:
        raise GalleryError(f"the benchmark record lacks {missing}")
    results = root / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{entry.name}--moelab.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


# ---------------------------------------------------------------------- the report
def _planned(entry: Entry, gpu_memory_gb: float | None = None):
    """The planner's answer for an entry, or the reason there is none (a preset not there yet)."""
    from moelab.planner.plan import plan

    try:
        return plan(entry.config(), gpus=entry.gpus, gpu_memory_gb=gpu_memory_gb)
    except ConfigError as e:
        return str(e)


def _config_for_result(r: dict, entries: dict) -> Config | None:
    """The config a result ran (moelab.gallery.records.rebuild_config), or None where it cannot be rebuilt."""
    return rebuild_config(r, entries)[0]


def _planned_for_result(r: dict, entries: dict, gpu: str | None = None):
    """The plan of the config a result ran (_config_for_result), as the code of its day ran it
    (moelab.gallery.records.planner_options), or None; `gpu`: with its predicted speed."""
    from moelab.planner.plan import plan

    cfg = _config_for_result(r, entries)
    try:
        return None if cfg is None else plan(cfg, gpus=int(r.get("gpus", 1)),
                                             gpu_memory_gb=gpu_memory_of(r.get("gpu_name")), gpu=gpu,
                                             **planner_options(r))
    except (ConfigError, KeyError, TypeError, ValueError):
        return None


def entry_result(results: list[dict], entry: Entry) -> dict | None:
    """The newest moelab result of `entry`: one named after it, or a run of its preset through moelab's command
    (not a `python` script, which may change the model in place) on the same number of GPUs whose recorded
    settings (batch, sequence, dtypes, checkpointing, compile, FP8, router kind, EP) equal the entry's; a newer
    run replaces an older named one. An A/B arm that ran other than today's code (moelab.gallery.current's
    step_trials, e.g. clipping's multiply as its own pass) is not the entry's result."""
    mine = [r for r in results if r.get("system") == "moelab" and r.get("workload") == entry.name
            and not step_trials(r)]
    try:
        cfg = entry.config()
    except ConfigError:
        cfg = None
    if cfg is not None and not cfg.train.lora.rank:  # a LoRA entry has only results of its own
        t = cfg.train
        want = {"global_batch_size": t.global_batch_size, "micro_batch_size": t.micro_batch_size,
                "seq_len": t.seq_len, "dtype": t.dtype, "param_dtype": t.param_dtype,
                "activation_checkpointing": t.activation_checkpointing, "compile": t.compile, "fp8": t.fp8}
        mine += [r for r in results if r.get("system") == "moelab" and r.get("workload") == entry.preset
                 and not str(r.get("command", "")).startswith("python") and r.get("gpus") == entry.gpus
                 and all(r.get(k, v) == v for k, v in want.items())
                 and router_of(r).kind in (cfg.backend.router_kind, "unknown")
                 and (r.get("layout") or {}).get("ep", entry.layout["ep"]) == entry.layout["ep"]]
    return max(mine, key=lambda r: str(r.get("date", ""))) if mine else None


def render_report(root: "str | Path | None" = None, plots: bool = True) -> str:
    """Render root/README.md (and root/*.png) from the entries and results; returns the markdown: the published
    figures against those measured here, the peers, planned against measured memory, then the plots."""
    root = Path(root) if root else default_root()
    entries, results = load_entries(root), load_results(root)
    by_name = {e.name: e for e in entries}
    from moelab.gallery.speed import speed_section

    lines = _published_section(entries, results, by_name) + peers_section(results, by_name)
    memory_lines, mem_rows = memory_section(results, by_name)
    lines += memory_lines
    lines += speed_section(entries, results, _planned_for_result, _REBUILD_KEYS)
    lines += router_sweep_section(results)
    if plots:
        lines += _plots(root, entries, results, mem_rows)
    text = "\n".join(lines) + "\n"
    (root / "README.md").write_text(text)
    return text


def _published_section(entries: list, results: list, by_name: dict) -> list[str]:
    lines = ["# moelab benchmark gallery", "",
             "Generated by `moelab gallery report` from `gallery/entries/*.yaml` (the published layouts and "
             "figures of the reference table, DGX H100, BF16) and `gallery/results/*.json` (runs of this "
             "checkout on real hardware; one file per system and workload). Do not edit by hand.", "",
             "Published figures come from the reference table; every measured figure comes from a result file. "
             "A row without a result says why it was not run here.", "",
             "## Published vs measured here", "",
             "| entry | model | GPUs | layout [TP,PP,CP,EP,VP,FSDP] | global batch | optimisations | published "
             "TFLOPs/GPU | published tokens/s/GPU | measured TFLOPs/GPU | measured tokens/s/GPU | measured on | "
             "router | planned memory/GPU | status |",
             "|---|---|---:|---|---:|---|---:|---:|---:|---:|---|---|---:|---|"]
    for e in entries:
        r = entry_result(results, e)
        pub = e.published or {}
        p = _planned(e, gpu_memory_of(r["gpu_name"] if r else e.hardware))
        planned = "preset not available" if isinstance(p, str) else (
            f"{p.memory_per_gpu_bytes / 2**30:,.1f} GiB"
            + ("" if p.fits else f" (does not fit {p.gpu_memory_gb:.0f} GiB)"))
        gbs = e.global_batch_size or (p.global_batch_size if not isinstance(p, str) else "-")
        model = e.title + (f" (proxy of {by_name[e.proxy_of].title})" if e.proxy_of in by_name else "")
        if r:
            status = f"measured {str(r.get('date', ''))[:10]}, commit {str(r.get('commit', '?'))[:12]}, {r['_file']}"
            try:
                status += stale_note(r, e.config(), by_name)
            except ConfigError:
                pass
            measured = [_fmt(r.get("tflops_per_gpu"), 1), _fmt(r.get("tokens_per_s_per_gpu")),
                        f"{r.get('gpus')} x {r.get('gpu_name')}", str(router_of(r, by_name))]
        else:
            status = "not run here: " + (hardware_need(e))
            measured = ["-", "-", "-", "-"]
        lines.append(f"| {e.name} | {model} | {e.gpus} | {e.layout_text} | {gbs} | "
                     f"{e.optimizations or '-'} | {_fmt(pub.get('tflops_per_gpu'))} | "
                     f"{_fmt(pub.get('tokens_per_s_per_gpu'))} | {' | '.join(measured)} | {planned} | {status} |")
    return lines + ["", "Planned memory is `moelab plan` for the entry's layout (assumptions in moelab/planner/plan.py; "
                    "the planned-vs-measured table below checks it against real runs); "
                    "TFLOPs follow moelab's FLOPs convention (`moelab.planner.flops.FLOPS_CONVENTION`), which counts "
                    "the router that the published convention leaves out.", ""]


def hardware_need(e: Entry) -> str:
    if e.device == "cpu":
        return "no result file yet (runs on any CPU: `moelab gallery run " + e.name + "`)"
    hw = f" {e.hardware}" if e.hardware else ""
    if e.gpus > 2:
        return f"needs {e.gpus}{hw} GPUs"
    return f"no result file yet (needs {e.gpus}{hw} GPU{'s' if e.gpus > 1 else ''})"


def _plots(root: Path, entries: list[Entry], results: list[dict], mem_rows: list) -> list[str]:
    out = []
    by_name = {e.name: e for e in entries}
    pub = {e.name: (e.published or {}).get("tflops_per_gpu") for e in entries}
    meas = {e.name: (entry_result(results, e) or {}).get("tflops_per_gpu") for e in entries}
    # a proxy is drawn next to the published figure of the full model it stands for
    parent = {e.name: pub.get(e.proxy_of) for e in entries if e.proxy_of in by_name}
    names = [e.name for e in entries
             if e.device == "cuda" and (pub[e.name] is not None or meas[e.name] is not None)]
    if names:
        fig, ax = _paired_bars(names, [pub[n] or 0 for n in names], [meas[n] or 0 for n in names],
                               ("published (H100)", "measured here"),
                               "TFLOPs/s per GPU (moelab's FLOPs convention for measured runs)", row_height=0.35)
        marks = [(parent[n], i) for i, n in enumerate(names) if parent.get(n)]
        if marks:
            ax.scatter([m[0] for m in marks], [m[1] for m in marks], marker="|", s=200, color="black",
                       label="published, full model (for a proxy)")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
        fig.savefig(root / "tflops.png", dpi=90)
        out += ["## Plots", "", "![TFLOPs per GPU](tflops.png)", ""]
    if mem_rows:
        fig, _ = _paired_bars([r[0] for r in mem_rows], [r[1] for r in mem_rows], [r[2] for r in mem_rows],
                              ("planned", "measured peak"), "GiB per GPU", row_height=0.4)
        fig.savefig(root / "memory.png", dpi=90)
        out += ["![Planned vs measured memory](memory.png)", ""]
    return out


def _paired_bars(names: list[str], first: list[float], second: list[float], labels: tuple[str, str],
                 xlabel: str, row_height: float):
    """Horizontal bars, two per row (first above second), on an Agg figure: no pyplot, no backend switch."""
    from moelab.live.plots import new_figure

    fig = new_figure(11, row_height * len(names) + 1.5, dpi=90)
    ax = fig.add_subplot()
    y = list(range(len(names)))
    ax.barh([i - 0.2 for i in y], first, height=0.4, label=labels[0])
    ax.barh([i + 0.2 for i in y], second, height=0.4, label=labels[1])
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig, ax


# ---------------------------------------------------------------------- CLI
def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="gallery_command", required=True)
    q = sub.add_parser("list", help="list the entries and whether each has a result")
    q.add_argument("--dir", help="gallery folder (default: the checkout's gallery/)")
    q = sub.add_parser("run", help="run an entry here and save its result in gallery/results/")
    q.add_argument("name")
    q.add_argument("--steps", type=int, default=20)
    q.add_argument("--warmup", type=int, default=5)
    q.add_argument("--out", help="folder for a multi-GPU run's config and record (default runs/gallery/<name>)")
    q.add_argument("--dir", help="gallery folder (default: the checkout's gallery/)")
    q = sub.add_parser("report", help="render gallery/README.md and plots from entries and results")
    q.add_argument("--dir", help="gallery folder (default: the checkout's gallery/)")
    q.add_argument("--no-plots", action="store_true")


def main(args) -> int:
    try:
        if args.gallery_command == "list":
            results, entries = load_results(args.dir), load_entries(args.dir)
            width = max(len(e.name) for e in entries)
            for e in entries:
                r = entry_result(results, e)
                state = (f"measured {_fmt(r.get('tokens_per_s_per_gpu'))} tok/s/GPU, router {router_of(r)}" if r
                         else hardware_need(e))
                print(f"{e.name:{width}s} {e.gpus:4d} GPU  {e.layout_text:18s} {state}")
        elif args.gallery_command == "run":
            r = run_entry(args.name, steps=args.steps, warmup=args.warmup, out=args.out, root=args.dir)
            root = Path(args.dir) if args.dir else default_root()
            unit = "GPU" if get_entry(args.name, root).device == "cuda" else "rank"
            print(f"{args.name}: {_fmt(r.get('tokens_per_s_per_gpu'))} tokens/s per {unit}; result written to "
                  f"{root / 'results' / f'{args.name}--moelab.json'} (`moelab gallery report` puts it in the table)")
        elif args.gallery_command == "report":
            render_report(args.dir, plots=not args.no_plots)
            print(f"wrote {Path(args.dir) if args.dir else default_root()}/README.md")
        return 0
    except GalleryError as e:
        print(f"moelab gallery: {e}", file=sys.stderr)
        return 2

