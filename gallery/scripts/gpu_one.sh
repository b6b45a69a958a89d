#!/usr/bin/env bash
# The one-GPU device call (nvidia-h200): builds the backends in the background, times the peers, moelab's CLI
# bench and fast-path variants, checks the experts backends; everything lands in $OUT (results.tar.gz with one
# JSON per system/variant, logs.tar.gz, and the built wheels for the two-GPU call).
#   MOELAB_COMMIT=<commit> OUT=<dir> bash gallery/scripts/gpu_one.sh
set -u
ROOT=$(pwd); export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT
R=/tmp/results; L=/tmp/logs; W=/tmp/wheels; mkdir -p $R $L $W
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
finish() {
  (cd /tmp && tar czf $OUT/results.tar.gz results && tar czf $OUT/logs.tar.gz logs)
  cp $W/*.whl $OUT/ 2>/dev/null; ls -la $OUT
}
trap finish EXIT
{ nvidia-smi; nvidia-smi topo -m; nvcc --version | tail -2; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > $L/machine.txt 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >> $L/machine.txt
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > $L/pip.log 2>&1
( MAX_JOBS=8 nice -n 10 bash gallery/scripts/build_backends.sh .whl/sdist $W all > $L/build.log 2>&1; echo $? > $L/build.rc ) &

echo "[$(el)s] peers"
cd gallery/peers
timeout 120 python3 hf_transformers.py --experts grouped_mm --json $R/hf-transformers-grouped_mm.json > $L/hf-grouped_mm.log 2>&1; tail -1 $L/hf-grouped_mm.log
PYTHONPATH=/tmp/site:$ROOT timeout 120 python3 torchtitan_qwen3.py --json $R/torchtitan.json > $L/torchtitan.log 2>&1; tail -1 $L/torchtitan.log
timeout 100 python3 hf_transformers.py --experts eager --steps 3 --warmup 1 --json $R/hf-transformers-eager.json > $L/hf-eager.log 2>&1; tail -1 $L/hf-eager.log
cd $ROOT

echo "[$(el)s] moelab bench (CLI, fp32 parameters + autocast)"
timeout 150 python3 -m moelab bench qwen3-moe-30b-a3b-proxy --steps 5 --warmup 2 --set train.param_dtype=float32 \
  --set backend.fake_balanced_gate=true --json $R/moelab-cli-fp32-params.json > $L/cli-fp32.log 2>&1; tail -4 $L/cli-fp32.log

# grouped_gemm is usually built by now; install it for the variants if so
for i in $(seq 1 30); do grep -q "grouped_gemm: built\|grouped_gemm: BUILD FAILED" $L/build.log 2>/dev/null && break; sleep 5; done
ls $W/grouped_gemm*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps --no-index --target /tmp/gg $W/grouped_gemm*.whl > $L/pip-gg.log 2>&1
export PYTHONPATH=/tmp/gg:$ROOT
echo "[$(el)s] moelab variants"
timeout $(( 540 - $(el) - 60 )) python3 gallery/scripts/bench_variants.py --out $R --deadline-s $(( 540 - $(el) - 130 )) > $L/variants.log 2>&1; grep -v Traceback $L/variants.log | tail -12

echo "[$(el)s] experts backends check"
timeout 60 python3 gallery/scripts/check_backends_gpu.py --json $R/backends-experts.json > $L/backends.log 2>&1; tail -3 $L/backends.log
echo "[$(el)s] build status: $(cat $L/build.rc 2>/dev/null || echo running)"; grep "===" $L/build.log
