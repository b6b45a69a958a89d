"""Issue 41: the experts' weight gradients' sums of squares from SonicMoE's GEMMs (moelab.backends.sonic_squares).

One MoE layer's experts at the Qwen3 proxy's shape (8,192 tokens, top-8 of 128 experts, hidden 2,048, width 768,
skewed routing, bf16, SonicMoE's memory order) run forward + backward twice from fresh gradients: plainly, and
inside squares_in_backward (the trainer's last micro batch). The gradients must be bitwise equal, and each recorded
sum within 1e-4 (relative) of the sum of squares of the bf16 gradient (in float64). Then the backward is timed both
ways, beside the norm's own pass over the two gradients (moelab.backends.grad_norm.squared_norms).

    SONIC_SITE=... python gallery/scripts/gpu_check_sonic_squares.py --out DIR     # DIR/sonic-squares-check.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

from moelab.backends import grad_norm as G
from moelab.backends.sonic import sonic_experts
from moelab.train.bench import median_ms, commit_id

T, K, E, D, F = 8192, 8, 128, 2048, 768


def inputs(gen: torch.Generator):
    p_E = torch.distributions.Dirichlet(torch.full((E,), 2.0)).sample()
    experts_TK = torch.multinomial(p_E.expand(T, E), K, replacement=False, generator=gen).cuda()
    weights_TK = torch.softmax(torch.randn(T, K, generator=gen), -1).cuda()
    x_TD = (torch.randn(T, D, generator=gen) * 0.5).to(torch.bfloat16).cuda()
    g_TD = torch.randn(T, D, generator=gen).to(torch.bfloat16).cuda()
    # SonicMoE's memory order: [E, 2F, D] and [E, D, F] stored, seen as moelab's [E, D, 2F] and [E, F, D]
    w1 = nn.Parameter((torch.randn(E, 2 * F, D, generator=gen) * 0.02).to(torch.bfloat16).cuda().transpose(1, 2))
    w2 = nn.Parameter((torch.randn(E, D, F, generator=gen) * 0.02).to(torch.bfloat16).cuda().transpose(1, 2))
    return x_TD, weights_TK, experts_TK, g_TD, w1, w2


def fwd_bwd(x_TD, weights_TK, experts_TK, g_TD, w1, w2, squares: bool):
    w1.grad = w2.grad = None
    with G.squares_in_backward(squares):
        sonic_experts(x_TD, weights_TK, experts_TK, w1, w2).backward(g_TD)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    x_TD, weights_TK, experts_TK, g_TD, w1, w2 = case = inputs(gen)
    fwd_bwd(*case, squares=False)
    plain = [w1.grad.clone(), w2.grad.clone()]
    G.param_squared_norms([w1, w2])  # clears any record
    fwd_bwd(*case, squares=True)
    recorded = {id(p): float(sq) for p, sq in G._recorded.values()}
    got = [w1.grad.clone(), w2.grad.clone()]
    want = [float(g.double().square().sum()) for g in got]
    rel = [abs(recorded.get(id(w), float("nan")) - v) / v for w, v in zip((w1, w2), want)]
    same = [torch.equal(a, b) for a, b in zip(plain, got)]
    ok = all(same) and all(r <= 1e-4 for r in rel) and len(recorded) == 2
    G._recorded.clear()
    t_plain = median_ms(lambda: fwd_bwd(*case, squares=False))
    t_sq = median_ms(lambda: (fwd_bwd(*case, squares=True), G._recorded.clear()))
    t_norm = median_ms(lambda: G.squared_norms([w1.grad, w2.grad]))
    rec = {"system": "moelab", "workload": "qwen3-moe-30b-a3b-proxy", "variant": "sonic-squares-check",
           "gpu_name": torch.cuda.get_device_name(), "torch_version": torch.__version__, "commit": commit_id(),
           "command": " ".join(["python"] + sys.argv), "shape": {"T": T, "K": K, "E": E, "D": D, "F": F},
           "recorded": len(recorded), "gradients_bitwise_equal": same, "relative_error_of_sums": rel,
           "ms_fwd_bwd_plain": round(t_plain, 4), "ms_fwd_bwd_with_squares": round(t_sq, 4),
           "ms_norm_pass_of_the_two_gradients": round(t_norm, 4), "ok": ok}
    print(f"sonic squares: recorded {len(recorded)} of 2, gradients bitwise equal {same}, relative error of the "
          f"sums {[f'{r:.2e}' for r in rel]}; forward + backward {t_plain:.3f} ms plain, {t_sq:.3f} ms with the "
          f"squares; the norm's pass over the two gradients {t_norm:.3f} ms; {'OK' if ok else 'FAILED'}", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sonic-squares-check.json").write_text(json.dumps(rec, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
