#!/usr/bin/env bash
# slurm/local/start-two-nodes.sh - a REAL two-node SLURM cluster on this one machine, for multi-node tests
# (Debian/Ubuntu as root, no systemd). Each node is its own host as far as the job can tell: a slurmd in its
# own network namespace (its own address on a private bridge) and its own UTS namespace (its own host name),
# so the ranks of a job find each other over the network by name, as on a real cluster:
#
#     root namespace:  slurmctld of cluster "moelab2n" (10.213.0.254:6827), bridge mlb2n0 10.213.0.254/24
#     netns moelab-n1: hostname moelab-n1, eth0 10.213.0.1/24, slurmd :6818
#     netns moelab-n2: hostname moelab-n2, eth0 10.213.0.2/24, slurmd :6818
#
# It is a second cluster beside slurm/local/start.sh's single-node one, which it leaves unchanged: its own
# slurm.conf (/etc/slurm-2n/slurm.conf: point SLURM_CONF at it), controller port, state, spool and log files,
# and job ids from 50000001 (submitit caches job states by id, so ids never collide with the other cluster's).
# It shares munged, MariaDB and slurmdbd with that cluster (start.sh is run first; sacct works for both).
#
#     SLURM_CONF=/etc/slurm-2n/slurm.conf sbatch -N 2 --ntasks-per-node 2 --wrap 'srun hostname'
#
# Idempotent; every daemon it starts is recorded in /run/moelab-slurm-2n/started, and stop-two-nodes.sh stops
# exactly those, by pid, then removes the namespaces and the bridge. Node helpers for tests:
#     bash slurm/local/start-two-nodes.sh kill-node moelab-n2   # SIGKILL the node's slurmd and its jobs' processes
#     bash slurm/local/start-two-nodes.sh                       # brings it back (and resumes it in SLURM)
#
# Knobs (environment): SLURM_2N_CPUS=2 (CPUs each node advertises), SLURM_LOCAL_WAIT_S=60.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WAIT_S=${SLURM_LOCAL_WAIT_S:-60}
CLUSTER=moelab2n
PARTITION=two
RUN=/run/moelab-slurm-2n              # pid files and the registry of what this script started
CONFDIR=/etc/slurm-2n
SPOOL=/var/spool/moelab-slurm-2n
LOGDIR=/var/log/slurm
SUBNET=10.213.0                      # a private test subnet, only on the bridge below
CTL_IP=$SUBNET.254
BRIDGE=mlb2n0
NODES=(moelab-n1 moelab-n2)
CTLD_PORT=6827
T0=$(date +%s%N)
# shellcheck source=slurm/local/lib.sh
source "$HERE/lib.sh"
LOG_TAG=slurm/local/start-two-nodes
LOG_FILES=("$LOGDIR"/2n-slurmctld.log "$LOGDIR"/2n-slurmd-moelab-n1.log "$LOGDIR"/2n-slurmd-moelab-n2.log)
[ "$(id -u)" = 0 ] || die "must run as root (it creates network namespaces and starts daemons)"

node_ip() { echo "$SUBNET.${1#moelab-n}"; }

# ------------------------------------------------------------------ kill-node NODE: a node dies
# Everything that runs on the node is in its network namespace: its slurmd, and the slurmstepd and job
# processes that slurmd started. SIGKILL them all at once, as a power cut would.
if [ "${1:-}" = kill-node ]; then
  node=${2:?usage: start-two-nodes.sh kill-node NODE}
  pids=$(ip netns pids "$node" 2>/dev/null | tr '\n' ' ')
  [ -n "${pids// /}" ] || { log "$node: nothing runs there"; exit 0; }
  log "$node: SIGKILL to $pids"
  kill -KILL $pids 2>/dev/null || true
  exit 0
fi

# ------------------------------------------------------------------ 1. the single-node cluster's base
# munged, MariaDB and slurmdbd (and the single-node cluster itself): a no-op when already running
env -u SLURM_CONF bash "$HERE/start.sh" | sed 's/^/  /'
# from here on every SLURM command (and slurmctld, slurmd) reads this cluster's configuration
export SLURM_CONF=$CONFDIR/slurm.conf
mkdir -p "$RUN"; touch "$RUN/started"

# ------------------------------------------------------------------ 2. network: a bridge and a namespace per node
if ! command -v ip >/dev/null 2>&1; then
  log "installing iproute2 (ip is missing)"
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends iproute2 >/dev/null
fi
if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
  ip link add "$BRIDGE" type bridge || die "cannot create the bridge $BRIDGE (the kernel needs bridge support)"
  ip addr add "$CTL_IP/24" dev "$BRIDGE"
  log "bridge $BRIDGE $CTL_IP/24 created"
