"""Issue 41: QuACK's tiles for SonicMoE's six grouped GEMMs (moelab.backends.sonic.GEMMS) on this GPU, at one MoE
layer of a proxy's shapes (--shape: gpu_moe_layer.py's SHAPES, the Qwen3-30B-A3B proxy by default; bf16) and routing
(--routing: skewed or balanced, drawn as gpu_moe_layer.py draws them). Each GEMM runs with QuACK's default config and
every candidate tile its epilogue and gather allow (CANDIDATES), compiled beforehand in parallel by QuACK's own
compile workers; its outputs are checked against the default's and it is timed (median of --reps CUDA-event calls;
the weight-gradient GEMMs both writing and adding into their output, chosen by the sum). The fastest tile per GEMM
that beats the default by at least --margin is chosen. Then the whole layer (moelab.backends.sonic.sonic_experts,
forward + backward, the gradients written as on a step's first micro batch) at both routings with QuACK's defaults,
the sweep's choice and moelab.backends.sonic.TILES, and the host's time for the same call (its Python and launches,
the GPU kept busy so that no launch waits).

    SONIC_SITE=DIR python gallery/scripts/gpu_sonic_tiles.py --out OUT [--shape deepseek-v3-proxy]
        [--routing balanced] [--gemms up,down_dact] [--label L]
        # OUT/L.json (default sonic-tiles.json): the record; OUT/tiles.json: the chosen tiles, as MOELAB_SONIC_TILES
        # reads them
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_moe_layer import SHAPES, rel, routing, sonic_setup  # noqa: E402

import moelab.backends.sonic as S  # noqa: E402
from moelab.train.bench import StepTimer, commit_id  # noqa: E402

CANDIDATES = [  # moelab.backends.sonic.TILE_FIELDS
    (128, 192, True, 2, 1, False),  # QuACK's default on sm90
    (128, 128, True, 2, 1, False), (128, 160, True, 2, 1, False), (192, 128, True, 2, 1, False),
    (256, 128, False, 2, 1, False), (256, 160, False, 2, 1, False), (256, 192, False, 2, 1, False),
    (128, 256, False, 2, 1, False), (128, 192, True, 1, 1, False),
    (128, 192, True, 1, 2, False), (256, 128, False, 1, 2, False), (128, 192, True, 2, 1, True),
    (128, 224, False, 2, 1, False), (128, 256, False, 1, 1, False), (256, 128, False, 1, 1, False),
    (128, 256, False, 1, 2, False), (256, 192, False, 1, 2, False),
    # issue 41 call 39: 64-row pingpong tiles, for the grouped-row GEMMs' padding (each expert's rows end in a
    # partial tile: about 12% more rows at 128, 6% at 64 with the proxy's skewed routing)
    (64, 256, True, 2, 1, False), (64, 192, True, 2, 1, False), (64, 128, True, 2, 1, False),
    (64, 256, True, 1, 1, False)]
DEFAULT = CANDIDATES[0]
GATHERED = ("up", "down_dact", "up_dw", "down_dw")  # the A operand's rows (or columns) gathered by token
GATED = ("up", "down_dact")  # a SwiGLU (or its backward) epilogue
WEIGHT_GRADS = ("up_dw", "down_dw")


def candidates(gemm: str) -> list[tuple]:
    """The tiles QuACK allows for this GEMM on sm90: a gathered operand needs clusters of one along N and the static
    scheduler; a gated epilogue tiles N by multiples of 32."""
    keep = []
    for t in CANDIDATES:
        tile_m, tile_n, pingpong, cluster_m, cluster_n, dynamic = t
        if gemm in GATHERED and (cluster_n != 1 or dynamic):
            continue
        if gemm in GATED and tile_n % 32:
            continue
        keep.append(t)
    return keep


def choose(ms: dict[tuple, float], margin: float) -> tuple | None:
    """The fastest tile if it beats the default's time by at least `margin` (a fraction), else None (the default)."""
    ok = {t: v for t, v in ms.items() if v == v and v != float("inf")}
    if DEFAULT not in ok or not ok:
        return None
    best = min(ok, key=ok.get)
    return best if best != DEFAULT and ok[best] <= ok[DEFAULT] * (1 - margin) else None


