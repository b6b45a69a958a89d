#!/usr/bin/env bash
# Second two-GPU call: GPU 0 the final one-GPU fast-path variants, GPU 1 the peers at global batch 16 (both at
# once); then the two-GPU equivalence check (issue 3). Only small files come back: $OUT/results.tar.gz holds the
# JSON records and logs (run folders with checkpoints stay behind).
set -u
ROOT=$(pwd); export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=/tmp/results; L=/tmp/results/logs; mkdir -p $R $L
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
pack() {
  mkdir -p $R/two_gpu_small
  cp /tmp/two_gpu/*.json /tmp/two_gpu/*.log $R/two_gpu_small/ 2>/dev/null
  (cd /tmp && find results -type f \( -name '*.json' -o -name '*.log' -o -name '*.txt' \) -size -2M \
     | tar czf $OUT/results.tar.gz -T -)
  ls -la $OUT
}
trap pack EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > $L/pip.log 2>&1
echo "[$(el)s] phase A"
( export CUDA_VISIBLE_DEVICES=0
  timeout 170 python3 gallery/scripts/bench_variants.py --out $R/variants --deadline-s 150 \
    --skip real-router-gbs16,fake-gate-gbs16,fake-gate-gbs2-fast-permute,cudnn > $L/variants.log 2>&1
  echo "[$(el)s] variants rc=$?" ) &
( export CUDA_VISIBLE_DEVICES=1
  cd gallery/peers
  timeout 80 python3 hf_transformers.py --experts grouped_mm --global-batch 16 --steps 3 --warmup 1 \
    --json $R/hf-transformers-grouped_mm-gbs16.json > $L/hf-gbs16.log 2>&1; tail -1 $L/hf-gbs16.log
  PYTHONPATH=/tmp/site:$ROOT timeout 80 python3 torchtitan_qwen3.py --global-batch 16 --steps 3 --warmup 1 \
    --json $R/torchtitan-gbs16.json > $L/torchtitan-gbs16.log 2>&1; tail -1 $L/torchtitan-gbs16.log ) &
wait
grep -v "warn" $L/variants.log | tail -12
echo "[$(el)s] phase B: two-GPU equivalence"
timeout 230 bash gallery/scripts/check_two_gpu.sh /tmp/two_gpu tiny 20 > $L/check_two_gpu.log 2>&1
echo "check_two_gpu rc=$?"; tail -6 $L/check_two_gpu.log; ls /tmp/two_gpu
echo "[$(el)s] done"
