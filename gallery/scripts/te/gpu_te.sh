#!/usr/bin/env bash
# Transformer Engine on the GPU machine, in consecutive device calls from the repo root (README: "Transformer
# Engine"). Each call carries one chunk made by prepare.sh (DIR, default .te) and runs
#     bash gallery/scripts/te/gpu_te.sh park       # parks the chunk; once all are there, installs TE in the
#                                                  # background (a new process session outlives the call)
# and a last call runs
#     bash gallery/scripts/te/gpu_te.sh measure    # waits for the install, then check_te_gpu.py; results in $OUT
# The calls must follow each other within the machine's warm period (30 s), or the parked chunks are lost.
set -u
MODE=${1:?usage: gpu_te.sh park|measure [DIR]}; DIR=${2:-.te}; ROOT=$(pwd); LOG=/tmp/te-install.log
export PYTHONUNBUFFERED=1
if [ "$MODE" = park ]; then
  bash gallery/scripts/te/install_on_gpu.sh "$DIR" --park-only
  N=$(awk '$1=="chunks"{print $2}' "$DIR/manifest"); have=$(ls /tmp/te/part* 2>/dev/null | wc -l)
  if [ "$have" -ge "$N" ] && [ ! -f /tmp/te-install.started ]; then
    touch /tmp/te-install.started; cp -r "$DIR" /tmp/te-dir   # the carried folder is replaced by the next call
    setsid nohup bash gallery/scripts/te/install_on_gpu.sh /tmp/te-dir > $LOG 2>&1 < /dev/null &
    echo "TE: all $N chunks parked; installing in the background (log $LOG)"
  fi
  exit 0
fi
[ "$MODE" = measure ] || { echo "gpu_te.sh: unknown mode $MODE"; exit 2; }
for i in $(seq 1 60); do [ -f /tmp/tesite/.te-ok ] && break; grep -q "^exit" $LOG 2>/dev/null && break; sleep 5; done
cat $LOG; cp /tmp/te/built/*.whl "$OUT/" 2>/dev/null
[ -f /tmp/tesite/.te-ok ] || { echo "TE did not install"; exit 4; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /tmp/pip-site.log 2>&1
fi
export PYTHONPATH=/tmp/tesite:/tmp/site:$ROOT MOELAB_COMMIT=${MOELAB_COMMIT:-unknown}
mkdir -p /tmp/te-results
timeout ${TE_TIMEOUT:-420} python3 gallery/scripts/te/check_te_gpu.py --out /tmp/te-results \
  --deadline-s ${TE_DEADLINE:-330} ${TE_ARGS:-} 2>&1 | grep -v "UserWarning\|warnings.warn" | tee /tmp/te-results/log.txt | tail -60
rc=${PIPESTATUS[0]}
(cd /tmp && tar czf "$OUT/te-results.tar.gz" te-results)
exit $rc
