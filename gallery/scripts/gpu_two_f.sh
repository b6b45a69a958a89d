#!/usr/bin/env bash
# Profiles of the two-GPU layouts (issue 10's throughput gap): one EP=2 step and one CP=2 step of the Qwen3 proxy
# under torch.profiler (gallery/scripts/profile_layout.py), rank 0's kernels written to $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd) NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
P=(--set backend.fake_balanced_gate=true --set data.kind=random --set train.dtype=bfloat16 --set train.param_dtype=bfloat16)
prof() {
  local name=$1; shift
  timeout 100 python3 -m torch.distributed.run --standalone --nproc-per-node 2 gallery/scripts/profile_layout.py \
    $OUT/qwen3-moe-30b-a3b-proxy--moelab--profile-$name.txt qwen3-moe-30b-a3b-proxy "${P[@]}" "$@" > /tmp/$name.log 2>&1
  echo "== $name rc=$?"; grep -v "Warning\|warn" /tmp/$name.log | tail -c 2500
}
prof ep2-eager --set parallel.ep=2 --set train.global_batch_size=4
prof cp2-seq8192-eager --set parallel.cp=2 --set train.seq_len=8192
