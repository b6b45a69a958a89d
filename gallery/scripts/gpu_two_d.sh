#!/usr/bin/env bash
# Two-GPU call of the second session (issue 10): the equivalence check with PP=2 and CP=2, then the PP=2 and
# CP=2 proxies and the CP proxy's one-GPU baseline (sequence 8192). Each record is copied to $OUT as it exists.
#   MOELAB_COMMIT=$(git rev-parse HEAD) bash gallery/scripts/gpu_two_d.sh      # on a machine with 2 GPUs
set -u
ROOT=$(pwd); export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; L=/tmp/logs; mkdir -p $L $OUT
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
cp -r gallery /tmp/gal; rm -f /tmp/gal/results/*.json
gal() {
  timeout $2 python3 -m moelab gallery run $1 --steps 8 --warmup 3 --dir /tmp/gal --out /tmp/runs/$1 > $L/gallery-$1.log 2>&1
  echo "[$(el)s] gallery $1: rc=$?"; cp /tmp/gal/results/$1--moelab.json $OUT/ 2>/dev/null
  { echo "== $1"; grep -v '^ \|^{\|^}' $L/gallery-$1.log | tail -c 3000; } >> $OUT/logs.txt
}
timeout 330 bash gallery/scripts/check_two_gpu.sh /tmp/c2 tiny 20 > $L/check.log 2>&1
echo "[$(el)s] check_two_gpu rc=$?"; cat $L/check.log
cp /tmp/c2/check_two_gpu.json $OUT/check-two-gpu-equivalence-tiny.json 2>/dev/null
for f in /tmp/c2/*.log; do grep -q Traceback $f && { echo "== $f"; tail -c 2500 $f; } >> $OUT/logs.txt; done
CUDA_VISIBLE_DEVICES=0 gal qwen3-moe-30b-a3b-proxy-1gpu-seq8192 120
gal qwen3-moe-30b-a3b-proxy-pp2 120
gal qwen3-moe-30b-a3b-proxy-cp2 120
tail -c 4000 $OUT/logs.txt
