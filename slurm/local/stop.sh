#!/usr/bin/env bash
# slurm/local/stop.sh - stop exactly the daemons slurm/local/start.sh started, by the pid files it recorded in
# /run/moelab-slurm/started (never by process name). Jobs still queued are cancelled first, so that no job
# process outlives slurmd. Order: slurmd, slurmctld, slurmdbd, MariaDB, munged.
#   MOELAB_SLURM_KEEP_BASE=1  keep munged and MariaDB running (start.sh uses it to restart after a config change)
set -uo pipefail
RUN=/run/moelab-slurm
REG=$RUN/started
KEEP_BASE=${MOELAB_SLURM_KEEP_BASE:-0}
log() { echo "[slurm/local/stop] $*"; }

[ -s "$REG" ] || { log "nothing recorded in $REG: nothing to stop"; exit 0; }

pid_of() {  # pid_of NAME PIDFILE: prints the pid if it is a live (non-zombie) NAME process
  local pid
  [ -s "$2" ] || return 1
  pid=$( { tr -dc 0-9 < "$2"; } 2>/dev/null ); [ -n "$pid" ] || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ] || return 1
  [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ] || return 1
  echo "$pid"
}

stop_one() {  # stop_one NAME PIDFILE
  local name=$1 pf=$2 pid i
  if ! pid=$(pid_of "$name" "$pf"); then
    log "$name: not running"; rm -f "$pf"; return 0
  fi
  kill -TERM "$pid" 2>/dev/null
  for i in $(seq 1 150); do            # up to 30 s (MariaDB flushes on shutdown)
    # a stale /run/slurmctld.pid makes `apt-get purge slurmctld` fail, so pid files go too
    pid_of "$name" "$pf" >/dev/null || { log "$name (pid $pid) stopped"; rm -f "$pf"; return 0; }
    sleep 0.2
  done
  log "$name (pid $pid) ignored SIGTERM for 30 s: SIGKILL"
  kill -KILL "$pid" 2>/dev/null; sleep 0.5; rm -f "$pf"
}

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
