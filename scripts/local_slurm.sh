#!/usr/bin/env bash
# A real Slurm cluster on this machine, for trying the Slurm launcher and for the `-m slurm` tests:
# two nodes (node1, node2) on one host, slurmctld + two slurmd + slurmdbd/MariaDB accounting (so
# submitit's `sacct` polling notices hard failures). Debian/Ubuntu, root, no systemd needed.
#
#   scripts/local_slurm.sh install   apt-get the packages (≈40 MB, once)
#   scripts/local_slurm.sh start     write the configs, start the daemons, wait for idle nodes
#   scripts/local_slurm.sh stop      stop every daemon this script started
#   scripts/local_slurm.sh status    sinfo, or "not running"
#   scripts/local_slurm.sh up        install if needed, then start (what the test fixture calls)
#
# Everything the cluster writes lives under $STATE (default /var/lib/layerwise-slurm). The config
# goes to /etc/slurm/slurm.conf, marked as ours; a foreign slurm.conf (a real cluster) is never
# overwritten: the script refuses and exits 3. Exit codes: 0 ok, 2 cannot (not root / no apt),
# 3 refused, 1 failed (the daemon logs are printed).
set -euo pipefail

STATE=${LAYERWISE_SLURM_STATE:-/var/lib/layerwise-slurm}
CONF=/etc/slurm/slurm.conf
MARKER="# layerwise local test cluster (scripts/local_slurm.sh)"
PACKAGES=(munge slurm-client slurmctld slurmd slurmdbd mariadb-server mariadb-client)
NODES=(node1 node2)
CPUS_PER_NODE=${LAYERWISE_SLURM_CPUS:-4}  # advertised; more than the real cores is fine for tests

say() { echo "[local_slurm] $*" >&2; }
cannot() { say "cannot: $*"; exit 2; }

require_root() {
    [ "$(id -u)" -eq 0 ] || cannot "not root (the daemons and /etc/slurm need root)"
}

installed() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v slurmdbd >/dev/null \
        && command -v munged >/dev/null && command -v mariadbd >/dev/null && command -v sacct >/dev/null
}

do_install() {
    require_root
    installed && { say "packages already installed"; return 0; }
    command -v apt-get >/dev/null || cannot "no apt-get: install ${PACKAGES[*]} yourself"
    say "installing ${PACKAGES[*]}"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null; then
        apt-get update -q >/dev/null
        apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null
    fi
    installed || { say "install finished but the daemons are missing"; exit 1; }
}

