#!/usr/bin/env bash
# A real single-host Slurm for tests/test_slurm.py: munge, MariaDB + slurmdbd (submitit reads job states
# with sacct), slurmctld and two slurmd (nodes zt1 and zt2 on 127.0.0.1, each with its own port and
# spool: 2-node trials need two nodes). Made for a container without cgroups or systemd:
# proctrack/linuxproc, task/none, every daemon started by hand, all on loopback.
#
#   sudo bash tests/slurm/setup.sh        # install (Debian/Ubuntu packages) if missing, configure, start
#
# Idempotent: daemons already answering are left alone; a second run takes about a second. Exits 0 once
# `sinfo` shows the nodes idle; non-zero with the daemons' last log lines otherwise.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "tests/slurm/setup.sh: run as root (it installs packages and starts daemons)" >&2; exit 2; }

ETC=/etc/slurm
LOG=/var/log/slurm
NODES=(zt1 zt2)
PORTS=(6821 6822)  # 6819 is slurmdbd's
CPUS=${ZT_SLURM_CPUS:-2}  # CPUs each node announces (config_overrides: both nodes share this host's cores)

log() { echo "tests/slurm/setup.sh: $*"; }

up() {  # sinfo answers and every node is idle or in use
    timeout 10 sinfo -N -h -o "%N %t" 2>/dev/null | awk '$2 !~ /^(idle|alloc|mix)$/ {bad=1} END {exit (NR < 2 || bad)}'
}

# accounting too: submitit and the tests read job states from sacct, which needs MariaDB behind slurmdbd
if command -v sinfo >/dev/null && up && mysqladmin ping >/dev/null 2>&1 && sacct -n -X -j 1 >/dev/null 2>&1; then
    log "Slurm is up: $(sinfo -N -h -o '%N:%t' | tr '\n' ' ')"
    exit 0
fi

# --- packages ---------------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmdbd >/dev/null || ! command -v mariadbd >/dev/null \
        || ! command -v munged >/dev/null || ! command -v sbatch >/dev/null; then
    log "installing slurm-wlm, slurmdbd, munge, mariadb-server"
    export DEBIAN_FRONTEND=noninteractive
    # the packages' own init scripts must not try to start anything (no init system here)
    ours=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && ours=1
    fi
    apt-get update -qq
    apt-get install -y -qq slurm-wlm slurmdbd munge mariadb-server >/dev/null
    [ -z "$ours" ] || rm -f /usr/sbin/policy-rc.d
fi

mkdir -p "$ETC" "$LOG" /var/spool/slurmctld /run/munge /var/run/mysqld
for n in "${NODES[@]}"; do mkdir -p "/var/spool/slurmd/$n"; done

# --- munge ------------------------------------------------------------------------------------------
[ -s /etc/munge/munge.key ] || { dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null; }
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    su -s /bin/sh munge -c "/usr/sbin/munged --force" || /usr/sbin/munged --force
fi

# --- MariaDB and the accounting database --------------------------------------------------------------
chown mysql:mysql /var/run/mysqld
if ! mysqladmin ping >/dev/null 2>&1; then
    [ -d /var/lib/mysql/mysql ] || mysql_install_db --user=mysql >/dev/null
    (mysqld_safe --bind-address=127.0.0.1 >/dev/null 2>&1 &)
    for _ in $(seq 60); do mysqladmin ping >/dev/null 2>&1 && break; sleep 0.5; done
fi
mysql -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
          CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'zt-slurm';
          GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"

# --- configuration ------------------------------------------------------------------------------------
cat > "$ETC/slurmdbd.conf" <<CONF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
LogFile=$LOG/slurmdbd.log
PidFile=/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=zt-slurm
StorageLoc=slurm_acct_db
CONF
chmod 600 "$ETC/slurmdbd.conf"

{
cat <<CONF
# written by tests/slurm/setup.sh
ClusterName=zt
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldPort=6817
KillWait=5
MinJobAge=600
InactiveLimit=0
CONF
for i in "${!NODES[@]}"; do
    echo "NodeName=${NODES[$i]} NodeAddr=127.0.0.1 NodeHostname=localhost Port=${PORTS[$i]} CPUs=$CPUS RealMemory=1000 State=UNKNOWN"
done
echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP"
} > "$ETC/slurm.conf.new"
if ! cmp -s "$ETC/slurm.conf.new" "$ETC/slurm.conf"; then  # a changed config: restart what reads it
    mv "$ETC/slurm.conf.new" "$ETC/slurm.conf"
    for pidfile in /run/slurmctld.pid /run/slurmd-*.pid; do
        [ -s "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
    done
    for _ in $(seq 40); do { pgrep -x slurmctld || pgrep -x slurmd; } >/dev/null || break; sleep 0.25; done
else
    rm -f "$ETC/slurm.conf.new"
fi
# the daemons read both names, depending on the package's build
ln -sf "$ETC/slurm.conf" /etc/slurm-llnl.conf 2>/dev/null || true

# --- daemons ------------------------------------------------------------------------------------------
pgrep -x slurmdbd >/dev/null || /usr/sbin/slurmdbd
for _ in $(seq 60); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.5; done
sacctmgr -i -Q add cluster zt >/dev/null 2>&1 || true
pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld
for _ in $(seq 60); do scontrol ping >/dev/null 2>&1 && break; sleep 0.5; done
for n in "${NODES[@]}"; do
    pgrep -f "slurmd -N $n" >/dev/null || /usr/sbin/slurmd -N "$n"
done
for _ in $(seq 60); do up && break; sleep 1; done
for n in "${NODES[@]}"; do scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true; done
if up; then
    log "Slurm is up: $(sinfo -N -h -o '%N:%t' | tr '\n' ' ')"
    exit 0
fi
log "Slurm did not come up; sinfo: $(sinfo -N -h -o '%N:%t:%E' 2>&1 | tr '\n' ' ')"
tail -n 5 "$LOG"/*.log >&2 || true
exit 1
