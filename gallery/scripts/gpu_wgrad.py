"""Issue 41: SonicMoE's two weight-gradient GEMMs (up_dw, down_dw) on a later micro batch, where they add into .grad,
at one MoE layer of the Qwen3-30B-A3B proxy (skewed routing, bf16), checked and timed four ways:

- write:        D = A @ B (a step's first micro batch; the reference for the others' sums)
- add-reduce:   D += A @ B by QuACK's add-to-output epilogue (a TMA reduce-add store), moelab's add before this
- add-load:     D = A @ B + D with D read as the GEMM's C operand (moelab.backends.sonic.add_via() "load")
- add-load-sq:  add-load with the squares of the sum taken in the same epilogue (the step's gradient norm)

at QuACK's default tile and the 128 x 256 cooperative one, and at one micro batch's rows (8,192 tokens) and two
micro batches' (16,384, the same expert shares): the cost of the add, and how much of the GEMMs' time is their
epilogue (what one GEMM over two micro batches' rows would save). Each add starts from the same random "earlier"
gradient C0; its error is against C0 + the written result in fp32, the squares' against a float64 sum.

    SONIC_SITE=DIR python gallery/scripts/gpu_wgrad.py --out OUT      # OUT/wgrad.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_moe_layer import SHAPES, rel, sonic_setup  # noqa: E402
from gpu_sonic_tiles import Layer  # noqa: E402

import moelab.backends.grad_norm as G  # noqa: E402
import moelab.backends.sonic as S  # noqa: E402
from moelab.train.bench import StepTimer, commit_id  # noqa: E402

TILES = {"quack-default": (128, 192, True, 2, 1, False), "coop-128x256": (128, 256, False, 2, 1, False)}
MODES = ("write", "add-reduce", "add-load", "add-load-sq")
GEMMS = ("up_dw", "down_dw")


def run(layer: Layer, gemm: str, config, mode: str, probe) -> None:
    """One call of the GEMM as moelab.backends.sonic makes it in this mode (probe: the parameter whose squares are
    recorded, add-load-sq only)."""
    os.environ["MOELAB_SONIC_ADD"] = "reduce" if mode == "add-reduce" else "load"
    add, squares_of = mode != "write", probe if mode == "add-load-sq" else None
    o = layer.out[gemm][0]
    if gemm == "up_dw":
        S.gemm_up_dw(layer.x, layer.dh, o, layer.off, layer.gat, add, config, squares_of)
    else:
        S.gemm_down_dw(layer.g, layer.a, o, layer.off, layer.gat, add, config, squares_of)


def measure(layer: Layer, gemm: str, tile: tuple, mode: str, c0, written, timer, reps: int) -> dict:
    """Check (the adds: against c0 + written in fp32) and time one mode; write mode's output is left in the buffer."""
    from quack.gemm_config import GemmConfig

    config = GemmConfig(**dict(zip(S.TILE_FIELDS, tile)), device_capacity=9)
    probe = torch.nn.Parameter(torch.empty(0, device="cuda"))
    o = layer.out[gemm][0]
    try:
        r = {}
        if mode != "write":
            o.copy_(c0)
        run(layer, gemm, config, mode, probe)
        torch.cuda.synchronize()
        if mode != "write":
            r["rel_err"] = rel(o, c0.float() + written.float())
        if mode == "add-load-sq":
            got = G._recorded.pop(id(probe), (None, None))[1]
            want = sum(float(c.double().square().sum()) for c in o.reshape(-1).split(1 << 24))
            r["squares_rel_err"] = abs(float(got) - want) / want if got is not None else None
        r["ms"] = statistics.median(timer.time(lambda _: run(layer, gemm, config, mode, probe), reps))
        G._recorded.clear()
        return r
    except Exception as exc:
        return {"ms": float("inf"), "error": "".join(traceback.format_exception_only(exc)).strip()[-400:]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--label", default="wgrad")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    T, K, E, D, F = SHAPES["qwen3-moe-30b-a3b-proxy"]
    rec = {"system": "moelab", "workload": "qwen3-moe-30b-a3b-proxy", "variant": args.label,
           "device": torch.cuda.get_device_name(), "torch_version": torch.__version__, "commit": commit_id(),
           "command": " ".join(["python"] + sys.argv), "tile_fields": list(S.TILE_FIELDS), "routing": "skewed",
           "tiles": {k: list(v) for k, v in TILES.items()}, "modes": list(MODES),
           "shapes": {"tokens": T, "top_k": K, "experts": E, "hidden": D, "expert_ffn": F}, "runs": {},
           "errors": {}}
    rec["sonicmoe_version"] = sonic_setup(os.environ["SONIC_SITE"])

    def save():
        (out / f"{args.label}.json").write_text(json.dumps(rec, indent=1) + "\n")
    timer = StepTimer("cuda")
    for micro_batches in (1, 2):
        torch.manual_seed(0)  # the same expert shares (routing's Dirichlet draw) at both sizes
        layer = Layer("skewed", torch.Generator().manual_seed(0), (T * micro_batches, K, E, D, F))
        for gemm in GEMMS:
            gen = torch.Generator(device="cuda").manual_seed(1)
            for tname, tile in TILES.items():
                key = f"{gemm} {micro_batches}mb {tname}"
                res = rec["runs"][key] = {"gemm": gemm, "micro_batches": micro_batches, "tile": tname,
                                          "flop": 2 * T * micro_batches * K * D * F * (2 if gemm == "up_dw" else 1)}
                written = c0 = None
                for mode in MODES:
                    r = measure(layer, gemm, tile, mode, c0, written, timer, args.reps)
                    if mode == "write":  # the reference, and an earlier gradient of its size and strides
                        written = layer.out[gemm][0].clone()
                        c0 = torch.empty_like(written).copy_(
                            torch.randn(written.shape, generator=gen, device="cuda") * written.float().std())
                    if r.get("ms", float("inf")) != float("inf"):
                        r["tflops"] = res["flop"] / r["ms"] / 1e9
                    res[mode] = r
                    print(f"wgrad {key:28s} {mode:12s} {r}", flush=True)
                    save()
        del layer
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
