# slurm/local/lib.sh - helpers shared by the local cluster scripts (sourced; the callers set RUN, WAIT_S, T0,
# LOG_TAG and LOG_FILES where they use them).

log() { local ms=$(( ($(date +%s%N) - T0) / 1000000 )); printf '[%s %d.%01ds] %s\n' "$LOG_TAG" $((ms / 1000)) $((ms % 1000 / 100)) "$*"; }
die() {
  log "ERROR: $*"
  for f in "${LOG_FILES[@]}"; do
    [ -f "$f" ] && { echo "--- last lines of $f"; tail -n 15 "$f"; }
  done
  exit 1
}
# alive NAME PIDFILE: the pid file names a live process called NAME (a zombie counts as dead; the name check
# guards against a recycled pid)
alive() {
  local pid
  [ -s "$2" ] || return 1
  pid=$( { tr -dc 0-9 < "$2"; } 2>/dev/null ); [ -n "$pid" ] || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ] || return 1
  [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]
}
record() { grep -qx "$1 $2" "$RUN/started" || echo "$1 $2" >> "$RUN/started"; }
wait_for() {  # wait_for WHAT COMMAND...
  local what=$1; shift; local end=$(( $(date +%s) + WAIT_S ))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$end" ] || die "timed out after ${WAIT_S}s waiting for $what"
    sleep 0.2
  done
}
# wait_node_idle NODE: until sinfo shows NODE usable; a down or drained node is resumed once
wait_node_idle() {
  local node=$1 st end=$(( $(date +%s) + WAIT_S )) resumed=0
  while :; do
    st=$(sinfo -h -n "$node" -o %T 2>/dev/null || true)
    case "$st" in
      idle|mixed|allocated) return 0 ;;
      *down*|*drain*|*fail*)
        if [ "$resumed" = 0 ]; then
          log "node $node is '$st' ($(sinfo -h -n "$node" -o %E)): resuming it"
          scontrol update nodename="$node" state=resume || true; resumed=1
        fi ;;
    esac
    [ "$(date +%s)" -lt "$end" ] || die "node $node not idle after ${WAIT_S}s (state '$st')"
    sleep 0.3
  done
}
# wait_job_done JOBID: until the job left the queue, then it must have COMPLETED (not `sbatch --wait`: its
# polling is slow)
wait_job_done() {
  local jid=$1 st end=$(( $(date +%s) + WAIT_S ))
  while [ -n "$(squeue -h -j "$jid" -o %T 2>/dev/null)" ]; do
    [ "$(date +%s)" -lt "$end" ] || die "probe job $jid did not finish in ${WAIT_S}s"
    sleep 0.1
  done
  st=$(scontrol show job "$jid" 2>/dev/null | grep -o 'JobState=[A-Z]*' || true)
  [ "$st" = JobState=COMPLETED ] || die "probe job $jid ended as '$st'"
}
# pid_of NAME PIDFILE: prints the pid if it is a live (non-zombie) NAME process
pid_of() {
  alive "$1" "$2" || return 1
  tr -dc 0-9 < "$2"
}
# stop_one NAME PIDFILE: SIGTERM, up to 30 s (MariaDB flushes on shutdown), then SIGKILL; the pid file goes too
# (a stale /run/slurmctld.pid makes `apt-get purge slurmctld` fail)
stop_one() {
  local name=$1 pf=$2 pid i
  if ! pid=$(pid_of "$name" "$pf"); then
    log "$name: not running"; rm -f "$pf"; return 0
  fi
  kill -TERM "$pid" 2>/dev/null
  for i in $(seq 1 150); do
    pid_of "$name" "$pf" >/dev/null || { log "$name (pid $pid) stopped"; rm -f "$pf"; return 0; }
    sleep 0.2
  done
  log "$name (pid $pid) ignored SIGTERM for 30 s: SIGKILL"
  kill -KILL "$pid" 2>/dev/null; sleep 0.5; rm -f "$pf"
}