fi
ip link set "$BRIDGE" up
for node in "${NODES[@]}"; do
  ip=$(node_ip "$node"); host_if=v${node#moelab-}-2n
  if ! ip netns list | grep -qw "$node"; then
    ip netns add "$node" || die "cannot create the network namespace $node (\`ip netns add\` needs root with CAP_SYS_ADMIN and a kernel with network namespaces)"
    ip link add "$host_if" type veth peer name eth0 netns "$node"
    ip link set "$host_if" master "$BRIDGE" up
    ip -n "$node" addr add "$ip/24" dev eth0
    ip -n "$node" link set eth0 up
    ip -n "$node" link set lo up
    log "network namespace $node with eth0 $ip/24 created"
  fi
  # the names resolve on every "host" (the file system, /etc/hosts included, is shared like an NFS home)
  grep -qE "^$ip[[:space:]]+$node\$" /etc/hosts || echo "$ip $node" >> /etc/hosts
done

# ------------------------------------------------------------------ 3. configuration
NODE=$(hostname -s)
CPUS=${SLURM_2N_CPUS:-2}
NEW=$(mktemp -d)
cat > "$NEW/slurm.conf" <<EOF
# written by moelab slurm/local/start-two-nodes.sh
ClusterName=$CLUSTER
SlurmctldHost=$NODE($CTL_IP)
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
FirstJobId=50000001
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldPort=$CTLD_PORT
SlurmdPort=6818
StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/d-%n
SlurmctldLogFile=$LOGDIR/2n-slurmctld.log
SlurmdLogFile=$LOGDIR/2n-slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
InactiveLimit=0
KillWait=5
MinJobAge=300
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=30
SlurmdParameters=config_overrides
NodeName=moelab-n1 NodeAddr=$(node_ip moelab-n1) CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=4000 State=UNKNOWN
NodeName=moelab-n2 NodeAddr=$(node_ip moelab-n2) CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=4000 State=UNKNOWN
PartitionName=$PARTITION Nodes=moelab-n[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
if ! cmp -s "$NEW/slurm.conf" "$SLURM_CONF"; then
  if alive slurmctld "$RUN/slurmctld.pid" || alive slurmd "$RUN/slurmd-moelab-n1.pid" \
     || alive slurmd "$RUN/slurmd-moelab-n2.pid"; then
    log "configuration changed: restarting the daemons of cluster $CLUSTER"
    bash "$HERE/stop-two-nodes.sh" --keep-network
  fi
  install -d -m 0755 "$CONFDIR"
  install -m 0644 "$NEW/slurm.conf" "$SLURM_CONF"
  log "wrote $SLURM_CONF (nodes ${NODES[*]}, $CPUS CPUs each)"
fi
rm -rf "$NEW"
install -d -o slurm -g slurm -m 0755 "$SPOOL/ctld" "$LOGDIR"
for node in "${NODES[@]}"; do install -d -m 0755 "$SPOOL/d-$node"; done

# ------------------------------------------------------------------ 4. slurmctld (root namespace), a slurmd per node
CTLD_STARTED=0
if alive slurmctld "$RUN/slurmctld.pid"; then
  log "slurmctld of $CLUSTER already running"
else
  CTLD_STARTED=1
  /usr/sbin/slurmctld
  wait_for "slurmctld pid" alive slurmctld "$RUN/slurmctld.pid"
  record slurmctld "$RUN/slurmctld.pid"
  wait_for "slurmctld to answer" sh -c 'scontrol ping | grep -q "is UP"'
  log "slurmctld of $CLUSTER started ($CTL_IP:$CTLD_PORT)"
fi
for node in "${NODES[@]}"; do
  pf=$RUN/slurmd-$node.pid
  if alive slurmd "$pf"; then
    log "slurmd on $node already running"; continue
  fi
  # its own network namespace and host name (unshare --uts); slurmd forks and keeps both. nsenter rather
  # than `ip netns exec`, which remounts /sys and so hides /sys/fs/cgroup from slurmd ("No filesystem mounted")
  nsenter --net="/run/netns/$node" unshare --uts sh -c "hostname $node && exec /usr/sbin/slurmd" \
    || die "slurmd on $node did not start (see $LOGDIR/2n-slurmd-$node.log)"
  wait_for "slurmd on $node" alive slurmd "$pf"
  record slurmd "$pf"
  log "slurmd on $node started"
done

# ------------------------------------------------------------------ 5. both nodes idle (a killed node comes back)
for node in "${NODES[@]}"; do
  wait_node_idle "$node"
done

# ------------------------------------------------------------------ 6. probe: one step across both nodes
if [ "$CTLD_STARTED" = 1 ] && [ "${SLURM_LOCAL_PROBE:-1}" = 1 ]; then
  out=$(mktemp)
  jid=$(sbatch --parsable -J moelab-probe-2n -N 2 --ntasks-per-node 1 -o "$out" -e /dev/null -t 1 \
        --wrap 'srun hostname') || die "probe sbatch failed"
  wait_job_done "$jid"
  [ "$(sort "$out" | tr '\n' ' ')" = "moelab-n1 moelab-n2 " ] || die "probe job $jid ran on '$(cat "$out")'"
  rm -f "$out"
  log "probe job $jid ran a step on moelab-n1 and moelab-n2"
fi
log "ready: $(sinfo -h -o '%P %a %D %T %N %c CPUs') (SLURM_CONF=$SLURM_CONF)"
