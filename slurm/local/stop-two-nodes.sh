#!/usr/bin/env bash
# slurm/local/stop-two-nodes.sh - stop exactly the daemons slurm/local/start-two-nodes.sh started (by the pid
# files recorded in /run/moelab-slurm-2n/started, never by name), after cancelling the jobs still queued there
# and killing what still runs in the nodes' namespaces; then remove the namespaces and the bridge.
# The single-node cluster of start.sh and the daemons it shares (munged, MariaDB, slurmdbd) are left running.
#   --keep-network  keep the namespaces and the bridge (start-two-nodes.sh uses it to restart after a config change)
set -uo pipefail
RUN=/run/moelab-slurm-2n
REG=$RUN/started
export SLURM_CONF=/etc/slurm-2n/slurm.conf
log() { echo "[slurm/local/stop-two-nodes] $*"; }

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
  if ! pid=$(pid_of "$name" "$pf"); then log "$name ($pf): not running"; rm -f "$pf"; return 0; fi
  kill -TERM "$pid" 2>/dev/null
  for i in $(seq 1 150); do
    pid_of "$name" "$pf" >/dev/null || { log "$name (pid $pid) stopped"; rm -f "$pf"; return 0; }
    sleep 0.2
  done
  log "$name (pid $pid) ignored SIGTERM for 30 s: SIGKILL"
  kill -KILL "$pid" 2>/dev/null; sleep 0.5; rm -f "$pf"
}

if [ -s "$REG" ]; then
  if pid_of slurmctld "$RUN/slurmctld.pid" >/dev/null; then
    jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
      log "cancelling jobs still queued: $jobs"
      scancel --full $jobs 2>/dev/null || true
      for i in $(seq 1 50); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
    fi
  fi
  # slurmds first, then the controller
  awk '$1 == "slurmd" {print $2}' "$REG" | while read -r pf; do stop_one slurmd "$pf"; done
  awk '$1 == "slurmctld" {print $2}' "$REG" | while read -r pf; do stop_one slurmctld "$pf"; done
  : > "$REG"
else
  log "nothing recorded in $REG: no daemon to stop"
fi
[ "${1:-}" = --keep-network ] && exit 0
for node in moelab-n1 moelab-n2; do
  ip netns list 2>/dev/null | grep -qw "$node" || continue
  pids=$(ip netns pids "$node" 2>/dev/null | tr '\n' ' ')
  [ -n "${pids// /}" ] && { log "$node: killing what still runs there: $pids"; kill -KILL $pids 2>/dev/null; sleep 0.5; }
  ip netns del "$node" && log "network namespace $node removed"
done
ip link show mlb2n0 >/dev/null 2>&1 && ip link del mlb2n0 && log "bridge mlb2n0 removed"
exit 0
