#!/usr/bin/env bash
# A real Slurm cluster of emulated nodes on this one machine, for tests and development.
#
#   bash launchers/slurm/cluster.sh start [NODES]   # install if needed, start munge, slurmctld
#                                                  # and NODES slurmd daemons (n1..nN; default 2)
#   source <(bash launchers/slurm/cluster.sh env)  # point sbatch/srun/squeue at it
#   bash launchers/slurm/cluster.sh status
#   bash launchers/slurm/cluster.sh stop            # stops every daemon by its pid file
#   bash launchers/slurm/cluster.sh kill-node n2    # the node vanishes (SIGKILL to its slurmd
#                                                  # and to every process of its jobs)
#   bash launchers/slurm/cluster.sh revive n2       # its slurmd starts again
#
# Needs root and apt (Debian's slurmctld, slurmd, slurm-client and munge: ~3 MB). Every file it
# writes lives under $SETDIFF_SLURM_BASE (default /tmp/setdiff-slurm); the only changes outside it
# are the packages, the munge key if there was none, and one marked line in /etc/hosts naming
# the emulated nodes, which `stop` removes. The nodes share one kernel: tell them apart by
# SLURMD_NODENAME / SLURM_NODEID, not by hostname; /dev/shm, ports and files are shared.
set -euo pipefail

BASE=${SETDIFF_SLURM_BASE:-/tmp/setdiff-slurm}
CONF=$BASE/slurm.conf
HOSTS_TAG="# setdiff-slurm emulated nodes"
log() { echo "[slurm-cluster] $*" >&2; }
die() { log "error: $*"; exit 1; }

node_names() { cat "$BASE/nodes" 2>/dev/null || true; }

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch \
        >/dev/null && command -v munged >/dev/null && return 0
    [ "$(id -u)" = 0 ] || die "Slurm is not installed and installing it needs root"
    command -v apt-get >/dev/null || die "Slurm is not installed and there is no apt-get: install \
slurmctld, slurmd, slurm-client and munge with your package manager"
    log "installing slurmctld slurmd slurm-client munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

start_munge() {
    if [ ! -s /etc/munge/munge.key ]; then
        mkdir -p /etc/munge
        if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key
        else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
    fi
    chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge
    if ! munge -n >/dev/null 2>&1; then
        runuser -u munge -- munged
        for _ in $(seq 50); do munge -n >/dev/null 2>&1 && return 0; sleep 0.1; done
        die "munged did not start"
    fi
}

write_conf() {
    local n=$1 cpus mem
    cpus=$(nproc)
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / n / 2 ))
    mkdir -p "$BASE"/{state/ctld,run,log}
    : >"$BASE/nodes"
    for i in $(seq "$n"); do mkdir -p "$BASE/state/d/n$i"; echo "n$i" >>"$BASE/nodes"; done
    cat >"$CONF" <<EOF
# written by launchers/slurm/cluster.sh: $n emulated nodes on $(hostname)
ClusterName=setdiff
SlurmctldHost=localhost
SlurmctldPort=${SETDIFF_SLURMCTLD_PORT:-6817}
AuthType=auth/munge
CredType=cred/munge
# short credential lifetime: a requeued job restarts in ~10 s instead of ~150 s
AuthInfo=cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$BASE/state/ctld
SlurmdSpoolDir=$BASE/state/d/%n
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd-%n.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd-%n.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=30
# a node whose slurmd stops answering is DOWN after 10-20 s (the default, 300 s, is for real
# clusters): the node-loss tests end the job NODE_FAIL and requeue it in that time
SlurmdTimeout=10
MinJobAge=600
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=n[1-$n] NodeHostname=localhost NodeAddr=127.0.0.1 Port=${SETDIFF_SLURMD_PORT:-17001}-$(( ${SETDIFF_SLURMD_PORT:-17001} + n - 1 )) CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

add_hosts() {
    grep -qF "$HOSTS_TAG" /etc/hosts && return 0
    echo "127.0.0.1 $(node_names | tr '\n' ' ')$HOSTS_TAG" >>/etc/hosts
}

