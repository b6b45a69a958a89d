#!/usr/bin/env bash
# Issue 17, the FINAL call on one H200 (about 8 minutes): peers and moelab in the same run, same shapes (Qwen3-30B-A3B
# proxy, seq 4096, micro batch 2, learned router, bf16 parameters, fused AdamW), same harness and FLOPs convention.
# Carry .whl (gallery/scripts/carry_wheels.sh downloads it). Parts run in priority order, each behind `timeout`;
# a part that no longer fits in the call's budget (BUDGET_S, default 500 s) is skipped and says so.
#   PARITY_MODES=off,rowwise  FP8_GBS=16,2  BF16_GBS=2,16  LOSS_GBS=2,16  PROFILE_GBS=2 (moelab's profiled batches)
#   FP8_PROFILE_GBS=16 (profile the FP8 step too)  TRITON_GBS=2 (also time the other AdamW kernel at these batches)
#   PARTS="tt-compile tt-blocks moelab moelab-loss parity moelab-fp8"   (default: all, in this order)
#     check       the router's bf16 logits and the chunked loss against their references, timed (gpu_check_router_loss.py)
#     rows        the combine's and dispatch's sums over K, before / now, compiled, checked and timed (gpu_check_rows.py)
#     tt-compile  torchtitan compiled by its trainer's apply_compile + compiled loss, global batch 2 and 16
#     tt-blocks   torchtitan with each whole block torch.compile'd + compiled loss (the faster mode), 2 and 16;
#                 CLIP=1.0: then clipping by its trainer's clip_grad_norm_ at max_norm CLIP (moelab part: the same
#                 step at train.grad_clip=CLIP, the multiply in TritonAdamW's update, tags bf16-clip, bf16-clip-pass)
#     moelab      moelab bf16 compiled, 2 and 16, the profile of the compiled step, TritonAdamW at TRITON_GBS;
#                 OVERLAP_OFF=1: the same model then with the compiled full loss instead of its in-place kernel
#                 (tag bf16-loss-compiled) and without train.optimizer_overlap (tag bf16-no-overlap); TRIAL=best
#                 also times it with the loss and AdamW checks' fastest kernel settings (tag bf16-trial); PAGEABLE=1
#                 with the micro batches copied from pageable memory, as before to_device (tag bf16-pageable)
#     overlap-check  issue 41: the optimizer overlapped with the next forward trains bitwise as without it, and a
#                 run without the forward's waits differs (gpu_check_overlap.py); not run by default
#     parity      bf16 vs train.fp8=rowwise, PARITY_STEPS (300) steps of the small learnable workload
#     moelab-fp8  moelab train.fp8=rowwise compiled at FP8_GBS (default 16,2: 16 first, 2 if the budget allows)
#     moelab-loss the LM-head losses side by side (LOSSES, default chunked,full,liger,cce: backend.loss; liger and
#                 cce from the carried wheels) at micro batch 2 and 4 (LOSS_MBS) and global batch 2 and 16,
#                 compiled, train.optimizer=auto, learned router, peak memory in each record
#     moelab-experts  moelab bf16 compiled with backend.experts=$EXPERTS (default sonic), 2 and 16, its profile at
#                 PROFILE_GBS; not run by default. SONIC_TAR (gallery/scripts/sonic_site.sh's tarball, unpacked to
#                 SONIC_SITE) installs SonicMoE, which `auto` then takes (moelab.backends.auto_experts)
#     moelab-attention  moelab bf16 compiled with backend.attention=$ATTENTION (default sdpa: torch's SDPA, the
#                 path `auto` took before FlashAttention-4), 2 and 16; not run by default. FA4 comes from .whl's
#                 flash-attn-4 wheel with SONIC_TAR's QuACK / CUTLASS DSL; the moelab part's `auto` takes it
#     moelab-add  moelab bf16 compiled with SonicMoE's weight-gradient GEMMs adding into .grad by MOELAB_SONIC_ADD=
#                 $SONIC_ADD (default load: .grad read as the GEMMs' C operand; squares: only on the last micro
#                 batch, with the norm's squares), 2 and 16, its profile at PROFILE_GBS; not run by default
#     wgrad       issue 41: SonicMoE's weight-gradient GEMMs writing, adding by QuACK's reduce store, adding with .grad
#                 read as C (and its squares), at one and two micro batches' rows, checked and timed
#                 (gpu_wgrad.py, SONIC_TAR); not run by default
#     moe-layer   issue 41: one MoE layer's experts forward + backward, today's compiled path vs backend.experts=
#                 triton_fused vs SonicMoE (SONIC_SITE: gallery/scripts/sonic_site.sh), checked against fp32,
#                 time, TFLOP/s, saved bytes (gpu_moe_layer.py, about 90 s); not run by default (PARTS=moe-layer)
#     squares-check  issue 41: the experts' gradient squares summed by SonicMoE's GEMMs (gpu_check_sonic_squares.py,
#                 SONIC_TAR): gradients bitwise as without, the sums against float64; not run by default
#     loss-check  issue 41: backend.loss=full's in-place kernel against the compiled loss at the proxy's LM head
#                 (gpu_check_loss_kernel.py): loss and gradients, the kernel's blocks swept, head + loss timed and
#                 their peak memory; not run by default
#     adamw-check issue 41: TritonAdamW's kernel over the proxy's parameters, its block and warps swept, bitwise
#                 against the default (gpu_check_adamw.py); not run by default
#     copy-check  issue 41: a micro batch's copy behind a queued kernel, to_device (pinned) against the pageable
#                 copies: the host's wait and the values (gpu_check_copy.py); not run by default
#     clip-check  issue 41: clipping's multiply in TritonAdamW's update against the multiply pass, bitwise on the
#                 GPU, and both timed on one expert weight (gpu_check_clip.py); not run by default
#     host-check  issue 41: the host's time to queue a micro batch's forward and backward behind a busy GPU against
#                 the GPU's time for them, SonicMoE's share of it, both under cProfile, and the timed step's phases
#                 in both clocks, the update pending and after a synchronisation (gpu_check_host.py, about 110 s
#                 alone; after the moelab part its compiles are cached); not run by default
#     attention   issue 41: the proxy's attention forward + backward, SDPA as moelab calls it (cuDNN) against
#                 FlashAttention-4 (flash-attn-4 wheel in .whl, SONIC_TAR for its QuACK / CUTLASS DSL) called directly
#                 and through moelab.backends.fa4's custom ops, eager and compiled, checked against fp32
#                 (gpu_attention.py; its `ok`: moelab's FA4 within SDPA's error); not run by default (PARTS=attention)
#     blockwise   issue 31's blockwise FP8 trial at the experts' GEMMs (gpu_fp8_blockwise.py, about 60 s): bf16,
#                 rowwise and 1x128/128x128 blockwise (torch's grouped op, cuBLAS dense, a Triton grouped kernel),
#                 the quantisation passes and a per-layer projection; not run by default (PARTS=blockwise)
#   Optional parts (measured in the first call, not run by default): fp8-check tt-fp8 tt-eager hf
#   MOELAB_COMMIT=<sha>   the commit the results belong to (the device copy has no git)
#   DRY_RUN=1             CPU only: the moelab parts on the tiny preset, peers skipped (checks the script)
# Device call: command "MOELAB_COMMIT=<sha> bash gallery/scripts/gpu_perf.sh", carry [".whl"] (the wheels from
# carry_wheels.sh, about 5 MB), one nvidia-h200, timeout 600.
# Results: $OUT/results.tar.gz (one JSON per system, variant and global batch; profile and parity JSONs) and
# $OUT/logs.tar.gz; the short table is printed last.
set -u
ROOT=$(pwd)
OUT=${OUT:-/tmp/gpu_perf_out}; mkdir -p "$OUT"
R=/tmp/perf-results; L=/tmp/perf-logs; rm -rf $R $L; mkdir -p $R $L
BUDGET_S=${BUDGET_S:-500}
PARTS=${PARTS:-"tt-compile tt-blocks moelab moelab-loss parity moelab-fp8"}
PARITY_MODES=${PARITY_MODES:-off,rowwise}
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
trap '(cd /tmp && tar czf $OUT/results.tar.gz perf-results && tar czf $OUT/logs.tar.gz perf-logs)' EXIT
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && [ -z "${DRY_RUN:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > $L/pip.log 2>&1 || echo "pip install of .whl failed (see logs/pip.log)"
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$ROOT:/tmp/site:$ROOT/gallery/peers
if [ -n "${SONIC_TAR:-}" ]; then  # SonicMoE's unpacked wheels, found by moelab and by QuACK's compile workers
  { [ -d /tmp/sonic/site ] || { mkdir -p /tmp/sonic && tar xJf "$SONIC_TAR" -C /tmp/sonic; }; } \
    && export SONIC_SITE=/tmp/sonic/site \
    PYTHONPATH=$PYTHONPATH:/tmp/sonic/site:/tmp/sonic/site/nvidia_cutlass_dsl/python_packages
fi
export MOELAB_COMMIT=${MOELAB_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > $L/machine.txt 2>&1
python3 -c "import torch; print('torch', torch.__version__)" >> $L/machine.txt 2>&1
python3 -c "import torchao; print('torchao', torchao.__version__)" >> $L/machine.txt 2>&1
python3 -c "import torchtitan; print('torchtitan ok')" >> $L/machine.txt 2>&1
cat $L/machine.txt
PEER="--seq 4096 --micro-batch 2 --steps 5 --warmup 3"
DRY=${DRY_RUN:+--dry-run}

# part NAME TIMEOUT_S COMMAND...: runs COMMAND under timeout if it still fits the budget; log in $L/NAME.log
part() {
  local name=$1 t=$2; shift 2
  case " $PARTS " in *" $name "*) ;; *) return ;; esac
  local left=$(( BUDGET_S - $(el) ))
  if [ $left -lt 40 ]; then echo "[$(el)s] $name: SKIPPED (budget: ${left}s left)"; return; fi
  [ $t -gt $left ] && t=$left
  echo "[$(el)s] $name (timeout ${t}s)"
  timeout -k 5 $t "$@" > $L/$name.log 2>&1
  local rc=$?
  [ $rc -ne 0 ] && echo "[$(el)s] $name: exit $rc" && grep -v "warn" $L/$name.log | tail -6
  grep -h "tokens/s\|tok/s\|^median: \|^first losses\|^loss kernel\|^moe-layer\|^parity\|^fp8 \|^adamw\|^weight cache\|^rows \|ERROR\|Error" $L/$name.log | grep -v "^ *warnings" | tail -8
}

