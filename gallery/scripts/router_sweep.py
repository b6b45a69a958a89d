"""What imbalance costs: ONE model (built once, as bench_variants.py does) timed with the learned router, then with
the fake balanced gate (round-robin routing) shifted by backend.fake_gate_noise 0, 0.1, 0.5 and 1.0; one record
per variant, each stating its router kind (BackendConfig.router_kind of the config it ran) and the load imbalance
of one step after the timed ones. `moelab gallery report` renders the newest sweep as "What imbalance costs".

    python gallery/scripts/router_sweep.py --out DIR [--preset qwen3-moe-30b-a3b-proxy] [--gbs 2,16]
        [--noise 0,0.1,0.5,1] [--steps 6] [--warmup 3] [--set k=v ...] [--deadline-s S]
    python gallery/scripts/router_sweep.py --out DIR --cpu      # the tiny preset on CPU: checks the script

The settings moelab recommends: bf16 parameters and train.compile (`--set train.compile=false` for eager). Records
are named <workload>--moelab--router-<kind>-gbs<N>.json (`=` written `-`), with sweep="router" and one sweep_id.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from moelab.config import load_config
from moelab.train.bench import Bencher, bench_config, describe
from moelab.contract.summary import step_balance

GPU_SETTINGS = ["train.dtype=bfloat16", "train.param_dtype=bfloat16", "train.compile=true", "data.kind=random"]
CPU_SETTINGS = ["train.device=cpu", "data.kind=random"]


def routers(noises: list[float]) -> list[tuple[bool, float]]:
    """(fake gate on, noise) of each variant: the learned router first, then the fake gate at each noise."""
    return [(False, 0.0)] + [(True, n) for n in noises]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", help="default qwen3-moe-30b-a3b-proxy (tiny with --cpu)")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--gbs", default="2", help="global batches, comma-separated (default 2)")
    ap.add_argument("--noise", default="0,0.1,0.5,1", help="fake_gate_noise values (default 0,0.1,0.5,1)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--deadline-s", type=float, default=500, help="skip the remaining variants after this long")
    ap.add_argument("--cpu", action="store_true", help="the tiny preset on CPU (a check, not a measurement)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(x) for x in args.gbs.split(",")]
    variants = routers([float(x) for x in args.noise.split(",")])
    preset = args.preset or ("tiny" if args.cpu else "qwen3-moe-30b-a3b-proxy")
    cfg = load_config(preset, [*(CPU_SETTINGS if args.cpu else GPU_SETTINGS), *args.overrides,
                               "backend.fake_balanced_gate=false", "backend.fake_gate_noise=0"])
    per_variant = args.steps + args.warmup + 1  # timed, warm-up and the one step that measures the balance
    cfg = bench_config(cfg, 0, 0, extra_steps=per_variant * len(variants) * len(batches))
    from moelab.train.trainer import Trainer

    # each router (and batch) is another compiled graph per block: keep them all compiled (default limit 8)
    import torch._dynamo.config as dynamo_config

    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, key):
            setattr(dynamo_config, key, max(getattr(dynamo_config, key), 4 * len(variants) * len(batches)))
    tr = Trainer(cfg, tempfile.mkdtemp(prefix="moelab-router-sweep-"))
    tr.setup()
    print(f"setup {time.perf_counter() - t_start:.1f} s", flush=True)
    b = Bencher(tr)
    sweep_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    command = " ".join(["python"] + (sys.argv if argv is None else [__file__, *argv]))
    failed = 0
    try:
        for gbs in batches:
            b.set_global_batch(gbs)
            for on, noise in variants:
                ran = cfg.replace(**{"train.global_batch_size": gbs, "backend.fake_balanced_gate": on,
                                     "backend.fake_gate_noise": noise})
                kind = ran.backend.router_kind
                name = f"router-{kind.replace('=', '-')}-gbs{gbs}"
                if time.perf_counter() - t_start > args.deadline_s:
                    print(f"{name}: skipped (deadline)", flush=True)
                    continue
                b.set_fake_gate(on, noise)
                if torch.cuda.is_available() and tr.env.is_cuda:
                    torch.cuda.reset_peak_memory_stats()
                rec = {**describe(tr, b, ran), "variant": name, "sweep": "router", "sweep_id": sweep_id,
                       "steps": args.steps, "warmup": args.warmup, "command": command}
                try:
                    rec.update(b.measure(args.steps, args.warmup))
                    step = tr.train_step(b.next_step)  # untimed: the routing this router produced
                    b.next_step += 1
                    bal = step_balance(step["routing"]["routed_per_expert"])
                    rec.update(peak_memory_gb=b.peak_memory_gb(),
                               load_max_over_mean=bal["max_over_mean"] if bal else None)
                except Exception as e:  # one failing variant must not lose the others
                    traceback.print_exc()
                    rec["error"] = f"{type(e).__name__}: {e}"
                    failed += 1
                (out / f"{cfg.name}--moelab--{name}.json").write_text(json.dumps(rec, indent=1) + "\n")
                if "error" not in rec:
                    print(f"{name:30s} {rec['tokens_per_s_per_gpu']:9,.0f} tok/s  step {rec['step_time_ms']:8.1f} ms"
                          f"  load max/mean {rec['load_max_over_mean']:.2f}", flush=True)
    finally:
        tr.stop.restore()
        tr.env.shutdown()
        if tr.writer:
            tr.writer.close()
    print(f"total {time.perf_counter() - t_start:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
