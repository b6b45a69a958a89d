"""CPU measurements for the second seed's features (issue 25): node-limited routing's dispatch counts under EP=4,
1-bit expert gradients (bytes and convergence), replicated data parallel against FSDP2, and two-level routing
against flat top-k on a 128-expert proxy. Every run is real training on gloo processes (or one process) here.

    python gallery/scripts/seed_features.py            # -> gallery/seed-features/seed_features.json and .md
    python gallery/scripts/seed_features.py --quick    # fewer steps, a smoke test of the script
    python gallery/scripts/seed_features.py --render   # the .md page again from the JSON

The JSON holds the command, the machine, the commit, every configuration's overrides, the measured figures and
the planner's figures for the same configs. GPU step times need two GPUs (not lent to this session): not here.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from moelab.config import load_config
from moelab.parallel.env import DistEnv
from moelab.launch.local import run_local_processes
from moelab.planner.plan import plan
from moelab.contract.stream import read_events
from moelab.train.trainer import Trainer

GALLERY = Path(__file__).resolve().parents[1]
SMALL = ["train.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=2", "train.warmup_steps=1",
         "train.save_checkpoints=false"]
# the convergence workload of tests/parallel/test_compression.py (the synthetic Markov chain)
LEARN = ["train.seq_len=32", "train.global_batch_size=8", "train.micro_batch_size=4", "train.warmup_steps=10",
         "train.lr=0.01", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=1",
         "model.moe.num_experts=8", "model.moe.expert_ffn_size=32", "model.dense_ffn_size=64", "model.vocab_size=64",
         "train.save_checkpoints=false", "parallel.expert_dp=replicate"]
# a 128-expert proxy of the tiny preset (top-8 of 128 narrow experts), one process
WIDE = ["model.moe.num_experts=128", "model.moe.top_k=8", "model.moe.expert_ffn_size=16", "train.seq_len=64",
        "train.global_batch_size=8", "train.micro_batch_size=4", "train.save_checkpoints=false"]
ROUTINGS = {"flat top-8": [],
            "group-limited 8 groups, top 4": ["model.moe.num_groups=8", "model.moe.topk_groups=4"],
            "node-limited 8 ranks, at most 4": ["model.moe.routing_ranks=8", "model.moe.max_routed_ranks=4"],
            "node-limited 8 ranks, at most 2": ["model.moe.routing_ranks=8", "model.moe.max_routed_ranks=2"]}


def steps_of(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "step"]


def multi(overrides: list[str], run_dir: Path, nproc: int) -> list[dict]:
    cfg = load_config("tiny", overrides)
    run_local_processes(cfg, run_dir, nproc)
    return steps_of(run_dir)


def single(overrides: list[str], run_dir: Path) -> list[dict]:
    torch.set_num_threads(1)
    Trainer(load_config("tiny", overrides), run_dir, env=DistEnv()).run()
    return steps_of(run_dir)


def window_means(losses: list[float], w: int) -> list[float]:
    return [round(sum(losses[i:i + w]) / len(losses[i:i + w]), 4) for i in range(0, len(losses), w)]


def balance(events: list[dict], last: int) -> dict:
    """max/mean and cv of the routed load (before dropping), per MoE layer, averaged over layers and the last steps."""
    mx, cv = [], []
    for e in events[-last:]:
        for load in e["routing"]["routed_per_expert"]:
            t = torch.tensor(load)
            mx.append((t.max() / t.mean()).item())
            cv.append((t.std(correction=0) / t.mean()).item())
    return {"max_over_mean": round(sum(mx) / len(mx), 3), "cv": round(sum(cv) / len(cv), 3)}


def dispatch(root: Path, steps: int) -> dict:
    """EP=4 on 4 gloo processes, top-4 of 16 experts: flat against node-limited (at most 2 of 4 ranks)."""
    out = {}
    for name, extra in {"flat top-4": [], "node-limited, at most 2 of 4 ranks": [
            "model.moe.routing_ranks=4", "model.moe.max_routed_ranks=2"]}.items():
        ov = SMALL + ["model.moe.top_k=4", "parallel.ep=4", f"train.steps={steps}"] + extra
        ev = multi(ov, root / f"dispatch-{len(out)}", 4)
        comm = {k: sum(e["comm"][k] for e in ev) / len(ev) for k in
                ("dispatch_rows", "dispatch_bytes", "dispatch_token_ranks", "dispatch_once_per_rank_bytes")}
        reached = [sum(e["comm"]["tokens_by_ranks_reached"][i] for e in ev) for i in range(5)]
        tokens = sum(reached)
        p = plan(load_config("tiny", ov), gpus=4).comm
        out[name] = {"overrides": ov, "measured_per_step": comm,
                     "measured_ranks_per_token": round(sum(i * n for i, n in enumerate(reached)) / tokens, 4),
                     "tokens_by_ranks_reached": reached,
                     "planned_ranks_per_token": round(p["dispatch_ranks_per_token"], 4),
                     "planned_all_to_all_bytes_per_step": p["all_to_all_bytes_per_step"],
                     "planned_once_per_rank_dispatch_bytes_per_step": p["once_per_rank_dispatch_bytes_per_step"]}
    return out


def compression(root: Path, steps: int) -> dict:
    out = {}
    for mode in ("none", "sign"):
        ov = LEARN + [f"train.steps={steps}", f"train.expert_grad_compression={mode}"]
        t0 = time.time()
        ev = multi(ov, root / f"compression-{mode}", 2)
        losses = [e["loss"] for e in ev]
        out[mode] = {"overrides": ov, "wall_s": round(time.time() - t0, 1), "loss_first": round(losses[0], 4),
                     "loss_mean_last_50": round(sum(losses[-50:]) / len(losses[-50:]), 4),
                     "loss_mean_per_20_steps": window_means(losses, 20),
                     "expert_grad_bytes_per_step": ev[-1]["comm"]["expert_grad_bytes"],
                     "expert_grad_uncompressed_bytes_per_step": ev[-1]["comm"]["expert_grad_uncompressed_bytes"],
                     "planned_expert_grad_bytes_per_step_per_rank":
                         plan(load_config("tiny", ov), gpus=2).comm["expert_grad_bytes_per_step"]}
    n, s = out["none"]["loss_mean_last_50"], out["sign"]["loss_mean_last_50"]
    out["relative_gap_last_50"] = round(abs(s - n) / n, 5)
    return out


def replicated(root: Path) -> dict:
    """4 steps on 2 gloo processes: FSDP2, DDP, DDP with replicated experts (the equivalence tests' config)."""
    base = SMALL + ["train.steps=4", "model.moe.z_loss_coeff=0.001", "model.moe.capacity_factor=1.25"]
    out = {}
    for name, extra in {"fsdp": [], "ddp": ["parallel.data_parallel=ddp"],
                        "ddp + replicated experts": ["parallel.data_parallel=ddp", "parallel.expert_dp=replicate"]
                        }.items():
        ev = multi(base + extra, root / f"dp-{len(out)}", 2)
        p = plan(load_config("tiny", base + extra), gpus=2)
        out[name] = {"overrides": base + extra, "losses": [e["loss"] for e in ev],
                     "planned_params_per_gpu": p.params_per_gpu, "planned_memory_per_gpu_bytes": p.memory_per_gpu_bytes,
                     "planned_comm": {k: p.comm[k] for k in ("fsdp_all_gather_bytes_per_step",
                                                             "fsdp_reduce_scatter_bytes_per_step",
                                                             "ddp_all_reduce_bytes_per_step",
                                                             "expert_grad_bytes_per_step")}}
    return out


def routing(root: Path, steps: int) -> dict:
    out = {}
    for name, extra in ROUTINGS.items():
        ov = WIDE + [f"train.steps={steps}"] + extra
        t0 = time.time()
        ev = single(ov, root / f"routing-{len(out)}")
        losses = [e["loss"] for e in ev]
        out[name] = {"overrides": ov, "wall_s": round(time.time() - t0, 1),
                     "loss_mean_last_30": round(sum(losses[-30:]) / len(losses[-30:]), 4),
                     **balance(ev, 30), "planned_ranks_per_token_ep8":
                         round(plan(load_config("tiny", ov + ["train.micro_batch_size=1", "parallel.ep=8"]),
                                    gpus=8).comm["dispatch_ranks_per_token"], 3)}
    return out


def render(r: dict) -> str:
    """The Markdown page of a result (seed_features.md), from the JSON alone."""
    lines = [f"# The second seed's features, measured on CPU", "",
             f"Made by `{r['command'].strip()}` on {r['date']}, commit {r['commit'][:12]}, {r['machine']['cores']} "
             f"cores ({r['machine']['note']}), torch {r['machine']['torch']}. GPU: {r['gpu']}.", "",
             "## Node-limited routing: dispatch counts, EP=4 on gloo (16 experts, top-4), per step", "",
             "| routing | rows sent (all-to-all) | token-rank pairs (once per rank) | ranks per token, measured | "
             "planned | tokens reaching 0/1/2/3/4 ranks (all steps, all MoE layers) |", "|---|---:|---:|---:|---:|---|"]
    for name, d in r["node_limited_dispatch_ep4"].items():
        m = d["measured_per_step"]
        lines.append(f"| {name} | {m['dispatch_rows']:,.0f} ({m['dispatch_bytes'] / 2**10:,.0f} KiB) | "
                     f"{m['dispatch_token_ranks']:,.0f} ({m['dispatch_once_per_rank_bytes'] / 2**10:,.0f} KiB) | "
                     f"{d['measured_ranks_per_token']} | {d['planned_ranks_per_token']} | "
                     f"{' / '.join(f'{x:,.0f}' for x in d['tokens_by_ranks_reached'])} |")
    flat, lim = (r["node_limited_dispatch_ep4"][k]["measured_per_step"] for k in r["node_limited_dispatch_ep4"])
    lines += ["", f"moelab's all-to-all sends one row per kept assignment, so the limit leaves its rows as they are "
              f"({flat['dispatch_rows']:,.0f} against {lim['dispatch_rows']:,.0f}); a dispatcher that sends each token "
              f"once per destination rank (DeepEP) would send "
              f"{100 * (1 - lim['dispatch_token_ranks'] / flat['dispatch_token_ranks']):.0f}% fewer rows with the "
              f"limit. Planned figures: moelab.planner.comm.dispatch_ranks_per_token (balanced routing)."]
    c = r["expert_grad_compression"]
    lines += ["", "## 1-bit expert gradients: 2 gloo ranks, replicated experts, the synthetic Markov chain", "",
              "| mode | first loss | mean loss, last 50 steps | expert gradient bytes per step (both ranks) | "
              "exact all-reduce bytes | planned per rank |", "|---|---:|---:|---:|---:|---:|"]
    for mode in ("none", "sign"):
        d = c[mode]
        lines.append(f"| {mode} | {d['loss_first']} | {d['loss_mean_last_50']} | {d['expert_grad_bytes_per_step']:,.0f}"
                     f" | {d['expert_grad_uncompressed_bytes_per_step']:,.0f} | "
                     f"{d['planned_expert_grad_bytes_per_step_per_rank']:,} |")
    lines += ["", f"Relative gap of the last-50-step means: {100 * c['relative_gap_last_50']:.2f}% (the test's "
              f"margin is 2%). Means per 20 steps, none: {c['none']['loss_mean_per_20_steps']}; sign: "
              f"{c['sign']['loss_mean_per_20_steps']}.", "",
              "## Replicated data parallel against FSDP2: 2 gloo ranks, 4 steps", "",
              "| layout | losses | planned params per GPU | planned memory per GPU | planned comm per step |",
              "|---|---|---:|---:|---|"]
    for name, d in r["replicated_data_parallel"].items():
        comm = ", ".join(f"{k.replace('_bytes_per_step', '')} {v / 2**10:,.0f} KiB" for k, v in d["planned_comm"].items() if v)
        lines.append(f"| {name} | {', '.join(f'{x:.6f}' for x in d['losses'])} | {d['planned_params_per_gpu']:,} | "
                     f"{d['planned_memory_per_gpu_bytes'] / 2**20:,.2f} MiB | {comm} |")
    lines += ["", "## Two-level routing against flat top-k: 128 experts, top-8, one process", "",
              "| routing | mean loss, last 30 steps | max/mean load | cv of the load | planned ranks per token at EP=8 |"
              " wall s |", "|---|---:|---:|---:|---:|---:|"]
    for name, d in r["routing_128_experts"].items():
        lines.append(f"| {name} | {d['loss_mean_last_30']} | {d['max_over_mean']} | {d['cv']} | "
                     f"{d['planned_ranks_per_token_ep8']} | {d['wall_s']} |")
    lines += ["", "Group-limited routing over 8 groups scores a group by its 2 best experts, as node-limited routing "
              "with M = 4 does (ceil(8/4) = 2), so the two rows route identically: node-limited routing is "
              "group-limited routing whose groups are the EP ranks. The planner's fan-out knows only "
              "max_routed_ranks. Losses and balance are CPU training figures; wall times are not throughput."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few steps: checks the script, not the figures")
    ap.add_argument("--out", default=str(GALLERY / "seed-features" / "seed_features.json"))
    ap.add_argument("--render", action="store_true", help="only write the .md page from an existing --out JSON")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.render:
        out.with_suffix(".md").write_text(render(json.loads(out.read_text())))
        return 0
    root = Path(tempfile.mkdtemp(prefix="moelab-seed-"))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(GALLERY.parent), os.environ.get("PYTHONPATH")]))
    q = args.quick
    result = {
        "command": "python gallery/scripts/seed_features.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=GALLERY, capture_output=True,
                                 text=True).stdout.strip(),
        "machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "note": "CPU only, gloo; cores shared with other work, so wall times are not throughput"},
        "gpu": "not measured: step times with EP need two GPUs, which this session was not lent",
    }
    for key, fn in (("node_limited_dispatch_ep4", lambda: dispatch(root, 2 if q else 5)),
                    ("expert_grad_compression", lambda: compression(root, 60 if q else 200)),
                    ("replicated_data_parallel", lambda: replicated(root)),
                    ("routing_128_experts", lambda: routing(root, 10 if q else 150))):
        t0 = time.time()
        result[key] = fn()
        print(f"{key}: {time.time() - t0:.0f} s", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(render(result))
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