if [ -z "${DRY_RUN:-}" ]; then
  part tt-compile 90 python3 gallery/peers/torchtitan_qwen3.py $PEER --compile --compile-mode trainer \
    --global-batch 2,16 --json $R/torchtitan-compile-trainer-gbs{gbs}.json
  part tt-blocks $([ -n "${CLIP:-}" ] && echo 170 || echo 90) python3 gallery/peers/torchtitan_qwen3.py $PEER --compile --compile-mode blocks \
    --global-batch 2,16 --json $R/torchtitan-compile-blocks-gbs{gbs}.json ${CLIP:+--max-norm $CLIP}
fi
part check 90 python3 gallery/scripts/gpu_check_router_loss.py --out $R ${DRY_RUN:+--small}
part rows 60 python3 gallery/scripts/gpu_check_rows.py --out $R ${DRY_RUN:+--small}
TRITON=${TRITON_GBS:+--triton-adamw --triton-gbs $TRITON_GBS}
part overlap-check 150 python3 gallery/scripts/gpu_check_overlap.py --out $R
part squares-check 200 python3 gallery/scripts/gpu_check_sonic_squares.py --out $R
part loss-check 150 python3 gallery/scripts/gpu_check_loss_kernel.py --out $R
part adamw-check 90 python3 gallery/scripts/gpu_check_adamw.py --out $R
part copy-check 60 python3 gallery/scripts/gpu_check_copy.py --out $R
part clip-check 90 python3 gallery/scripts/gpu_check_clip.py --out $R
part wgrad 200 python3 gallery/scripts/gpu_wgrad.py --out $R
# TRIAL=best (with OVERLAP_OFF=1): the moelab part also times the step (tag bf16-trial) with the loss and AdamW
# checks' fastest settings, where a check passed and its fastest is not the default
# fastest FILE TABLE DEFAULT_KEY: the check's fastest setting where it passed and differs from its default
fastest() {
  python3 -c "import json; r = json.load(open('$R/$1')); t = r['$2']; \
b = min(t, key=lambda k: t[k] if isinstance(t[k], float) else t[k]['ms']); print(b if r['ok'] and b != r['$3'] else '')" \
    2>/dev/null || true
}
if [ "${TRIAL:-}" = best ]; then
  LOSS_TRIAL=$(fastest loss-kernel-check.json ms_loss_kernel_by_config default_config)
  ADAMW_TRIAL=$(fastest adamw-check.json by_block_and_warps default_block_and_warps)
  echo "[$(el)s] trial: loss kernel ${LOSS_TRIAL:-default}, adamw ${ADAMW_TRIAL:-default}"