class Layer:
    """One layer's inputs, routing metadata and the intermediate tensors each GEMM reads, made with the defaults."""

    def __init__(self, kind: str, gen: torch.Generator, shape: tuple):
        from sonicmoe.functional.triton_kernels import TC_topk_router_metadata_triton

        self.shape = T, K, E, D, F = shape
        dev, bf = "cuda", torch.bfloat16
        weights_TK, experts_TK = routing(kind, T, K, E, gen)
        self.weights_TK, self.experts_TK = weights_TK.to(dev), experts_TK.to(dev)
        self.x = torch.randn(T, D, generator=gen).to(dev, bf)
        self.w1 = (torch.randn(E, 2 * F, D, generator=gen) / D ** 0.5).to(dev, bf).transpose(1, 2)  # SonicMoE order
        self.w2 = (torch.randn(E, D, F, generator=gen) / F ** 0.5).to(dev, bf).transpose(1, 2)
        self.g = torch.randn(T, D, generator=gen).to(dev, bf)
        N = T * K
        self.off = torch.empty(E + 1, dtype=torch.int32, device=dev)
        self.gat, self.sca, self.rev = (torch.empty(N, dtype=torch.int32, device=dev) for _ in range(3))
        TC_topk_router_metadata_triton(self.experts_TK.int().contiguous(), E, torch.empty(E, dtype=torch.int32,
                                       device=dev), self.off, self.gat, self.sca, self.rev)
        self.s = self.weights_TK.reshape(-1).float()[self.sca]
        self.h, self.a = torch.empty(N, 2 * F, device=dev, dtype=bf), torch.empty(N, F, device=dev, dtype=bf)
        S.gemm_up(self.x, self.w1, self.h, self.a, self.off, self.gat)
        self.dh = torch.empty_like(self.h)
        S.gemm_down_dact(self.g, self.w2, self.h, self.dh, torch.empty_like(self.a), self.s, self.off, self.gat)
        self.out = {"up": [torch.empty_like(self.h), torch.empty_like(self.a)],
                    "down": [torch.empty(N, D, device=dev, dtype=bf)],
                    "down_dact": [torch.empty_like(self.h), torch.empty_like(self.a)],
                    "up_dx": [torch.empty(N, D, device=dev, dtype=bf)],
                    "up_dw": [torch.empty_like(self.w1)], "down_dw": [torch.empty_like(self.w2)]}

    def run(self, gemm: str, config, add: bool = False) -> list[torch.Tensor]:
        """The GEMM, as moelab.backends.sonic calls it, into this layer's output buffers; returns its outputs."""
        o = self.out[gemm]
        if gemm == "up":
            S.gemm_up(self.x, self.w1, o[0], o[1], self.off, self.gat, config)
        elif gemm == "down":
            S.gemm_down(self.a, self.w2, o[0], self.off, config)
        elif gemm == "down_dact":
            return o + [S.gemm_down_dact(self.g, self.w2, self.h, o[0], o[1], self.s, self.off, self.gat, config)]
        elif gemm == "up_dx":
            S.gemm_up_dx(self.dh, self.w1, o[0], self.off, config)
        elif gemm == "up_dw":
            S.gemm_up_dw(self.x, self.dh, o[0], self.off, self.gat, add, config)
        else:
            S.gemm_down_dw(self.g, self.a, o[0], self.off, self.gat, add, config)
        return o


def captured_call(layer: Layer, gemm: str, add: bool) -> tuple:
    """(QuACK function's module and name, positional arguments, keyword arguments) of moelab's call of this GEMM
    (moelab.backends.sonic's own function, run with a recorder in place of QuACK's), the config left out."""
    from quack import gemm_interface as qi

    names = ("gemm_tuned", "gemm_gated_tuned", "gemm_dgated_tuned")
    calls, real = [], S._quack

    def recorder(name):
        def record(*args, **kwargs):
            calls.append((name, args, kwargs))
            return torch.empty(0)
        return record
    S._quack = lambda: tuple(recorder(n) for n in names)
    try:
        layer.run(gemm, None, add)
    finally:
        S._quack = real
    name, args, kwargs = calls[0]
    bound = inspect.signature(getattr(qi, name).fn).bind(*args, **kwargs)
    bound.apply_defaults()  # every tensor positional (the workers fake those), the config left out
    bound.arguments.pop("config", None)
    return name, bound.args, bound.kwargs


