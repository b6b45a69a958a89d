#!/usr/bin/env bash
# The two-GPU device call (nvidia-h200-x2). Phase A, one job per GPU at once: GPU 0 the final one-GPU fast-path
# variants of moelab; GPU 1 the peers at global batch 16 and the one-GPU gallery proxies. Phase B, both GPUs:
# the EP=2 / FSDP=2 equivalence check, the EP=2 proxy, PP=2 and CP=2 runs. Everything under $OUT
# (results.tar.gz, logs.tar.gz). NVLink multicast stays off (NCCL_NVLS_ENABLE=0 etc., as the machine sets).
set -u
ROOT=$(pwd); export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=/tmp/results; L=/tmp/logs; mkdir -p $R $L
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
cap() { local left=$(( $2 - $(el) )); [ $left -lt $1 ] && echo $left || echo $1; }  # min(cap, until deadline)
trap '(cd /tmp && tar czf $OUT/results.tar.gz results && tar czf $OUT/logs.tar.gz logs)' EXIT
{ nvidia-smi; nvidia-smi topo -m; } > $L/machine.txt 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > $L/pip.log 2>&1
cp -r gallery /tmp/gal; rm -f /tmp/gal/results/*.json
gal() {  # gallery entry on the current CUDA_VISIBLE_DEVICES: name, cap seconds, deadline second
  local t=$(cap $2 $3); [ $t -lt 40 ] && { echo "gallery $1: skipped (no time left)"; return; }
  timeout $t python3 -m moelab gallery run $1 --steps 6 --warmup 2 --dir /tmp/gal --out /tmp/runs/$1 > $L/gallery-$1.log 2>&1
  echo "[$(el)s] gallery $1: rc=$?"
}

echo "[$(el)s] phase A"
( export CUDA_VISIBLE_DEVICES=0
  timeout 260 python3 gallery/scripts/bench_variants.py --out $R/variants --profile --deadline-s 200 \
    --skip real-router-gbs2-no-metrics,real-router-gbs16,fake-gate-gbs16,fake-gate-gbs2-fast-permute,cudnn \
    > $L/variants.log 2>&1
  echo "[$(el)s] variants done"
  gal deepseek-v3-proxy-1gpu 120 280 ) &
( export CUDA_VISIBLE_DEVICES=1
  cd gallery/peers
  timeout 80 python3 hf_transformers.py --experts grouped_mm --global-batch 16 --steps 3 --warmup 1 \
    --json $R/hf-transformers-grouped_mm-gbs16.json > $L/hf-gbs16.log 2>&1; tail -1 $L/hf-gbs16.log
  PYTHONPATH=/tmp/site:$ROOT timeout 80 python3 torchtitan_qwen3.py --global-batch 16 --steps 3 --warmup 1 \
    --json $R/torchtitan-gbs16.json > $L/torchtitan-gbs16.log 2>&1; tail -1 $L/torchtitan-gbs16.log
  cd $ROOT
  gal qwen3-moe-30b-a3b-proxy-1gpu 120 280
  gal gpt-oss-20b-proxy-1gpu 90 280 ) &
wait
grep -v "warn" $L/variants.log | grep -v "^---\|^Name\|^Self\|^ \{20,\}" | tail -30

echo "[$(el)s] phase B: two GPUs"
timeout $(cap 100 540) bash gallery/scripts/check_two_gpu.sh $R/two_gpu tiny 20 > $L/check_two_gpu.log 2>&1; echo "check_two_gpu rc=$?"; tail -4 $L/check_two_gpu.log
gal qwen3-moe-30b-a3b-proxy-ep2 120 540
for P in pp cp; do
  [ $(cap 45 585) -lt 15 ] && { echo "tiny $P=2 skipped"; continue; }
  timeout $(cap 45 585) python3 -m moelab run tiny --steps 20 --nproc 2 --set parallel.$P=2 --set train.device=cuda \
    --out /tmp/runs/tiny-$P-2 > $L/tiny-$P-2.log 2>&1; echo "[$(el)s] tiny $P=2 rc=$?"; tail -6 $L/tiny-$P-2.log
  cp /tmp/runs/tiny-$P-2/summary.json $R/tiny-$P-2-summary.json 2>/dev/null
done
cp /tmp/gal/results/*.json $R/ 2>/dev/null; ls $R
for f in $L/gallery-*.log; do echo "== $f"; tail -3 $f; done
echo "[$(el)s] done"