fi
part moelab 360 python3 gallery/scripts/gpu_perf.py bench --out $R --fp8 off --gbs ${BF16_GBS:-2,16} --profile \
  --profile-gbs ${PROFILE_GBS:-2} --loss-steps ${LOSS_STEPS:-3} $TRITON ${OVERLAP_OFF:+--overlap-off} \
  ${LOSS_TRIAL:+--loss-kernel-trial $LOSS_TRIAL} ${ADAMW_TRIAL:+--adamw-trial $ADAMW_TRIAL} \
  ${PAGEABLE:+--pageable-trial} ${CLIP:+--clip $CLIP} $DRY
part host-check 240 python3 gallery/scripts/gpu_check_host.py --out $R
# the same model and seed with another experts backend (EXPERTS; sonic's first step: ~75 s of CuTe-DSL compiles)
part moelab-experts 260 python3 gallery/scripts/gpu_perf.py bench --out $R --fp8 off --gbs ${BF16_GBS:-2,16} \
  --profile --profile-gbs ${PROFILE_GBS:-2} --loss-steps ${LOSS_STEPS:-3} --set backend.experts=${EXPERTS:-sonic} \
  --tag bf16-${EXPERTS:-sonic} $DRY
# the same model and seed with another attention backend (ATTENTION; default sdpa, the path before `auto` took FA4)
part moelab-attention 260 python3 gallery/scripts/gpu_perf.py bench --out $R --fp8 off --gbs ${BF16_GBS:-2,16} \
  --loss-steps ${LOSS_STEPS:-3} --set backend.attention=${ATTENTION:-sdpa} --tag bf16-${ATTENTION:-sdpa} $DRY