def compile_all(tasks: dict, workers: int) -> dict:
    """Compile every (GEMM, mode, tile) in QuACK's compile workers (python -m quack._compile_worker: each fills the
    persistent kernel cache with one config at a time, on fake tensors of the call's shapes; the timed calls then
    load the kernels), one task per idle worker. Returns task -> "OK" or the worker's error."""
    import pickle
    import selectors
    import struct
    import subprocess

    from quack.gemm_config import GemmConfig

    def send(stream, msg):
        data = pickle.dumps(msg)
        stream.write(struct.pack("<I", len(data)) + data)
        stream.flush()

    def recv(stream):
        head = stream.read(4)
        if len(head) < 4:
            return "ERR: the worker exited"
        n = struct.unpack("<I", head)[0]
        return pickle.loads(stream.read(n)) if n else None

    def payload(key):
        name, args, kwargs = tasks[key]
        meta = [{"shape": list(a.shape), "stride": list(a.stride()), "dtype": str(a.dtype)}
                if isinstance(a, torch.Tensor) else a for a in args]
        return {"fn_module": "quack.gemm_interface", "fn_qualname": name, "tensor_meta": meta, "kwargs": kwargs,
                "config_kwargs": {"config": GemmConfig(**dict(zip(S.TILE_FIELDS, key[2])), device_capacity=9)}}
    procs = [subprocess.Popen([sys.executable, "-m", "quack._compile_worker"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) for _ in range(workers)]
    ready = [p for p in procs if recv(p.stdout) == "READY"]
    queue, busy, results, sel = list(tasks), {}, {}, selectors.DefaultSelector()
    for p in ready:
        sel.register(p.stdout, selectors.EVENT_READ, p)
        if queue:
            busy[p] = queue.pop(0)
            send(p.stdin, payload(busy[p]))
    while busy:
        for sk, _ in sel.select():
            p = sk.data
            results[busy.pop(p)] = recv(p.stdout)
            if queue:
                busy[p] = queue.pop(0)
                send(p.stdin, payload(busy[p]))
    for p in procs:
        p.stdin.close()
        p.wait()
    return results


def time_gemm(layer: Layer, gemm: str, tile: tuple, add: bool, ref: list, timer, reps: int) -> dict:
    from quack.gemm_config import GemmConfig

    config = GemmConfig(**dict(zip(S.TILE_FIELDS, tile)), device_capacity=9)
    try:
        if add:  # the added-into buffer starts from the written result, so that one call's sum is checkable
            layer.out[gemm][0].copy_(ref[0])
        outs = layer.run(gemm, config, add)
        torch.cuda.synchronize()
        err = max(rel(o.float() - r.float() if add else o, r) for o, r in zip(outs, ref))
        ms = statistics.median(timer.time(lambda _: layer.run(gemm, config, add), reps))
        return {"ms": ms, "rel_err_vs_default": err}
    except Exception as exc:
        return {"ms": float("inf"), "error": "".join(traceback.format_exception_only(exc)).strip()[-400:]}


def layer_step(layer: Layer, params):
    x = layer.x.detach().requires_grad_()
    wts = layer.weights_TK.detach().requires_grad_()
    for p in params:
        p.grad = None
    y = S.sonic_experts(x, wts, layer.experts_TK, *params)
    y.backward(layer.g)
    return y


def whole_layer(layer: Layer, timer, reps: int) -> dict:
    """The layer's forward + backward through moelab's backend, GPU time (median) and host time (mean of 5 calls
    issued while the GPU sleeps: the Python and launch cost alone)."""
    params = [torch.nn.Parameter(layer.w1.detach().clone()), torch.nn.Parameter(layer.w2.detach().clone())]
    layer_step(layer, params)
    ms = statistics.median(timer.time(lambda _: layer_step(layer, params), reps))
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))  # about 1.5 s of GPU clock: every launch below returns at once
    t0 = time.perf_counter()
    for _ in range(5):
        layer_step(layer, params)
    host_ms = (time.perf_counter() - t0) / 5 * 1e3
    torch.cuda.synchronize()
    T, K, _, D, F = layer.shape
    return {"fwd_bwd_ms": ms, "tflops": 18 * T * K * D * F / ms / 1e9,
            "host_ms_per_call": host_ms}


