#!/usr/bin/env bash
# The one GPU-run driver: runs the parts it is given, in order, on the GPUs of this machine, and leaves every
# record in $OUT (JSON results at the top, logs and profiles under $OUT/logs). The run history (which call ran
# which parts, and what came of it) is the table in gallery/perf-notes.md.
#   PARTS="check gallery:qwen3-moe-30b-a3b-proxy-ep2" bash gallery/scripts/gpu_run.sh
#   PARTS="peers variants" GPU=1 STEPS=6 WARMUP=2 bash gallery/scripts/gpu_run.sh
# Parts:
#   machine              nvidia-smi, topology, versions
#   peers | peers:gbs16  HF transformers and torchtitan on the Qwen3 layer proxy (global batch 2, or 16)
#   cli-bench            `moelab bench` of the proxy with fp32 parameters (autocast)
#   variants             the fast-path variants with profiles (bench_variants.py; SKIP= names to leave out)
#   build                the optional backends built from .whl/sdist (build_backends.sh), then checked
#   check | check:L1,L2  the two-GPU equivalence check of tiny against one GPU (check_two_gpu.sh; LAYOUTS)
#   gallery:ENTRY        `moelab gallery run ENTRY` (STEPS, WARMUP; GALLERY_TIMEOUT s, default 300: the 1-GPU
#                        proxies compile). The four families' 1-GPU proxies, compiled, learned router:
#                        PARTS="gallery:qwen3-moe-30b-a3b-proxy-1gpu gallery:deepseek-v3-proxy-1gpu
#                        gallery:kimi-k2-proxy-1gpu gallery:gpt-oss-20b-proxy-1gpu gallery:gpt-oss-120b-proxy-1gpu"
#   router-sweep[:GBS]   the Qwen3 proxy, compiled, learned router against fake_gate_noise 0, 0.1, 0.5, 1.0 on one
#                        model (router_sweep.py; GBS comma-separated, default 2; ROUTER_DEADLINE s, default 480)
#   tiny:pp | tiny:cp    `moelab run tiny --nproc 2` with parallel.pp=2 or parallel.cp=2 on CUDA
#   compile-ep2          EP=2 and one GPU, both compiled (`moelab bench`), the proxy at global batch 4
#   profile:ep2 | profile:cp2   one step of the proxy on two GPUs under torch.profiler (profile_layout.py)
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 etc.). MOELAB_COMMIT names the commit in the records.
set -u
ROOT=$(pwd); OUT=${OUT:-/tmp/out}; L=$OUT/logs; mkdir -p $L
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -n "${GPU:-}" ] && export CUDA_VISIBLE_DEVICES=$GPU
STEPS=${STEPS:-8}; WARMUP=${WARMUP:-3}; PARTS=${PARTS:-machine}
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
report() { echo "[$(el)s] $2: rc=$1"; }
PROXY=(qwen3-moe-30b-a3b-proxy --set data.kind=random --set train.dtype=bfloat16 --set train.param_dtype=bfloat16)
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  .whl/*.whl > $L/pip.log 2>&1
[ -d /tmp/gal ] || { cp -r gallery /tmp/gal; rm -f /tmp/gal/results/*.json; }

for part in $PARTS; do
  name=${part%%:*}; arg=${part#*:}; [ "$arg" = "$part" ] && arg=
  case $name in
  machine) { nvidia-smi; nvidia-smi topo -m; python3 -c "import torch; print(torch.__version__)"; } > $L/machine.txt 2>&1
           report $? machine ;;
  peers) gbs=${arg#gbs}; gbs=${gbs:-2}
         (cd gallery/peers
          timeout 120 python3 hf_transformers.py --experts grouped_mm --global-batch $gbs --steps 3 --warmup 1 \
            --json $OUT/hf-transformers-grouped_mm-gbs$gbs.json > $L/hf-gbs$gbs.log 2>&1; report $? "hf gbs$gbs"
          PYTHONPATH=/tmp/site:$ROOT timeout 120 python3 torchtitan_qwen3.py --global-batch $gbs --steps 3 --warmup 1 \
            --json $OUT/torchtitan-gbs$gbs.json > $L/torchtitan-gbs$gbs.log 2>&1; report $? "torchtitan gbs$gbs") ;;
  cli-bench) timeout 150 python3 -m moelab bench qwen3-moe-30b-a3b-proxy --steps 5 --warmup 2 \
               --set train.param_dtype=float32 --set backend.fake_balanced_gate=true --no-metrics-overhead \
               --json $OUT/moelab-cli-fp32-params.json > $L/cli-fp32.log 2>&1; report $? cli-bench ;;
  variants) timeout 330 python3 gallery/scripts/bench_variants.py --out $OUT --profile --deadline-s 290 \
              ${SKIP:+--skip $SKIP} > $L/variants.log 2>&1; report $? variants; mv $OUT/profile-*.txt $L/ 2>/dev/null ;;
  build) MAX_JOBS=8 nice -n 10 bash gallery/scripts/build_backends.sh .whl/sdist /tmp/wheels all > $L/build.log 2>&1
         report $? build; cp /tmp/wheels/*.whl $OUT/ 2>/dev/null
         timeout 60 python3 gallery/scripts/check_backends_gpu.py --json $OUT/backends-experts.json > $L/backends.log 2>&1
         report $? backends-check ;;
  check) LAYOUTS=${arg//,/ } timeout 330 bash gallery/scripts/check_two_gpu.sh /tmp/c2 tiny 20 > $L/check.log 2>&1
         report $? check_two_gpu; tail -4 $L/check.log
         cp /tmp/c2/check_two_gpu.json $OUT/check-two-gpu-${arg:+${arg//,/-}-}tiny.json 2>/dev/null
         for f in /tmp/c2/*.log; do grep -q Traceback $f && cp $f $L/; done ;;
  gallery) timeout ${GALLERY_TIMEOUT:-300} python3 -m moelab gallery run $arg --steps $STEPS --warmup $WARMUP --dir /tmp/gal \
             --out /tmp/runs/$arg > $L/gallery-$arg.log 2>&1; report $? "gallery $arg"
           cp /tmp/gal/results/$arg--moelab.json $OUT/ 2>/dev/null; cp /tmp/runs/$arg/logs/* $L/ 2>/dev/null ;;
  router-sweep) D=${ROUTER_DEADLINE:-480}
                timeout $((D + 80)) python3 gallery/scripts/router_sweep.py --out $OUT --gbs ${arg:-2} --steps $STEPS \
                  --warmup $WARMUP --deadline-s $D > $L/router-sweep.log 2>&1; report $? router-sweep ;;
  tiny) timeout 120 python3 -m moelab run tiny --steps 20 --nproc 2 --set parallel.$arg=2 --set train.device=cuda \
          --out /tmp/runs/tiny-$arg-2 > $L/tiny-$arg-2.log 2>&1; report $? "tiny $arg=2"
        cp /tmp/runs/tiny-$arg-2/summary.json $OUT/tiny-$arg-2-summary.json 2>/dev/null ;;
  compile-ep2) P=("${PROXY[@]}" --set train.compile=true --steps $STEPS --warmup $WARMUP --no-metrics-overhead)
               timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m moelab bench "${P[@]}" \
                 --set parallel.ep=2 --set train.global_batch_size=4 --json $OUT/ep2-compile.json > $L/ep2-compile.log 2>&1
               report $? "ep2 compile"
               CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} timeout 120 python3 -m moelab bench "${P[@]}" \
                 --json $OUT/1gpu-compile.json > $L/1gpu-compile.log 2>&1; report $? "1gpu compile" ;;
  profile) case $arg in ep2) set_=(--set parallel.ep=2 --set train.global_batch_size=4) ;;
                        cp2) set_=(--set parallel.cp=2 --set train.seq_len=8192) ;; esac
           timeout 100 python3 -m torch.distributed.run --standalone --nproc-per-node 2 gallery/scripts/profile_layout.py \
             $L/qwen3-moe-30b-a3b-proxy--moelab--profile-$arg-eager.txt "${PROXY[@]}" "${set_[@]}" > $L/profile-$arg.log 2>&1
           report $? "profile $arg" ;;
  *) echo "gpu_run.sh: unknown part '$part' (see the list at the top of this script)"; exit 2 ;;
  esac
done
echo "[$(el)s] done; records in $OUT, logs in $L"
