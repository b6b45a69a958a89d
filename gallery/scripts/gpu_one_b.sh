#!/usr/bin/env bash
# Second one-GPU call: moelab's fast-path variants with profiles (compile, permutation, attention backend), and
# the CLI bench of the default fp32-parameter (autocast) path. Results under $OUT as results.tar.gz + logs.tar.gz.
set -u
ROOT=$(pwd); export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT
R=/tmp/results; L=/tmp/logs; mkdir -p $R $L
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
trap '(cd /tmp && tar czf $OUT/results.tar.gz results && tar czf $OUT/logs.tar.gz logs)' EXIT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > $L/machine.txt
echo "[$(el)s] moelab variants"
timeout 330 python3 gallery/scripts/bench_variants.py --out $R --profile --deadline-s 290 \
  --skip real-router-gbs2-no-metrics,real-router-gbs16,fake-gate-gbs16 > $L/variants.log 2>&1
grep -v "^ *warnings.warn\|UserWarning" $L/variants.log | grep -v "^---\|^Name\|^Self" | tail -80
echo "[$(el)s] moelab bench (CLI, fp32 parameters + autocast)"
timeout 150 python3 -m moelab bench qwen3-moe-30b-a3b-proxy --steps 5 --warmup 2 --set train.param_dtype=float32 \
  --set backend.fake_balanced_gate=true --no-metrics-overhead --json $R/moelab-cli-fp32-params.json > $L/cli-fp32.log 2>&1
tail -4 $L/cli-fp32.log; echo "[$(el)s] done"