write_configs() {
    mkdir -p /etc/slurm "$STATE"/{ctld,log,run,mysql} /run/mysqld
    if [ -f "$CONF" ] && ! grep -qF "$MARKER" "$CONF"; then
        say "refusing: $CONF exists and is not ours (a real cluster?). Remove it or use that cluster."
        exit 3
    fi
    cat >"$CONF" <<EOF
$MARKER — safe to delete with 'local_slurm.sh stop'
ClusterName=layerwise
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool-%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
ReturnToService=2
MinJobAge=86400
MpiDefault=none
KillWait=10
# a requeued job may start again only after the job credential expired (default 120 s)
AuthInfo=cred_expire=10
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=node[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[17001-17002] CPUs=$CPUS_PER_NODE RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
    cat >/etc/slurm/slurmdbd.conf <<EOF
$MARKER
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
LogFile=$STATE/log/slurmdbd.log
PidFile=$STATE/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=layerwise_slurm_acct
EOF
    chmod 600 /etc/slurm/slurmdbd.conf
    # Lightning takes MASTER_ADDR from SLURM_NODELIST: the node names must resolve.
    grep -qE "^127\.0\.0\.1[[:space:]]+node1 node2" /etc/hosts || echo "127.0.0.1 node1 node2" >>/etc/hosts
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

wait_for() {  # wait_for <seconds> <description> <command...>
    local seconds=$1 what=$2; shift 2
    for _ in $(seq $((seconds * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
    say "timed out waiting for $what"; show_logs; exit 1
}

show_logs() { tail -n 20 "$STATE"/log/*.log >&2 2>/dev/null || true; }

start_munge() {
    alive "$STATE/run/munged.pid" && return 0
    [ -f /etc/munge/munge.key ] || { mungekey --create >/dev/null 2>&1 || create-munge-key -f; }
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    rm -f /run/munge/munged.pid
    su -s /bin/sh munge -c "munged" 2>/dev/null || munged --force  # munged's pid: /run/munge/munged.pid
    wait_for 10 munged test -s /run/munge/munged.pid
    cp /run/munge/munged.pid "$STATE/run/munged.pid"
}

start_mariadb() {
    alive "$STATE/run/mariadbd.pid" && return 0
    if [ ! -d "$STATE/mysql/mysql" ]; then
        mariadb-install-db --user=root --datadir="$STATE/mysql" --auth-root-authentication-method=socket \
            --skip-test-db >"$STATE/log/mariadb-install.log" 2>&1
    fi
    mariadbd --user=root --datadir="$STATE/mysql" --skip-networking --socket=/run/mysqld/mysqld.sock \
        --pid-file="$STATE/run/mariadbd.pid" --log-error="$STATE/log/mariadbd.log" \
        --innodb-buffer-pool-size=32M >/dev/null 2>&1 &
    wait_for 30 mariadbd mariadb --socket=/run/mysqld/mysqld.sock -e "select 1"
}

do_start() {
    require_root
    installed || cannot "Slurm is not installed: run '$0 install' (needs apt-get)"
    write_configs
    local started=$SECONDS
    start_munge
    start_mariadb
    alive "$STATE/run/slurmdbd.pid" || slurmdbd
    wait_for 30 slurmdbd sacctmgr -n list cluster
    sacctmgr -i -Q add cluster layerwise >/dev/null 2>&1 || true
    alive "$STATE/run/slurmctld.pid" || slurmctld
    wait_for 30 slurmctld scontrol ping
    # A job of an earlier run that was stopped mid-test is still in the saved state and would hold the
    # nodes (they never turn idle): this cluster is ours (the marker), so cancel what it left.
    local leftover
    leftover=$(squeue -h -o %i | tr '\n' ' ')
    [ -z "${leftover// /}" ] || { say "cancelling jobs left from an earlier run: $leftover"; scancel $leftover; }
    for node in "${NODES[@]}"; do
        alive "$STATE/run/slurmd-$node.pid" || slurmd -N "$node"
    done
    wait_for 60 "idle nodes" sh -c "[ \"\$(sinfo -h -N -t idle -o %N | sort -u | wc -l)\" -eq ${#NODES[@]} ]"
    say "running: ${#NODES[@]} nodes × $CPUS_PER_NODE CPUs, accounting on ($((SECONDS - started)) s)"
}

stop_pidfile() {  # stop_pidfile <pidfile>: TERM, wait up to 10 s, then KILL; only that process
    local file=$1 pid
    [ -f "$file" ] || return 0
    pid=$(cat "$file")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$file"
}

do_stop() {
    require_root
    for node in "${NODES[@]}"; do stop_pidfile "$STATE/run/slurmd-$node.pid"; done
    stop_pidfile "$STATE/run/slurmctld.pid"
    stop_pidfile "$STATE/run/slurmdbd.pid"
    stop_pidfile "$STATE/run/mariadbd.pid"
    stop_pidfile "$STATE/run/munged.pid"
    say "stopped"
}

case "${1:-}" in
    install) do_install ;;
    start) do_start ;;
    up) do_install; do_start ;;
    stop) do_stop ;;
    restart) do_stop; do_start ;;
    status) if alive "$STATE/run/slurmctld.pid"; then sinfo; else echo "not running"; exit 1; fi ;;
    *) echo "usage: $0 install|start|up|stop|restart|status" >&2; exit 64 ;;
esac
