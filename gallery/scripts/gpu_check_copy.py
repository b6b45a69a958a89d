"""Issue 41: does a micro batch's copy to the GPU wait for the kernels queued before it? One proxy micro batch
(2 x 4,097 token ids, 64 KiB) is copied behind a kernel that keeps the GPU busy for about --sleep-ms: the host's
milliseconds in the copy call, and whether the queued kernel had finished when it returned, for
moelab.data.transfer.to_device (pinned staging, today) and the pageable copy it replaced (with non_blocking and
without); each copy's values checked.

    python gallery/scripts/gpu_check_copy.py --out DIR      # DIR/copy-check.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from moelab.data import transfer
from moelab.train.bench import commit_id

WAYS = {"to_device (pinned)": lambda t: transfer.to_device(t, "cuda"),
        "pageable, non_blocking": lambda t: t.to("cuda", non_blocking=True),
        "pageable, blocking": lambda t: t.to("cuda")}


def sleep_cycles(ms: float) -> int:
    """torch.cuda._sleep's cycles for about `ms` milliseconds (timed once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 * ms / start.elapsed_time(end))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sleep-ms", type=float, default=50.0)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    cycles = sleep_cycles(args.sleep_ms)
    batch_BL = torch.randint(0, 151_936, (2, 4097))
    results = {}
    for name, copy in WAYS.items():
        host_ms, waited, equal = [], [], True
        for _ in range(args.reps):
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            t0 = time.perf_counter()
            got = copy(batch_BL)
            host_ms.append((time.perf_counter() - t0) * 1e3)
            waited.append(torch.cuda.current_stream().query())  # the queued kernel done when the call returned
            equal &= torch.equal(got.cpu(), batch_BL)
        results[name] = {"host_ms_median": round(statistics.median(host_ms), 3), "waited_for_queue": all(waited),
                         "waited_any": any(waited), "values_equal": equal}
        print(f"copy {name:24s} host {statistics.median(host_ms):8.3f} ms, waited for the queued kernel "
              f"{sum(waited)}/{len(waited)}, values equal {equal}", flush=True)
    pinned = results["to_device (pinned)"]
    ok = pinned["values_equal"] and not pinned["waited_any"] and all(r["values_equal"] for r in results.values())
    rec = {"system": "moelab", "workload": "qwen3-moe-30b-a3b-proxy", "variant": "copy-check",
           "gpu_name": torch.cuda.get_device_name(), "torch_version": torch.__version__, "commit": commit_id(),
           "command": " ".join(["python"] + sys.argv), "bytes": batch_BL.numel() * batch_BL.element_size(),
           "queued_kernel_ms": args.sleep_ms, "by_copy": results, "ok": ok}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "copy-check.json").write_text(json.dumps(rec, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
