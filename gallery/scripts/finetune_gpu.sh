#!/usr/bin/env bash
# The gallery's fine-tuning entry on one H200 (qwen3-moe-30b-a3b-proxy-finetune-1gpu): make the Qwen3-30B-A3B proxy
# checkpoint with transformers (8 layers, random weights, bf16 safetensors in /tmp, timed), then fine-tune it with
# moelab from hf: it: LoRA (rank 16, attention + routed experts) and full fine-tuning, SFT data, each compiled first
# and eager where compiling fails; one JSON per run in $OUT (gallery/results' format) and the logs.
#   MODES="lora full"   STEPS=20   BUDGET_S=470 (a part that no longer fits is skipped and says so)
#   COMPILE=0           eager only (default 1: compiled first, eager where compiling fails)
#   STACKS_S=60         every STACKS_S seconds each Python process writes its threads' stacks to its part's log
#                       (faulthandler), and the log's tail is shown when a part fails or times out
#   MOELAB_COMMIT=<sha> the commit the results belong to (the device copy has no git)
#   TINY=1              CPU, small shapes, no compile: checks the script (tests/gallery/test_finetune_script.py)
# Device call: command "MOELAB_COMMIT=<sha> bash gallery/scripts/finetune_gpu.sh", one nvidia-h200, timeout 600.
set -u
ROOT=$(pwd)
OUT=${OUT:-/tmp/finetune_out}; mkdir -p "$OUT/logs"
CKPT=${CKPT:-/tmp/qwen3-proxy-hf}
MODES=${MODES:-"lora full"}; STEPS=${STEPS:-20}; BUDGET_S=${BUDGET_S:-470}; COMPILE=${COMPILE:-1}
export STACKS_S=${STACKS_S:-60}
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export MOELAB_COMMIT=${MOELAB_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
TINY_FLAG=${TINY:+--tiny}
PY="python3 gallery/scripts/finetune_gpu.py"
if [ -z "${TINY:-}" ]; then
  nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/logs/machine.txt" 2>&1
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  >> "$OUT/logs/machine.txt" 2>&1
python3 -c "import peft; print('peft', peft.__version__)" >> "$OUT/logs/machine.txt" 2>&1
cat "$OUT/logs/machine.txt"

# part NAME TIMEOUT_S ARGS...: `finetune_gpu.py ARGS` under timeout if it still fits the budget; 0 when it passed
part() {
  local name=$1 t=$2; shift 2
  local left=$(( BUDGET_S - $(el) ))
  if [ $left -lt 30 ]; then echo "[$(el)s] $name: SKIPPED (budget: ${left}s left)"; return 2; fi
  [ $t -gt $left ] && t=$left
  echo "[$(el)s] $name (timeout ${t}s)"
  timeout -k 5 $t $PY "$@" --out "$OUT" $TINY_FLAG > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  grep -h "^checkpoint:\|^lora\|^full" "$OUT/logs/$name.log"
  [ $rc -ne 0 ] && echo "[$(el)s] $name: exit $rc" && grep -v "warn" "$OUT/logs/$name.log" | tail -8
  return $rc
}

part make 200 make --ckpt "$CKPT" || { echo "no checkpoint: stopping"; exit 1; }
FAILED=0
for mode in $MODES; do
  if [ -z "${TINY:-}" ] && [ "$COMPILE" = 1 ] && part "$mode-compile" 200 train --ckpt "$CKPT" --mode "$mode" --steps "$STEPS" --compile
  then continue; fi
  part "$mode" 150 train --ckpt "$CKPT" --mode "$mode" --steps "$STEPS" || FAILED=1
done
rm -rf "$OUT"/run-*/checkpoints
# the run folders come back as one file (a call brings back a limited number of files)
if ls -d "$OUT"/run-* >/dev/null 2>&1; then
  tar czf "$OUT/runs.tar.gz" -C "$OUT" $(cd "$OUT" && ls -d run-*) && rm -rf "$OUT"/run-*
fi
echo "[$(el)s] done"; ls "$OUT"
exit $FAILED
