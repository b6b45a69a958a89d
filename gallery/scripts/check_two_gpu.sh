#!/usr/bin/env bash
# Two-GPU equivalence check (issues 3 and 10): EP=2, FSDP=2, PP=2 and CP=2 with NCCL reproduce the one-GPU
# losses.
#
#   bash gallery/scripts/check_two_gpu.sh OUT_DIR [PRESET] [STEPS]      # on a machine with 2 GPUs
#
# Runs PRESET (default tiny) for STEPS (default 20) steps in fp32 and in bf16 (FSDP2 mixed precision on the
# two-GPU runs): once on GPU 0 alone, then on 2 processes with parallel.ep=2, FSDP=2 only, parallel.pp=2 (1F1B)
# and parallel.cp=2 (and, when LAYOUTS names ep2overlap, EP=2 with parallel.ep_overlap, held to ep2 too). Writes
# OUT_DIR/check_two_gpu.json (every run's losses, throughput and peak memory, and each comparison's maximum
# relative loss difference against its tolerance) and exits non-zero if a comparison fails.
# DEVICE=cpu runs the same on CPU processes (gloo), to test the script itself.
# fp32 tolerance 1e-4 (reduction order only); bf16 tolerance 2e-2 (bf16 rounding differs with the order).
set -euo pipefail
OUT=${1:?usage: check_two_gpu.sh OUT_DIR [PRESET] [STEPS]}
PRESET=${2:-tiny}
STEPS=${3:-20}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export LAYOUTS=${LAYOUTS:-ep2 fsdp2 pp2 cp2}  # a subset, e.g. LAYOUTS="ep2 pp2"

for DTYPE in float32 bfloat16; do
  COMMON=(run "$PRESET" --steps "$STEPS" --set train.dtype=$DTYPE --set train.device=${DEVICE:-cuda})
  CUDA_VISIBLE_DEVICES=0 python -m moelab "${COMMON[@]}" --out "$OUT/$DTYPE-1gpu" > "$OUT/$DTYPE-1gpu.log" 2>&1
  for LAYOUT in ep2:parallel.ep=2 fsdp2:parallel.fsdp=2 pp2:parallel.pp=2 cp2:parallel.cp=2 \
                ep2overlap:parallel.ep=2,parallel.ep_overlap=true; do
    NAME=${LAYOUT%%:*}
    [[ " $LAYOUTS " == *" $NAME "* ]] || continue
    SETS=(); IFS=, read -ra KVS <<< "${LAYOUT#*:}"; for KV in "${KVS[@]}"; do SETS+=(--set "$KV"); done
    python -m moelab "${COMMON[@]}" --nproc 2 "${SETS[@]}" --out "$OUT/$DTYPE-$NAME" \
      > "$OUT/$DTYPE-$NAME.log" 2>&1 || echo "$DTYPE $NAME: failed, see $OUT/$DTYPE-$NAME.log"  # the others still run
  done
done

python - "$OUT" "$PRESET" "$STEPS" <<'EOF'
import json, os, sys, time
from pathlib import Path

import torch

from moelab.train.bench import commit_id
from moelab.contract.stream import read_events

out, preset, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
TOL = {"float32": 1e-4, "bfloat16": 2e-2}
LAYOUTS = tuple(os.environ["LAYOUTS"].split())
runs, comparisons = {}, []
for dtype in TOL:
    for layout in ("1gpu",) + LAYOUTS:
        name = f"{dtype}-{layout}"
        path = out / name / "metrics.jsonl"
        ev = [e for e in read_events(path) if e["event"] == "step"] if path.exists() else []
        if not ev:  # the run failed before its first step: its comparison fails below
            runs[name] = {"losses": [], "error": f"no step in {path}; see {name}.log"}
            continue
        runs[name] = {"losses": [e["loss"] for e in ev], "grad_norms": [e["grad_norm"] for e in ev],
                      "tokens_per_s_per_gpu": [e["tokens_per_s_per_gpu"] for e in ev][-1],
                      "max_peak_allocated_gb": ev[-1]["memory"]["max_peak_allocated_gb"]}
    ref = runs[f"{dtype}-1gpu"]["losses"]
    for layout in LAYOUTS:
        got = runs[f"{dtype}-{layout}"]["losses"]
        rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref)) if len(got) == len(ref) == steps else float("inf")
        comparisons.append({"dtype": dtype, "layout": layout, "against": "1gpu", "max_rel_loss_diff": rel,
                            "tolerance": TOL[dtype], "passed": rel <= TOL[dtype]})
    if {"ep2", "ep2overlap"} <= set(LAYOUTS):  # the overlap against the same layout without it
        got, plain = runs[f"{dtype}-ep2overlap"]["losses"], runs[f"{dtype}-ep2"]["losses"]
        rel = (max(abs(a - b) / abs(b) for a, b in zip(got, plain)) if len(got) == len(plain) == steps
               else float("inf"))
        comparisons.append({"dtype": dtype, "layout": "ep2overlap", "against": "ep2", "max_rel_loss_diff": rel,
                            "tolerance": TOL[dtype], "passed": rel <= TOL[dtype]})
result = {"check": "two-gpu equivalence (issues 3 and 10)", "preset": preset, "steps": steps,
          "command": f"LAYOUTS='{' '.join(LAYOUTS)}' bash gallery/scripts/check_two_gpu.sh OUT_DIR {preset} {steps}", "commit": commit_id(),
          "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
          "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
          "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
          "passed": all(c["passed"] for c in comparisons), "comparisons": comparisons, "runs": runs}
(out / "check_two_gpu.json").write_text(json.dumps(result, indent=1))
for c in comparisons:
    print(f"{c['dtype']:9s} {c['layout']:6s} vs {c['against']}: max relative loss difference {c['max_rel_loss_diff']:.2e} "
          f"(tolerance {c['tolerance']:.0e}) {'ok' if c['passed'] else 'FAILED'}")
sys.exit(0 if result["passed"] else 1)
EOF
