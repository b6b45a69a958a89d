#!/usr/bin/env bash
# slurm/local/start.sh - a REAL single-node SLURM cluster on this machine, for trying moelab's SLURM executor
# and for its tests (Debian/Ubuntu, run as root, no systemd needed):
#     munged -> MariaDB (private, 127.0.0.1:3307) -> slurmdbd -> slurmctld -> slurmd
# It installs what is missing (apt), writes /etc/slurm/*.conf, starts the daemons and waits until a batch job
# really runs. Idempotent: what already runs is left alone; a changed config restarts only the daemons this
# script started. Every daemon it starts is recorded (name + pid file) in /run/moelab-slurm/started, and
# slurm/local/stop.sh stops exactly those, by pid.
#
# Why accounting: without slurmdbd, `sacct` fails, submitit reports every job as UNKNOWN, and the result of a
# cancelled job is waited for forever. MariaDB + slurmdbd cost ~1 s at start.
#
# Knobs (environment):
#   SLURM_LOCAL_CPUS=N      CPUs to advertise (default: at least 4, so a 2-task job plus another job fit on a
#                           2-core machine; more than the real count oversubscribes via config_overrides)
#   SLURM_LOCAL_ACCOUNTING=1  0 = no MariaDB/slurmdbd (submitit's job states then stay UNKNOWN)
#   SLURM_LOCAL_WAIT_S=60   bound for every wait
#   SLURM_LOCAL_PROBE=1     0 = skip the probe batch job at the end
set -euo pipefail

ACCOUNTING=${SLURM_LOCAL_ACCOUNTING:-1}
WAIT_S=${SLURM_LOCAL_WAIT_S:-60}
CLUSTER=moelab
PARTITION=debug
RUN=/run/moelab-slurm                 # pid-file registry, MariaDB socket and pid
DBDIR=/var/lib/moelab-slurm/mysql     # private MariaDB datadir: a system MariaDB is never touched
DBPORT=3307
DBPASS=moelab-local                   # throwaway credential of a 127.0.0.1-only database
CONF=/etc/slurm
LOGDIR=/var/log/slurm
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
T0=$(date +%s%N)

# shellcheck source=slurm/local/lib.sh
source "$HERE/lib.sh"
LOG_TAG=slurm/local/start
LOG_FILES=("$LOGDIR"/slurmctld.log "$LOGDIR"/slurmd.log "$LOGDIR"/slurmdbd.log)
[ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts daemons)"

