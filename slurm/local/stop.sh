#!/usr/bin/env bash
# slurm/local/stop.sh - stop exactly the daemons slurm/local/start.sh started, by the pid files it recorded in
# /run/moelab-slurm/started (never by process name). Jobs still queued are cancelled first, so that no job
# process outlives slurmd. Order: slurmd, slurmctld, slurmdbd, MariaDB, munged.
#   MOELAB_SLURM_KEEP_BASE=1  keep munged and MariaDB running (start.sh uses it to restart after a config change)
set -uo pipefail
RUN=/run/moelab-slurm
REG=$RUN/started
KEEP_BASE=${MOELAB_SLURM_KEEP_BASE:-0}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
T0=$(date +%s%N)
# shellcheck source=slurm/local/lib.sh
source "$HERE/lib.sh"
LOG_TAG=slurm/local/stop

[ -s "$REG" ] || { log "nothing recorded in $REG: nothing to stop"; exit 0; }


if grep -q '^slurmctld ' "$REG" && pid_of slurmctld /run/slurmctld.pid >/dev/null; then
  jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    log "cancelling jobs still queued: $jobs"
    scancel --full $jobs 2>/dev/null || true
    for i in $(seq 1 50); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
  fi
fi

keep=()
for name in slurmd slurmctld slurmdbd mariadbd munged; do
  pf=$(awk -v n="$name" '$1 == n {print $2}' "$REG" | tail -n 1)
  [ -n "$pf" ] || continue
  if [ "$KEEP_BASE" = 1 ] && { [ "$name" = munged ] || [ "$name" = mariadbd ]; }; then
    keep+=("$name $pf"); continue
  fi
  stop_one "$name" "$pf"
done
if [ ${#keep[@]} -gt 0 ]; then printf '%s\n' "${keep[@]}" > "$REG"; else : > "$REG"; fi
