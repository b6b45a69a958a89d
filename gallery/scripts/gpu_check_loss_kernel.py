"""Issue 41: the full loss's in-place kernel (moelab.backends.loss_kernel) against the compiled loss it replaces.

At the Qwen3 proxy's LM head (8,192 tokens, hidden 2,048, vocabulary 151,936, bf16) the head and its loss run forward
+ backward both ways from the same hidden states and weight (moelab.backends.loss.lm_loss, backend.loss=full, the
head's plain GEMMs): the losses within 1e-5 (relative), the hidden states' and the head's gradients within 1% of
their largest entry; a scale other than the expected one (backward rescales) checked too. Then: the loss kernels
alone (logits given; the kernel's row block, warps, programs per SM and L2 hints swept, the module's default marked),
the head + loss forward + backward both ways, and the peak memory of each.

    python gallery/scripts/gpu_check_loss_kernel.py --out DIR        # DIR/loss-kernel-check.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

from moelab.backends import full_loss, loss_kernel
from moelab.backends.loss import lm_loss
from moelab.train.bench import commit_id, median_ms

T, D, V = 8192, 2048, 151936
# (BLOCK, WARPS, ROWS_PER_SM, EVICT) of moelab.backends.loss_kernel: a program per row (ROWS_PER_SM 0), or a few per
# SM walking rows (fewer rows in flight, so the second read finds more of its row in L2), with and without L2 hints
CONFIGS = ((8192, 16, 0, False), (8192, 16, 0, True), (4096, 8, 0, True), (16384, 16, 0, True), (16384, 32, 0, True),
           (32768, 32, 0, True), (8192, 16, 1, True), (8192, 16, 4, True))


def head_loss(h_TD, head, targets_T, in_place: bool, scale: float = 1.0, expected: float = 1.0):
    """(loss, d hidden, d weight) of the full loss with or without the in-place kernel."""
    full_loss.IN_PLACE = in_place
    head.weight.grad = None
    h = h_TD.detach().requires_grad_()
    loss = lm_loss(h[None], head, targets_T[None], "full", compiled=True, backward_scale=expected)
    (loss * scale).backward()
    full_loss.IN_PLACE = True
    return loss.detach(), h.grad, head.weight.grad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    h_TD = torch.randn(T, D, generator=gen).to(torch.bfloat16).cuda()
    head = nn.Linear(D, V, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_((torch.randn(V, D, generator=gen) * 0.02).to(torch.bfloat16))
    targets_T = torch.randint(0, V, (T,), generator=gen).cuda()
    targets_T[::97] = -100  # some tokens left out
    checks = {}
    for name, scale, expected in (("as expected", 1.0, 1.0), ("rescaled in backward", 0.125, 0.5)):
        ref = head_loss(h_TD, head, targets_T, False, scale, expected)
        got = head_loss(h_TD, head, targets_T, True, scale, expected)
        checks[name] = {"loss_rel": abs(float(got[0] - ref[0])) / abs(float(ref[0])),
                        "d_hidden_rel": rel(got[1], ref[1]), "d_weight_rel": rel(got[2], ref[2])}
    ok = all(c["loss_rel"] <= 1e-5 and c["d_hidden_rel"] <= 1e-2 and c["d_weight_rel"] <= 1e-2
             for c in checks.values())

    logits = (h_TD @ head.weight.t()).contiguous()
    count = (targets_T != -100).sum().float()
    compiled = full_loss._compiled_cross_entropy()

    def compiled_loss():
        x = logits.detach().requires_grad_()
        compiled(x[None], targets_T[None]).backward()

    kernel_ms = {}
    default = (loss_kernel.BLOCK, loss_kernel.WARPS, loss_kernel.ROWS_PER_SM, loss_kernel.EVICT)
    default_name = loss_kernel.config_name()
    ref_d = logits.clone()
    ref_T = loss_kernel._row_losses(ref_d, targets_T, 1 / count)
    timed_d = logits.clone()  # the timed calls' buffer: it holds the gradient after the first
    config_rel = {}  # each config's losses and gradient against the default's (block sizes reorder the sums)
    for config in CONFIGS:
        loss_kernel.BLOCK, loss_kernel.WARPS, loss_kernel.ROWS_PER_SM, loss_kernel.EVICT = config
        d = logits.clone()
        got_T = loss_kernel._row_losses(d, targets_T, 1 / count)
        config_rel[loss_kernel.config_name()] = {"losses": rel(got_T, ref_T), "gradient": rel(d, ref_d)}
        del d
        kernel_ms[loss_kernel.config_name()] = round(
            median_ms(lambda: loss_kernel._row_losses(timed_d, targets_T, 1 / count)), 4)
    loss_kernel.BLOCK, loss_kernel.WARPS, loss_kernel.ROWS_PER_SM, loss_kernel.EVICT = default
    ref_d = timed_d = None
    ok = ok and all(r["losses"] <= 1e-6 and r["gradient"] <= 1e-2 for r in config_rel.values())
    t_compiled = median_ms(compiled_loss)
    logits = None
    peak = {}
    t_head = {}
    for in_place in (False, True):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t_head[in_place] = median_ms(lambda: head_loss(h_TD, head, targets_T, in_place))
        peak[in_place] = (torch.cuda.max_memory_allocated() - base) / 2**30
    rec = {"system": "moelab", "workload": "qwen3-moe-30b-a3b-proxy", "variant": "loss-kernel-check",
           "gpu_name": torch.cuda.get_device_name(), "torch_version": torch.__version__, "commit": commit_id(),
           "command": " ".join(["python"] + sys.argv), "shape": {"T": T, "D": D, "V": V}, "checks": checks,
           "ms_loss_kernel_by_config": kernel_ms, "rel_to_default_by_config": config_rel,
           "default_config": default_name,
           "ms_compiled_loss_fwd_bwd": round(t_compiled, 4),
           "ms_head_and_loss_fwd_bwd": {"compiled": round(t_head[False], 4), "in_place": round(t_head[True], 4)},
           "peak_gib_head_and_loss": {"compiled": round(peak[False], 3), "in_place": round(peak[True], 3)}, "ok": ok}
    print(f"loss kernel: {checks}; kernel alone {kernel_ms} ms (default {default_name}; against it: {config_rel}) "
          f"against the compiled loss's forward + backward {t_compiled:.3f} ms; head + loss {t_head[False]:.3f} -> "
          f"{t_head[True]:.3f} ms, peak {peak[False]:.2f} -> {peak[True]:.2f} GiB; {'OK' if ok else 'FAILED'}",
          flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "loss-kernel-check.json").write_text(json.dumps(rec, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
