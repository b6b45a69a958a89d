"""Issue 31: the MoE layer's sums over each token's K rows (moelab.model.rows.sum_rows: the combine's forward and
the dispatch's backward) against the form they replaced, compiled, at the Qwen3 proxy's shapes, checked and timed.

    python gallery/scripts/gpu_check_rows.py --out DIR            # writes DIR/check-rows.json
    python gallery/scripts/gpu_check_rows.py --out DIR --small    # CPU: small shapes, checks the script

T 8192 tokens, K 8, D 2048, bf16 rows routed over 128 experts. "before": the dispatch's backward as the [T*K, D]
gather viewed [T, K, D] and summed over K (commit 9e0dd92's rows.py: inductor's persistent reduction over K, 0.33 ms
per layer and micro batch in call 5's profile); "now": moelab.model.rows.dispatch_rows. The combine is
moelab.model.rows.combine_rows in both (see `combine`). Each compiled; forward, and forward +
backward of the combine (fp32 out, as under autocast) and of the dispatch (bf16); GB/s of the forward's bytes
(T*K*D rows read, T*D written); largest relative difference against a float64 reference.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from moelab.model.rows import combine_rows, dispatch_rows, inverse_permutation
from moelab.train.bench import median_ms, commit_id


class _BeforeDispatch(torch.autograd.Function):  # 9e0dd92's dispatch_rows
    @staticmethod
    def forward(ctx, x_TD, order_N, inverse_N, K):
        ctx.save_for_backward(inverse_N)
        ctx.K = K
        return x_TD[order_N // K]

    @staticmethod
    def backward(ctx, g_ND):
        (inverse_N,) = ctx.saved_tensors
        return g_ND[inverse_N].view(inverse_N.shape[0] // ctx.K, ctx.K, -1).sum(1), None, None, None


def combine(y_ND, order_N, inverse_N, K):
    """The combine of both forms: 9e0dd92's (unsort, then the sum over K) is today's again (after call 9, where
    'now' had the sum inside one autograd.Function and its compiled gradient came out zeros on the GPU)."""
    return combine_rows(y_ND, order_N, inverse_N, K, torch.float32)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    T, K, D, E, reps = (8192, 8, 2048, 128, 20) if not args.small else (64, 4, 32, 8, 2)
    g = torch.Generator().manual_seed(0)
    experts_TK = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    order_N = torch.argsort(experts_TK.reshape(-1), stable=True).to(dev)
    inverse_N = inverse_permutation(order_N)
    y_ND = torch.randn(T * K, D, generator=g).to(dev, torch.bfloat16)
    x_TD = torch.randn(T, D, generator=g).to(dev, torch.bfloat16)
    g_TD = torch.randn(T, D, generator=g).to(dev)
    g_ND = torch.randn(T * K, D, generator=g).to(dev, torch.bfloat16)
    rec = {"system": "moelab", "workload": "qwen3-moe-30b-a3b-proxy", "variant": "check-rows",
           "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch_version": torch.__version__,
           "commit": commit_id(), "command": " ".join(["python"] + sys.argv),
           "shapes": {"tokens": T, "top_k": K, "hidden": D, "experts": E}, "results": {}}
    bytes_fwd = (T * K * D + T * D) * 2
    exact = y_ND.double()[inverse_N].view(T, K, D).sum(1)
    exact_dx = g_ND.double()[inverse_N].view(T, K, D).sum(1)
    grads = {}
    for name, dispatch in (("before", _BeforeDispatch.apply), ("now", dispatch_rows)):
        comb, disp = torch.compile(combine), torch.compile(dispatch)
        y = y_ND.detach().requires_grad_()
        x = x_TD.detach().requires_grad_()
        out = comb(y, order_N, inverse_N, K)
        (dy,) = torch.autograd.grad(out, (y,), g_TD)
        (dx,) = torch.autograd.grad(disp(x, order_N, inverse_N, K), (x,), g_ND)
        want = g_TD.to(torch.bfloat16)[order_N // K]  # the combine's gradient: every row its token's, in bf16
        dy_eager = torch.autograd.grad(combine(y, order_N, inverse_N, K), (y,), g_TD)[0]
        differ = dy != want
        where = differ.nonzero()[:4]
        r = {"combine_rel_vs_float64": rel(out, exact),
             "combine_grad_equals_gather": bool(torch.equal(dy, want)),
             "combine_grad": {"dtype": str(dy.dtype), "shape": list(dy.shape), "stride": list(dy.stride()),
                              "differing": int(differ.sum()), "max_abs_diff": float((dy.float() - want.float()).abs()
                                                                                    .max()),
                              "rel_vs_gather": rel(dy, want), "eager_equals_gather": bool(torch.equal(dy_eager, want)),
                              "examples (row, col, compiled, gather, g fp32)": [
                                  [int(i), int(j), float(dy[i, j]), float(want[i, j]),
                                   float(g_TD[order_N[i] // K, j])] for i, j in where.tolist()]},
             "dispatch_grad_rel_vs_float64": rel(dx, exact_dx),
             "combine_forward_ms": median_ms(lambda: comb(y_ND, order_N, inverse_N, K), reps, warmup=3),
             "combine_fwd_bwd_ms": median_ms(lambda: torch.autograd.grad(comb(y, order_N, inverse_N, K), (y,), g_TD),
                                             reps, warmup=3),
             "dispatch_fwd_bwd_ms": median_ms(lambda: torch.autograd.grad(disp(x, order_N, inverse_N, K), (x,), g_ND),
                                              reps, warmup=3)}
        r["combine_forward_gb_s"] = bytes_fwd / (r["combine_forward_ms"] * 1e-3) / 1e9
        rec["results"][name] = r
        grads[name] = (dy, dx)
        print(f"rows {name}: {json.dumps(r)}", flush=True)
    (dy_b, dx_b), (dy_n, dx_n) = grads["before"], grads["now"]
    rec["now_vs_before"] = {"combine_grad_equal": bool(torch.equal(dy_n, dy_b)), "combine_grad_rel": rel(dy_n, dy_b),
                            "dispatch_grad_rel": rel(dx_n, dx_b)}
    print(f"rows now vs before: {json.dumps(rec['now_vs_before'])}", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "check-rows.json").write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