# ------------------------------------------------------------------ 1. packages (only when missing)
PKGS=(munge slurmctld slurmd slurm-client)
BINS=(munged slurmctld slurmd sbatch sacct)
if [ "$ACCOUNTING" = 1 ]; then PKGS+=(slurmdbd mariadb-server); BINS+=(slurmdbd mariadbd); fi
missing=()
for b in "${BINS[@]}"; do command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || missing+=("$b"); done
if [ ${#missing[@]} -gt 0 ]; then
  command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get: install SLURM by hand"
  log "installing ${PKGS[*]} (missing: ${missing[*]})"
  export DEBIAN_FRONTEND=noninteractive
  # another apt/dpkg may hold the lock: wait for it rather than fail
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${PKGS[@]}" >/dev/null
  log "installed $(dpkg-query -W -f='${Package} ${Version}  ' slurmctld munge 2>/dev/null)"
fi

# ------------------------------------------------------------------ helpers (log, die, alive, record, wait_for: lib.sh)
mkdir -p "$RUN"; touch "$RUN/started"

# ------------------------------------------------------------------ 2. the node's name must resolve
NODE=$(hostname -s)
if ! getent hosts "$NODE" >/dev/null; then
  log "host name $NODE does not resolve: adding '127.0.0.1 $NODE' to /etc/hosts"
  echo "127.0.0.1 $NODE" >> /etc/hosts
fi

# ------------------------------------------------------------------ 3. munge (authentication)
if [ ! -s /etc/munge/munge.key ]; then
  install -d -o munge -g munge -m 0700 /etc/munge
  mungekey --create --keyfile=/etc/munge/munge.key
fi
chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "munged already answering"
else
  runuser -u munge -- /usr/sbin/munged            # forks, writes /run/munge/munged.pid
  wait_for munged sh -c 'munge -n | unmunge'
  record munged /run/munge/munged.pid
  log "munged started"
fi

# ------------------------------------------------------------------ 4. configuration
read -r REAL_CPUS REAL_MEM < <(slurmd -C | awk '{for (i = 1; i <= NF; i++) {split($i, a, "="); v[a[1]] = a[2]}}
                                               END {print v["CPUs"], v["RealMemory"]}')
DEFAULT_CPUS=$(( REAL_CPUS > 4 ? REAL_CPUS : 4 ))
CPUS=${SLURM_LOCAL_CPUS:-$DEFAULT_CPUS}
MEM=$(( REAL_MEM * 95 / 100 ))
# advertising more CPUs than exist needs config_overrides (slurmd otherwise drains the node)
OVERRIDE=""; [ "$CPUS" -gt "$REAL_CPUS" ] && OVERRIDE="SlurmdParameters=config_overrides"
if [ "$ACCOUNTING" = 1 ]; then
  ACCT=$'AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=localhost\nAccountingStoragePort=6819'
else
  ACCT="AccountingStorageType=accounting_storage/none"
fi
NEW=$(mktemp -d)
cat > "$NEW/slurm.conf" <<EOF
# written by moelab slurm/local/start.sh
ClusterName=$CLUSTER
SlurmctldHost=$NODE
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
SchedulerType=sched/backfill
# the default batch_sched_delay=3 adds ~3 s to every batch job; the 1 s background tick remains
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
$ACCT
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
InactiveLimit=0
KillWait=5
MinJobAge=300
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=30
$OVERRIDE
NodeName=$NODE CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
cat > "$NEW/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=slurm
PidFile=/run/slurmdbd.pid
LogFile=$LOGDIR/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DBPORT
StorageUser=slurm
StoragePass=$DBPASS
StorageLoc=slurm_acct_db
EOF
changed=0
for f in slurm.conf slurmdbd.conf; do cmp -s "$NEW/$f" "$CONF/$f" || changed=1; done
if [ "$changed" = 1 ]; then
  # slurmd keeps an old config until restarted ("appears to have a different slurm.conf")
  if alive slurmctld /run/slurmctld.pid || alive slurmd /run/slurmd.pid || alive slurmdbd /run/slurmdbd.pid; then
    log "configuration changed: restarting the SLURM daemons this script started"
    MOELAB_SLURM_KEEP_BASE=1 bash "$HERE/stop.sh"
  fi
  install -d -m 0755 "$CONF"
  install -m 0644 "$NEW/slurm.conf" "$CONF/slurm.conf"
  install -m 0600 -o slurm -g slurm "$NEW/slurmdbd.conf" "$CONF/slurmdbd.conf"  # slurmdbd insists on 0600
  log "wrote $CONF/slurm.conf (node $NODE, CPUs=$CPUS of $REAL_CPUS real, RealMemory=$MEM, accounting=$ACCOUNTING)"
fi
rm -rf "$NEW"
install -d -o slurm -g slurm -m 0755 /var/spool/slurmctld "$LOGDIR"
install -d -m 0755 /var/spool/slurmd

# ------------------------------------------------------------------ 5. accounting: private MariaDB + slurmdbd
if [ "$ACCOUNTING" = 1 ]; then
  SOCK=$RUN/db/mysqld.sock
  install -d -o mysql -g mysql -m 0755 "$RUN/db" "$(dirname "$DBDIR")"
  if [ ! -d "$DBDIR/mysql" ]; then
    log "initialising the private MariaDB in $DBDIR"
    mariadb-install-db --no-defaults --user=mysql --datadir="$DBDIR" --auth-root-authentication-method=socket \
      --skip-test-db >"$RUN/db/install.log" 2>&1 || { cat "$RUN/db/install.log"; die "mariadb-install-db failed"; }
  fi
  if alive mariadbd "$RUN/db/mysqld.pid"; then
    log "MariaDB already running"
  else
    # mariadbd does not daemonize itself: detach it. The innodb sizes keep slurmdbd from complaining.
    setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$DBDIR" --socket="$SOCK" \
      --pid-file="$RUN/db/mysqld.pid" --bind-address=127.0.0.1 --port=$DBPORT \
      --log-error="$LOGDIR/mariadb-moelab.err" --innodb-buffer-pool-size=512M --innodb-log-file-size=64M \
      --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 &
    wait_for MariaDB mariadb-admin --no-defaults --socket="$SOCK" ping
    wait_for "MariaDB pid file" alive mariadbd "$RUN/db/mysqld.pid"
    record mariadbd "$RUN/db/mysqld.pid"
    log "MariaDB started (127.0.0.1:$DBPORT)"
  fi
  mariadb --no-defaults --socket="$SOCK" -u root <<EOF
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DBPASS';
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DBPASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
EOF
  if alive slurmdbd /run/slurmdbd.pid; then
    log "slurmdbd already running"
  else
    /usr/sbin/slurmdbd                                # forks, writes /run/slurmdbd.pid
    wait_for "slurmdbd pid" alive slurmdbd /run/slurmdbd.pid
    record slurmdbd /run/slurmdbd.pid
    wait_for "slurmdbd to answer" sacctmgr -n list cluster
    log "slurmdbd started"
  fi
fi

# ------------------------------------------------------------------ 6. slurmctld, slurmd
CTLD_STARTED=0
if alive slurmctld /run/slurmctld.pid; then
  log "slurmctld already running"
else
  CTLD_STARTED=1
  /usr/sbin/slurmctld                                 # forks; rc 0 even if it dies later, hence the checks
  wait_for "slurmctld pid" alive slurmctld /run/slurmctld.pid
  record slurmctld /run/slurmctld.pid
  wait_for "slurmctld to answer" sh -c 'scontrol ping | grep -q "is UP"'
  log "slurmctld started"
fi
if alive slurmd /run/slurmd.pid; then
  log "slurmd already running"
else
  /usr/sbin/slurmd                                    # as root; forks
  wait_for "slurmd pid" alive slurmd /run/slurmd.pid
  record slurmd /run/slurmd.pid
  log "slurmd started"
fi

# ------------------------------------------------------------------ 7. node idle
wait_node_idle "$NODE"

# ------------------------------------------------------------------ 8. probe job
# A fresh slurmctld schedules for the first time ~3 s after start although sinfo says idle: run one tiny
# batch job so that "ready" means batch jobs really run. (Not `sbatch --wait`: its polling is slow.)
if [ "$CTLD_STARTED" = 1 ] && [ "${SLURM_LOCAL_PROBE:-1}" = 1 ]; then
  jid=$(sbatch --parsable -J moelab-probe -o /dev/null -e /dev/null -t 1 --wrap true) || die "probe sbatch failed"
  wait_job_done "$jid"
  log "probe job $jid completed"
fi
log "ready: $(sinfo -h -o '%P %a %D %T %N %c CPUs')"
