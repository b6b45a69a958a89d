#!/usr/bin/env bash
# Third two-GPU call: the remaining gallery proxies (issue 6): two one-GPU proxies at once (one per GPU), then the
# EP=2 proxies, then a PP=2 run of tiny. Each record is copied to $OUT as soon as it exists.
set -u
ROOT=$(pwd); export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=/tmp/logs; mkdir -p $L
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
cp -r gallery /tmp/gal; rm -f /tmp/gal/results/*.json
gal() {
  timeout $2 python3 -m moelab gallery run $1 --steps 6 --warmup 2 --dir /tmp/gal --out /tmp/runs/$1 > $L/gallery-$1.log 2>&1
  echo "[$(el)s] gallery $1: rc=$?"; cp /tmp/gal/results/$1--moelab.json $OUT/ 2>/dev/null
  { echo "== $1"; grep -v '^ \|^{\|^}' $L/gallery-$1.log | tail -c 3000; } >> $OUT/logs.txt
}
CUDA_VISIBLE_DEVICES=0 gal kimi-k2-proxy-1gpu 130 &
CUDA_VISIBLE_DEVICES=1 gal gpt-oss-120b-proxy-1gpu 130 &
wait
gal deepseek-v3-proxy-ep2 100
gal kimi-k2-proxy-ep2 100
timeout 30 python3 -m moelab run tiny --steps 20 --nproc 2 --set parallel.pp=2 --set train.device=cuda \
  --out /tmp/runs/tiny-pp-2 > $L/tiny-pp-2.log 2>&1; echo "[$(el)s] tiny pp=2 rc=$?"; tail -3 $L/tiny-pp-2.log; tail -c 3000 $L/tiny-pp-2.log >> $OUT/logs.txt
cat $OUT/logs.txt | tail -40
