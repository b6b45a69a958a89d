#!/usr/bin/env bash
# Call 10 (second session): EP=2 and PP=2 against one GPU on NCCL (tiny, 10 steps), then the EP=2 and PP=2
# proxies, to measure commit bc3f8c3, where one-rank meshes got no FSDP. That change failed on CUDA (fused AdamW
# refuses a mix of DTensor and plain parameters: gallery/results/two-gpu-call10-logs.txt) and was reverted.
set -u
ROOT=$(pwd); export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; L=/tmp/logs; mkdir -p $L $OUT
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
report() { local rc=$1; echo "[$(el)s] $2: rc=$rc"; }
cp -r gallery /tmp/gal; rm -f /tmp/gal/results/*.json
gal() {
  timeout $2 python3 -m moelab gallery run $1 --steps 8 --warmup 3 --dir /tmp/gal --out /tmp/runs/$1 > $L/gallery-$1.log 2>&1
  report $? "gallery $1"; cp /tmp/gal/results/$1--moelab.json $OUT/ 2>/dev/null
  { echo "== $1"; grep -v '^ \|^{\|^}' $L/gallery-$1.log | tail -c 2000; } >> $OUT/logs.txt
}
LAYOUTS="ep2 pp2" timeout 100 bash gallery/scripts/check_two_gpu.sh /tmp/c3 tiny 10 > $L/check.log 2>&1
report $? check_two_gpu; tail -4 $L/check.log
cp /tmp/c3/check_two_gpu.json $OUT/check-two-gpu-ep2-pp2-tiny.json 2>/dev/null
gal qwen3-moe-30b-a3b-proxy-ep2 80
gal qwen3-moe-30b-a3b-proxy-pp2 90
grep -h "tokens_per_s_per_gpu\"" $OUT/*--moelab.json
