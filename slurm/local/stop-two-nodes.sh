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
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
T0=$(date +%s%N)
# shellcheck source=slurm/local/lib.sh
source "$HERE/lib.sh"
LOG_TAG=slurm/local/stop-two-nodes


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
