#!/usr/bin/env bash
# Second two-GPU call of the second session (issue 10, after the pipeline fix for torch 2.11): the equivalence
# check with PP=2 and CP=2, the PP=2 and CP=2 x EP=2 proxies, then EP=2 with torch.compile on the distributed
# path and its one-GPU counterpart, both timed in this call. Each record is copied to $OUT as it exists.
#   MOELAB_COMMIT=$(git rev-parse HEAD) bash gallery/scripts/gpu_two_e.sh      # on a machine with 2 GPUs
#   PARTS="check pp2" bash gallery/scripts/gpu_two_e.sh                          # some parts only (call 8)
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
PARTS=${PARTS:-check pp2 cp2ep2 compile}
part() { [[ " $PARTS " == *" $1 "* ]]; }
if part check; then
timeout 200 bash gallery/scripts/check_two_gpu.sh /tmp/c2 tiny 20 > $L/check.log 2>&1
report $? check_two_gpu; cat $L/check.log
cp /tmp/c2/check_two_gpu.json $OUT/check-two-gpu-equivalence-tiny.json 2>/dev/null
for f in /tmp/c2/*.log; do grep -q Traceback $f && { echo "== $f"; tail -c 2500 $f; } >> $OUT/logs.txt; done
fi
part pp2 && gal qwen3-moe-30b-a3b-proxy-pp2 100
part cp2ep2 && gal qwen3-moe-30b-a3b-proxy-cp2-ep2 100
if part compile; then
# EP=2 (the ep2 entry's config) and one GPU (the 1gpu entry's), both compiled
P=(qwen3-moe-30b-a3b-proxy --set backend.fake_balanced_gate=true --set data.kind=random --set train.dtype=bfloat16
   --set train.param_dtype=bfloat16 --set train.compile=true --steps 8 --warmup 3 --no-metrics-overhead)
timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m moelab bench "${P[@]}" \
  --set parallel.ep=2 --set train.global_batch_size=4 --json $OUT/ep2-compile.json > $L/ep2-compile.log 2>&1
report $? "ep2 compile"; { echo "== ep2 compile"; grep -v Warning $L/ep2-compile.log | tail -c 2500; } >> $OUT/logs.txt
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m moelab bench "${P[@]}" --json $OUT/1gpu-compile.json > $L/1gpu-compile.log 2>&1
report $? "1gpu compile"; { echo "== 1gpu compile"; tail -c 1500 $L/1gpu-compile.log; } >> $OUT/logs.txt
fi
grep -h "tokens/s/GPU\|real router" $L/*.log | head -20