def record_head(args) -> dict:
    """A sweep record's common fields (this script's and gpu_sonic_rows.py's): what ran, where, at which shapes and
    routing, with moelab's tile table; empty `gemms`, `layer` and `errors` to fill."""
    shape = SHAPES[args.shape]
    return {"system": "moelab", "workload": args.shape, "variant": args.label,
            "device": torch.cuda.get_device_name(), "torch_version": torch.__version__, "commit": commit_id(),
            "command": " ".join(["python"] + sys.argv), "tile_fields": list(S.TILE_FIELDS), "routing": args.routing,
            "moelab_table": {g: list(t) for g, t in S.TILES.get(9, {}).items()},
            "shapes": dict(zip(("tokens", "top_k", "experts", "hidden", "expert_ffn"), shape)), "gemms": {},
            "layer": {}, "errors": {}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--margin", type=float, default=0.02, help="a tile is chosen if this much faster than default")
    ap.add_argument("--gemms", default=",".join(S.GEMMS))
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-moe-30b-a3b-proxy")
    ap.add_argument("--routing", choices=("skewed", "balanced"), default="skewed", help="the GEMMs' routing")
    ap.add_argument("--label", default="sonic-tiles", help="the record's variant and file name (LABEL.json)")
    ap.add_argument("--workers", type=int, default=12, help="parallel CuTe-DSL compile processes")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    rec = {**record_head(args), "chosen": {}}
    rec["sonicmoe_version"] = sonic_setup(os.environ["SONIC_SITE"])

    def save():
        (out / f"{args.label}.json").write_text(json.dumps(rec, indent=1) + "\n")
    timer = StepTimer("cuda")
    gen = torch.Generator().manual_seed(0)
    layer = Layer(args.routing, gen, shape)
    gemms = args.gemms.split(",")
    modes = {g: (False, True) if g in WEIGHT_GRADS else (False,) for g in gemms}
    t0 = time.time()
    try:  # failures here only cost time: the timed calls compile what is missing in-process
        calls = {(g, add): captured_call(layer, g, add) for g in gemms for add in modes[g]}
        done = compile_all({(g, add, t): calls[g, add] for g in gemms for add in modes[g] for t in candidates(g)},
                           args.workers)
        rec["compile"] = {"s": time.time() - t0, "tasks": len(done),
                          "errors": {str(k): v for k, v in done.items() if v != "OK"}}
    except Exception as exc:
        rec["errors"]["compile"] = "".join(traceback.format_exception(exc))[-2000:]
    print(f"sonic-tiles compiled in {time.time() - t0:.0f} s: {rec.get('compile', {}).get('errors')}", flush=True)
    save()
    for gemm in gemms:
        tiles = candidates(gemm)
        res = rec["gemms"][gemm] = {"tiles": {}}
        ref = [t.clone() for t in layer.run(gemm, None)]  # the default config's outputs (written, not added)
        for add in modes[gemm]:
            for tile in tiles:
                r = time_gemm(layer, gemm, tile, add, ref, timer, args.reps)
                res["tiles"].setdefault(json.dumps(tile), {})["add" if add else "write"] = r
                print(f"sonic-tiles {gemm:9s} {'add' if add else 'write':5s} {tile}: {r}", flush=True)
            save()
        total = {tuple(json.loads(k)): sum(v[m]["ms"] if v[m].get("rel_err_vs_default", 1) < 1e-2 else float("inf")
                                          for m in v) for k, v in res["tiles"].items()}
        best = choose(total, args.margin)
        res["ms_by_tile"] = {json.dumps(k): v for k, v in total.items()}
        if best is not None:
            rec["chosen"][gemm] = list(best)
        print(f"sonic-tiles {gemm}: default {total.get(DEFAULT)} ms, chosen {best}", flush=True)
        save()
    (out / "tiles.json").write_text(json.dumps(rec["chosen"]) + "\n")
    for kind in ("skewed", "balanced"):
        lay = layer if kind == args.routing else Layer(kind, gen, shape)
        runs = {"quack-default": {}, "chosen": rec["chosen"], "moelab-table": S.TILES.get(9, {})}
        for label, tiles in runs.items():  # every GEMM named (QuACK's default where a choice has none): no table
            tiles = {g: list(tiles.get(g, DEFAULT)) for g in S.GEMMS}
            (out / "layer-tiles.json").write_text(json.dumps(tiles))
            os.environ["MOELAB_SONIC_TILES"] = str(out / "layer-tiles.json")
            S.tile_configs.cache_clear()
            try:
                rec["layer"].setdefault(kind, {})[label] = r = whole_layer(lay, timer, args.reps)
                print(f"sonic-tiles layer {kind} {label}: {r}", flush=True)
            except Exception as exc:
                rec["errors"][f"layer {kind} {label}"] = "".join(traceback.format_exception(exc))[-2000:]
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