remove_hosts() {
    grep -qF "$HOSTS_TAG" /etc/hosts || return 0
    # /etc/hosts may be a bind mount: rewrite it in place rather than replace it
    local kept
    kept=$(grep -vF "$HOSTS_TAG" /etc/hosts)
    printf '%s\n' "$kept" >/etc/hosts
}

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
    local n=${1:-2}
    if alive "$BASE/run/slurmctld.pid"; then
        log "already running (stop it first to change the node count)"; wait_idle; return 0
    fi
    install_packages
    start_munge
    write_conf "$n"
    add_hosts
    # (from $BASE: a daemon that dumps core leaves it there, not in the caller's directory;
    # exec: no shell lingers holding the caller's stdout, which a caller that captures it, as
    # tests/test_slurm.py does, would wait on for as long as the daemons live)
    (cd "$BASE" && exec setsid nohup slurmctld -D -i -f "$CONF" >>"$BASE/log/slurmctld.out" \
        2>&1 </dev/null &)
    for node in $(node_names); do
        (cd "$BASE" && exec setsid nohup slurmd -D -N "$node" -f "$CONF" \
            >>"$BASE/log/slurmd-$node.out" 2>&1 </dev/null &)
    done
    wait_idle
    log "up: $n nodes; run: export SLURM_CONF=$CONF"
}

wait_idle() {
    local n
    n=$(node_names | wc -l)
    for _ in $(seq 300); do
        if [ "$(SLURM_CONF=$CONF sinfo -h -N -t idle,mixed,allocated -o %N 2>/dev/null \
                | sort -u | wc -l)" -ge "$n" ]; then
            return 0
        fi
        sleep 0.2
    done
    die "the nodes did not become idle in 60 s; see $BASE/log/"
}

stop() {
    local pidfile pid
    for pidfile in "$BASE"/run/slurmd-*.pid "$BASE/run/slurmctld.pid"; do
        [ -e "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        if kill -0 "$pid" 2>/dev/null; then
            kill "$pid"
            for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
        fi
        rm -f "$pidfile"
    done
    [ -d "$BASE" ] && remove_hosts
    log "stopped"
}

node_pids() {  # every process of emulated node $1: its slurmd, slurmstepds and their tasks
    local pid
    [ -s "$BASE/run/slurmd-$1.pid" ] && cat "$BASE/run/slurmd-$1.pid"
    for pid in /proc/[0-9]*; do
        pid=${pid#/proc/}
        tr '\0' '\n' 2>/dev/null <"/proc/$pid/environ" | grep -qx "SLURMD_NODENAME=$1" &&
            echo "$pid"
    done
    # a slurmstepd holds its node's log (and spool files) open
    for pid in $(pgrep -f '^slurmstepd' || true); do
        find "/proc/$pid/fd" \( -lname "$BASE/log/slurmd-$1.log" -o -lname "$BASE/state/d/$1/*" \) \
            2>/dev/null | grep -q . && echo "$pid"
    done
    return 0
}

kill_node() {  # the node vanishes: SIGKILL to its slurmd and everything it runs
    local node=$1 pids
    grep -qx "$node" "$BASE/nodes" || die "no node $node (nodes: $(node_names | tr '\n' ' '))"
    pids=$(node_pids "$node" | sort -u | tr '\n' ' ')
    # stopped first, all of them, then killed: a real node's processes die at one instant, and
    # a slurmstepd that outlived its task by a moment would report the job ended by signal 9
    # (not NODE_FAIL, which requeues it)
    # shellcheck disable=SC2086
    [ -n "$pids" ] && { kill -STOP $pids 2>/dev/null; kill -9 $pids 2>/dev/null; }
    rm -f "$BASE/run/slurmd-$node.pid"
    log "killed $node (pids $pids); slurmctld sets it DOWN within SlurmdTimeout"
}

revive_node() {  # start the node's slurmd again; ReturnToService=2 makes it usable
    local node=$1
    grep -qx "$node" "$BASE/nodes" || die "no node $node"
    alive "$BASE/run/slurmd-$node.pid" && return 0
    (cd "$BASE" && exec setsid nohup slurmd -D -N "$node" -f "$CONF" \
        >>"$BASE/log/slurmd-$node.out" 2>&1 </dev/null &)
    wait_idle
    log "$node is back"
}

case "${1:-}" in
    start) start "${2:-2}" ;;
    stop) stop ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    status)
        if alive "$BASE/run/slurmctld.pid"; then SLURM_CONF=$CONF sinfo -N
        else echo "not running"; exit 3; fi ;;
    kill-node) kill_node "${2:?which node}" ;;
    revive) revive_node "${2:?which node}" ;;
    *) echo "usage: $0 start [NODES] | stop | status | env | kill-node NODE | revive NODE" >&2
       exit 2 ;;
esac
