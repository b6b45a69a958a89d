"""Issue 41: SonicMoE's backward GEMMs that read rows by token (down_dact: the output gradient's; up_dw: the input's;
down_dw: the output gradient's), each two ways at one MoE layer of a proxy's shapes (gpu_moe_layer.py's SHAPES, bf16):
`gathered`, the rows gathered inside the GEMM (A_idx: cp.async loads, clusters of one along N, the static
scheduler), and `rows`, the rows copied into grouped order once (index_select, timed alone) and read in place (TMA,
every tile QuACK allows). Each way with every candidate tile (gpu_sonic_tiles.py's CANDIDATES, compiled beforehand
in QuACK's compile workers), checked against the gathered default's outputs and timed (median of --reps CUDA-event
calls; the weight-gradient GEMMs writing and adding). Then the whole layer (moelab.backends.sonic.sonic_experts,
forward + backward) at both routings with moelab.backends.sonic.ROWS_ONCE set to each candidate set, the fastest
tile of each GEMM's way, its gradients checked against the all-gathered run.

    SONIC_SITE=DIR python gallery/scripts/gpu_sonic_rows.py --out OUT [--shape deepseek-v3-proxy] [--routing balanced]
        # OUT/LABEL.json (default sonic-rows.json): the record
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_moe_layer import SHAPES, rel, sonic_setup  # noqa: E402
from gpu_sonic_tiles import (CANDIDATES, DEFAULT, Layer, candidates, captured_call, compile_all,  # noqa: E402
                             record_head, time_gemm, whole_layer)

import moelab.backends.sonic as S  # noqa: E402
from moelab.train.bench import StepTimer  # noqa: E402

ROW_GEMMS = ("down_dact", "up_dw", "down_dw")
ROW_SETS = {"none": "", "weight-grads": "up_dw,down_dw", "all": "down_dact,up_dw,down_dw"}


class RowsLayer(Layer):
    """A Layer whose backward GEMMs read the grouped rows copied once (self.rows True) or gathered (False)."""

    rows = False

    def __init__(self, kind, gen, shape):
        super().__init__(kind, gen, shape)
        self.x_rows, self.g_rows = self.x.index_select(0, self.gat), self.g.index_select(0, self.gat)

    def run(self, gemm, config, add=False):
        if not self.rows or gemm not in ROW_GEMMS:
            return super().run(gemm, config, add)
        o = self.out[gemm]
        if gemm == "down_dact":
            return o + [S.gemm_down_dact(self.g_rows, self.w2, self.h, o[0], o[1], self.s, self.off, None, config)]
        if gemm == "up_dw":
            S.gemm_up_dw(self.x_rows, self.dh, o[0], self.off, None, add, config)
        else:
            S.gemm_down_dw(self.g_rows, self.a, o[0], self.off, None, add, config)
        return o


def row_candidates(gemm: str) -> list[tuple]:
    """Every candidate tile for a GEMM reading rows in place (no gather: any cluster, either scheduler)."""
    return [t for t in CANDIDATES if gemm != "down_dact" or t[1] % 32 == 0]


def grads(layer: Layer) -> list[torch.Tensor]:
    params = [torch.nn.Parameter(layer.w1.detach().clone()), torch.nn.Parameter(layer.w2.detach().clone())]
    x = layer.x.detach().requires_grad_()
    wts = layer.weights_TK.detach().requires_grad_()
    S.sonic_experts(x, wts, layer.experts_TK, *params).backward(layer.g)
    return [x.grad, wts.grad, params[0].grad, params[1].grad]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-moe-30b-a3b-proxy")
    ap.add_argument("--routing", choices=("skewed", "balanced"), default="skewed", help="the GEMMs' routing")
    ap.add_argument("--label", default="sonic-rows")
    ap.add_argument("--workers", type=int, default=12)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    rec = {**record_head(args), "copy_ms": {}, "best": {}}
    rec["sonicmoe_version"] = sonic_setup(os.environ["SONIC_SITE"])

    def save():
        (out / f"{args.label}.json").write_text(json.dumps(rec, indent=1) + "\n")
    timer = StepTimer("cuda")
    gen = torch.Generator().manual_seed(0)
    layer = RowsLayer(args.routing, gen, shape)
    ways = {"gathered": candidates, "rows": row_candidates}
    modes = {g: (False, True) if g != "down_dact" else (False,) for g in ROW_GEMMS}
    t0 = time.time()
    try:
        tasks = {}
        for way, cands in ways.items():
            layer.rows = way == "rows"
            for g in ROW_GEMMS:
                for add in modes[g]:
                    call = captured_call(layer, g, add)
                    tasks.update({(g, add, t, way): call for t in cands(g)})
        done = compile_all(tasks, args.workers)
        rec["compile"] = {"s": time.time() - t0, "tasks": len(done),
                          "errors": {str(k): v for k, v in done.items() if v != "OK"}}
    except Exception as exc:
        rec["errors"]["compile"] = "".join(traceback.format_exception(exc))[-2000:]
    print(f"sonic-rows compiled in {time.time() - t0:.0f} s: {rec.get('compile', {}).get('errors')}", flush=True)
    save()
    rec["copy_ms"] = {name: statistics.median(timer.time(lambda _: t.index_select(0, layer.gat), args.reps))
                      for name, t in (("x", layer.x), ("g", layer.g))}
    print(f"sonic-rows index_select {rec['copy_ms']}", flush=True)
    for gemm in ROW_GEMMS:
        layer.rows = False
        ref = [t.clone() for t in layer.run(gemm, None)]  # gathered, QuACK's default config (written)
        for way, cands in ways.items():
            layer.rows = way == "rows"
            res = rec["gemms"].setdefault(gemm, {}).setdefault(way, {})
            for add in modes[gemm]:
                for tile in cands(gemm):
                    r = time_gemm(layer, gemm, tile, add, ref, timer, args.reps)
                    res.setdefault(json.dumps(tile), {})["add" if add else "write"] = r
                    print(f"sonic-rows {gemm:9s} {way:8s} {'add' if add else 'write':5s} {tile}: {r}", flush=True)
            total = {k: sum(v[m]["ms"] if v[m].get("rel_err_vs_default", 1) < 1e-2 else float("inf") for m in v)
                     for k, v in res.items()}
            best = min(total, key=total.get)
            rec["best"].setdefault(gemm, {})[way] = {"tile": json.loads(best), "ms": total[best],
                                                     "default_ms": total.get(json.dumps(DEFAULT))}
            print(f"sonic-rows {gemm} {way}: best {best} {total[best]:.4f} ms", flush=True)
            save()
    layer.rows = False
    for kind in ("skewed", "balanced"):
        lay = layer if kind == args.routing else RowsLayer(kind, gen, shape)
        os.environ.pop("MOELAB_SONIC_ROWS_ONCE", None)
        os.environ.pop("MOELAB_SONIC_TILES", None)
        S.tile_configs.cache_clear()
        ref = grads(lay)
        for label, names in ROW_SETS.items():
            rows = set(filter(None, names.split(",")))
            tiles = {g: list(S.TILES.get(9, {}).get(g, DEFAULT)) for g in S.GEMMS}
            tiles.update({g: rec["best"][g]["rows" if g in rows else "gathered"]["tile"] for g in ROW_GEMMS})
            (out / "layer-tiles.json").write_text(json.dumps(tiles))
            os.environ["MOELAB_SONIC_TILES"] = str(out / "layer-tiles.json")
            os.environ["MOELAB_SONIC_ROWS_ONCE"] = names
            S.tile_configs.cache_clear()
            try:
                got = grads(lay)
                r = whole_layer(lay, timer, args.reps)
                r["tiles"] = tiles
                r["rel_err_vs_gathered"] = {n: rel(a, b) for n, a, b in zip(("dx", "dweights", "dw1", "dw2"), got,
                                                                              ref)}
                rec["layer"].setdefault(kind, {})[label] = r
                print(f"sonic-rows layer {kind} {label}: {r}", flush=True)
            except Exception as exc:
                rec["errors"][f"layer {kind} {label}"] = "".join(traceback.format_exception(exc))[-2000:]
            save()
    os.environ.pop("MOELAB_SONIC_ROWS_ONCE", None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
