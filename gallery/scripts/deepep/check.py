"""backend.dispatcher=deepep against all_to_all on the GPU machine (run by build.sh check, deep_ep installed).

    python3 gallery/scripts/deepep/check.py --out DIR [--steps 20] [--proxy-steps 8] [--skip-proxy] [--set K=V]

Writes DIR/deepep-check.json (and DIR/deepep-logs.tar.gz); exits 1 if a comparison fails.
- Always: deep_ep imports (its file, whether its SM90 kernels are compiled) and, on one GPU, a one-rank Buffer
  and get_dispatch_layout (DeepEP's intranode dispatch itself needs 2, 4 or 8 ranks): on fewer than 2 GPUs it says
  so and exits 0 after that.
- With 2 GPUs, under torchrun (2 ranks, NCCL):
  1. unit: the two dispatchers on the same random routing (top-2 and top-8 with dropped assignments): the rows the
     experts receive (exactly equal, same order), their counts, the combined output and the gradients of the
     tokens, the router weights and a per-expert scale (bf16 tolerance); and dispatch + combine forward and
     backward timed at the Qwen3-30B-A3B proxy's shapes (8192 tokens x 2048, 128 experts, top-8), median of 20;
  2. train: `tiny` for --steps steps with EP=2 in bf16 with each dispatcher: the losses (bf16 tolerance 2e-2,
     as gallery/scripts/check_two_gpu.sh) and step times; then the same for the Qwen3 proxy (--proxy-steps).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
TOL = 2e-2  # bf16: the project's tolerance for layout comparisons in bf16
CASES = {"top2": dict(T=256, D=256, E=8, K=2, drop=False), "top8-capacity": dict(T=512, D=512, E=16, K=8, drop=True)}
TIMING = dict(T=8192, D=2048, E=128, K=8, drop=False)
PROXY = ["backend.fake_balanced_gate=false", "data.kind=random", "train.dtype=bfloat16", "train.param_dtype=bfloat16"]


def package_info() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    from moelab.backends.packages import import_package

    deep_ep = import_package("deep_ep")
    try:
        v = version("deep_ep")
    except PackageNotFoundError:
        v = None
    return {"version": v, "file": deep_ep.__file__, "sm90_compiled": bool(deep_ep.Buffer.is_sm90_compiled())}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_rank_check() -> dict:
    """A Buffer over a one-rank NCCL group, and the layout kernel: what one GPU can show."""
    import deep_ep
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.cuda.set_device(0)
    out = {}
    try:
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
        buf = deep_ep.Buffer(dist.group.WORLD, 2 ** 26, 0, explicitly_destroy=True)
        out["buffer_1rank"] = "ok"
        idx_TK = torch.randint(0, 8, (64, 2), device="cuda", dtype=torch.int64)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx_TK, 8)
        out["layout_1rank"] = {"tokens_per_rank": per_rank.tolist(), "tokens_per_expert": per_expert.tolist(),
                               "matches_bincount": per_expert.tolist() == torch.bincount(idx_TK.reshape(-1),
                                                                                         minlength=8).tolist()}
        buf.destroy()
        out["destroy_1rank"] = "ok"
    except Exception as e:  # recorded, not raised: this is a report
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return out


def routing(T, D, E, K, drop, rank, device="cuda", seed=0):
    g = torch.Generator(device=device).manual_seed(seed + 1000 * rank)
    x_TD = torch.randn(T, D, generator=g, device=device).to(torch.bfloat16)
    w_TK, e_TK = torch.randn(T, E, generator=g, device=device).softmax(-1).topk(K, dim=-1)
    keep_TK = torch.rand(T, K, generator=g, device=device) > 0.25 if drop else None
    probe_TD = torch.randn(T, D, generator=g, device=device)
    return x_TD, w_TK, e_TK, keep_TK, probe_TD


def run_dispatcher(d, case, rank, ep, device="cuda", backward=True):
    """One MoE exchange: dispatch, a per-expert scale as the experts, combine; the gradients by backward."""
    x_TD, w_TK, e_TK, keep_TK, probe_TD = routing(**case, rank=rank, device=device)
    E = case["E"]
    X = E // ep
    x_TD, w_TK = x_TD.requires_grad_(), w_TK.requires_grad_()
    scale_X = (torch.arange(X, device=device, dtype=torch.float32) + rank * X + 1).div(E).requires_grad_()
    wk_TK = w_TK * keep_TK if keep_TK is not None else w_TK
    x_ND, counts_X, ctx = d.dispatch(x_TD, e_TK, keep_TK, E)
    expert_N = torch.repeat_interleave(torch.arange(X, device=device), counts_X, output_size=x_ND.shape[0])
    y_ND = (x_ND.float() * scale_X[expert_N][:, None]).to(torch.bfloat16)
    y_TD = d.combine(y_ND, ctx, wk_TK, keep_TK, counts_X)
    if backward:
        (y_TD.float() * probe_TD).sum().backward()
    return {"rows": x_ND.detach(), "counts": counts_X, "y": y_TD.detach(), "x_grad": x_TD.grad,
            "w_grad": w_TK.grad, "scale_grad": scale_X.grad}


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-12))


def compare(a2a, dpe, rank, ep, device="cuda") -> dict:
    """Each case through both dispatchers: the same rows in the same order, and outputs and gradients within TOL."""
    result = {}
    for name, case in CASES.items():
        a, b = run_dispatcher(a2a, case, rank, ep, device), run_dispatcher(dpe, case, rank, ep, device)
        r = {"rows_equal": bool(torch.equal(a["rows"], b["rows"])),
             "counts_equal": a["counts"].tolist() == b["counts"].tolist()}
        r.update({f"{k}_rel_diff": rel(a[k], b[k]) for k in ("y", "x_grad", "w_grad", "scale_grad")})
        r["passed"] = r["rows_equal"] and r["counts_equal"] and all(
            v <= TOL for k, v in r.items() if k.endswith("_rel_diff"))
        result[name] = r
    return result


def unit_worker(out: Path) -> None:
    import torch.distributed as dist

    from moelab.parallel.deepep import DeepEPDispatcher
    from moelab.parallel.expert_parallel import AllToAllDispatcher

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, ep = dist.get_rank(), dist.get_world_size()
    a2a, dpe = AllToAllDispatcher(dist.group.WORLD), DeepEPDispatcher(dist.group.WORLD, hidden=TIMING["D"])
    result = compare(a2a, dpe, rank, ep)
    timing = {}
    for label, d in (("all_to_all", a2a), ("deepep", dpe)):
        for phase, backward in (("forward_ms", False), ("forward_backward_ms", True)):
            times = []
            for i in range(25):
                dist.barrier()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run_dispatcher(d, TIMING, rank, ep, backward=backward)
                end.record()
                torch.cuda.synchronize()
                if i >= 5:
                    times.append(start.elapsed_time(end))
            timing.setdefault(label, {})[phase] = statistics.median(times)
    result["timing"] = {"shape": TIMING, "median_of": 20, "note": "includes the random routing and the stand-in "
                        "experts (the same work for both)", **timing}
    gathered = [None] * ep
    dist.all_gather_object(gathered, result)
    if rank == 0:
        (out / "unit.json").write_text(json.dumps(gathered, indent=1))
    dpe.close()
    dist.barrier()
    dist.destroy_process_group()


def torchrun(args: list[str], log: Path, timeout: int = 400) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    with open(log, "w") as f:
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\ncheck.py: stopped after {timeout} s\n")
            return 124


def train_pair(preset: str, steps: int, extra: list[str], work: Path) -> dict:
    """The same EP=2 bf16 run with each dispatcher, under torchrun through moelab's rank entry point."""
    from moelab.config import load_config, save_config
    from moelab.contract.stream import read_events

    runs = {}
    for dispatcher in ("all_to_all", "deepep"):
        folder = work / f"{preset}-{dispatcher}"
        shutil.rmtree(folder, ignore_errors=True)  # a fresh run folder: an old one would be resumed
        folder.mkdir(parents=True)
        over = ["parallel.ep=2", "train.dtype=bfloat16", "train.device=cuda", f"train.steps={steps}",
                f"backend.dispatcher={dispatcher}", *extra]
        save_config(load_config(preset, over), folder / "config.yaml")
        t0 = time.time()
        rc = torchrun(["-m", "moelab.launch.entry", str(folder)], work / f"{preset}-{dispatcher}.log")
        ev = [e for e in read_events(folder / "metrics.jsonl") if e["event"] == "step"] \
            if (folder / "metrics.jsonl").exists() else []
        median = (lambda key: statistics.median([e[key] for e in ev[2:]]) if len(ev) > 2 else None)  # after warm-up
        runs[dispatcher] = {"rc": rc, "wall_s": round(time.time() - t0, 1), "losses": [e["loss"] for e in ev],
                            "step_time_s_median": median("step_time_s"),
                            "tokens_per_s_per_gpu_median": median("tokens_per_s_per_gpu"), "overrides": over}
    a, b = runs["all_to_all"]["losses"], runs["deepep"]["losses"]
    diff = max(abs(x - y) / abs(x) for x, y in zip(a, b)) if len(a) == len(b) == steps else None  # None: a run failed
    ta, tb = runs["all_to_all"]["step_time_s_median"], runs["deepep"]["step_time_s_median"]
    return {"preset": preset, "steps": steps, "max_rel_loss_diff": diff, "tolerance": TOL,
            "passed": diff is not None and diff <= TOL, "deepep_speedup_per_step": ta / tb if ta and tb else None,
            "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--worker", choices=["unit"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--proxy-steps", type=int, default=8)
    ap.add_argument("--skip-proxy", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for every training run, e.g. --set train.compile=true")
    ap.add_argument("--proxy-after-s", type=float, default=200, help="skip the proxy runs if the unit and tiny "
                    "parts took longer than this (the call's 10 minutes)")
    a = ap.parse_args()
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):  # multicast stays off
        os.environ.setdefault(k, "1" if k != "NCCL_NVLS_ENABLE" else "0")
    t_start = time.time()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.worker == "unit":
        unit_worker(a.out)
        return 0
    from moelab.train.bench import commit_id

    record = {"check": "backend.dispatcher=deepep against all_to_all (issue 23, item 3)", "commit": commit_id(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
              "gpus": torch.cuda.device_count(),
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    path = a.out / "deepep-check.json"
    try:
        record["deep_ep"] = package_info()
    except Exception as e:
        record.update(passed=False, error=f"{type(e).__name__}: {e}")
        path.write_text(json.dumps(record, indent=1))
        print(record["error"])
        return 1
    if record["gpus"] < 2:
        record.update(one_rank_check(), passed=None,
                      status=f"the comparison needs 2 GPUs (DeepEP's intranode kernels serve 2, 4 or 8 ranks); "
                             f"this machine has {record['gpus']}: import and one-rank checks only")
        path.write_text(json.dumps(record, indent=1))
        print(json.dumps(record, indent=1))
        return 0
    work = Path("/tmp/deepep-check")
    work.mkdir(parents=True, exist_ok=True)

    def save():  # after every part, so that a call stopped at its limit still brings back what was done
        path.write_text(json.dumps(record, indent=1))
        with tarfile.open(a.out / "deepep-logs.tar.gz", "w:gz") as tar:
            for log in work.glob("*.log"):
                tar.add(log, arcname=log.name)

    (work / "unit.json").unlink(missing_ok=True)
    rc = torchrun([str(HERE), "--worker", "unit", "--out", str(work)], work / "unit.log", timeout=240)
    unit = json.loads((work / "unit.json").read_text()) if (work / "unit.json").exists() else None
    record["unit"] = unit or {"rc": rc, "error": "no unit.json; see unit.log in deepep-logs.tar.gz"}
    record["passed"] = False
    save()
    record["train"] = [train_pair("tiny", a.steps, a.set, work)]
    save()
    if not a.skip_proxy and time.time() - t_start < a.proxy_after_s:
        record["train"].append(train_pair("qwen3-moe-30b-a3b-proxy", a.proxy_steps, PROXY + a.set, work))
    elif not a.skip_proxy:
        record["proxy"] = f"skipped: the earlier parts took {time.time() - t_start:.0f} s (--proxy-after-s)"
    record["passed"] = bool(unit) and all(r[name]["passed"] for r in unit for name in CASES) \
        and all(t["passed"] for t in record["train"])
    save()
    print(json.dumps({k: v for k, v in record.items() if k != "train"}, indent=1))
    for t in record["train"]:
        print(f"{t['preset']}: max relative loss difference {t['max_rel_loss_diff']} (tolerance {TOL}); "
              f"step time all_to_all {t['runs']['all_to_all']['step_time_s_median']} s, deepep "
              f"{t['runs']['deepep']['step_time_s_median']} s; {'ok' if t['passed'] else 'FAILED'}")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