# the same model and seed with the weight-gradient GEMMs' other add into .grad (SONIC_ADD, default load)
part moelab-add 300 env MOELAB_SONIC_ADD=${SONIC_ADD:-load} python3 gallery/scripts/gpu_perf.py bench --out $R \
  --fp8 off --gbs ${BF16_GBS:-2,16} --profile --profile-gbs ${PROFILE_GBS:-2} --loss-steps ${LOSS_STEPS:-3} \
  --tag bf16-add-${SONIC_ADD:-load} $DRY
part moe-layer 400 python3 gallery/scripts/gpu_moe_layer.py --out $R ${MOE_LAYER_ARGS:-}
part attention 240 python3 gallery/scripts/gpu_attention.py --out $R
part moelab-loss 240 python3 gallery/scripts/gpu_perf.py bench --out $R --fp8 off --gbs ${LOSS_GBS:-2,16} \
  --losses ${LOSSES:-chunked,full,liger,cce} --mbs ${LOSS_MBS:-2,4} --steps 4 --warmup 2 $DRY
# parity: one process per mode, side by side on the GPU (the small model leaves it mostly idle; the curves do not
# depend on it), each under its own timeout so that neither outlives the part
PAR="timeout -k 5 85 python3 gallery/scripts/gpu_perf.py parity --out $R --steps ${PARITY_STEPS:-300} $DRY --fp8"
part parity 95 bash -c "for m in ${PARITY_MODES//,/ }; do $PAR \$m > $L/parity-\$m.log 2>&1 & done; wait; \
  cat $L/parity-*.log"
# FP8 at global batch 16 first (its record is written before 2 starts, so a timeout keeps it)
part moelab-fp8 200 python3 gallery/scripts/gpu_perf.py bench --out $R --fp8 rowwise --gbs ${FP8_GBS:-16,2} \
  ${FP8_PROFILE_GBS:+--profile --profile-gbs $FP8_PROFILE_GBS} $DRY
part fp8-check 150 python3 gallery/scripts/gpu_perf_fp8check.py --out $R ${DRY_RUN:+--small}
# the dry run checks its Triton kernel under the interpreter
part blockwise 90 env ${DRY_RUN:+TRITON_INTERPRET=1} python3 gallery/scripts/gpu_fp8_blockwise.py --out $R \
  ${DRY_RUN:+--small}
if [ -z "${DRY_RUN:-}" ]; then
  part tt-fp8 130 python3 gallery/peers/torchtitan_qwen3.py $PEER --compile --fp8 rowwise \
    --global-batch 2,16 --json $R/torchtitan-compile-fp8-gbs{gbs}.json
  part tt-eager 60 python3 gallery/peers/torchtitan_qwen3.py $PEER --global-batch 2 \
    --json $R/torchtitan-eager-gbs{gbs}.json
  part hf 70 python3 gallery/peers/hf_transformers.py $PEER --experts grouped_mm --global-batch 2 \
    --json $R/hf-transformers-grouped_mm-gbs{gbs}.json
fi
grep -h "^profile\|^  \|^first losses" $L/moelab.log $L/moelab-experts.log $L/moelab-fp8.log 2>/dev/null | head -90
echo "[$(el)s] done"
python3 gallery/scripts/gpu_perf.py table $R
