#!/usr/bin/env bash
# A real SLURM for moolib's tests (tests/test_slurm_*.py), from Debian packages,
# with everything under one folder: no systemd, nothing in /etc. Two nodes run
# on this one machine: "node1" (partition debug, the default) and "node2"
# (another port); partition "two" has both, for jobs that span nodes.
# (Not "localhost": slurmd takes any name for a lone node of that name, so a
# second node clashes with it.)
#
#   scripts/slurm-test-cluster.sh start    # installs packages if missing (~1 min once), starts (~3 s)
#   eval "$(scripts/slurm-test-cluster.sh env)"   # SLURM_CONF for sbatch/sacct/submitit
#   scripts/slurm-test-cluster.sh status
#   scripts/slurm-test-cluster.sh stop     # stops every daemon by its PID file; state is kept
#   scripts/slurm-test-cluster.sh clean    # stop, then remove the folder
#
# MOOLIB_SLURM_BASE (default /tmp/moolib-slurm-ci) holds config, state, logs and
# the accounting database; MOOLIB_SLURM_PORT (default 16817) is the first of five
# ports (slurmctld, node1's slurmd, slurmdbd, MariaDB, node2's slurmd), away from
# SLURM's defaults so a test cluster does not collide with another one on the
# same machine.
set -euo pipefail

B=${MOOLIB_SLURM_BASE:-/tmp/moolib-slurm-ci}
PORT=${MOOLIB_SLURM_PORT:-16817}
# This machine has 2 cores; a test runs a broker and several peers at once, so
# the node advertises more CPUs than it has (SlurmdParameters=config_overrides).
NCPUS=${MOOLIB_SLURM_CPUS:-16}
CONF=$B/etc/slurm.conf
SOCK=$B/run/munge.sock
export SLURM_CONF=$CONF

say() { echo "slurm-test-cluster: $*" >&2; }
# A daemon is alive when its PID file names a process that is not a zombie
# (daemons whose parent is gone may stay zombies until a reaper collects them).
alive() {
  [ -s "$1" ] || return 1
  local stat
  stat=$(ps -o stat= -p "$(cat "$1" 2>/dev/null)" 2>/dev/null) || return 1
  [ "${stat:0:1}" != Z ]
}
wait_for() {  # wait_for SECONDS COMMAND...: polls every 0.1 s
  local n=$(($1 * 10)); shift
  for _ in $(seq "$n"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  return 1
}
NODES="node1 node2"
# The cluster is up when slurmctld runs and reports every node usable (sinfo
# alone would retry for ~10 s when slurmctld is down).
up() {
  alive "$B/run/slurmctld.pid" || return 1
  local n
  for n in $NODES; do
    sinfo -h -N -n "$n" -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)' || return 1
  done
}

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmdbd >/dev/null \
    && command -v munged >/dev/null && command -v mariadbd >/dev/null && return
  say "installing slurm-wlm daemons, slurmdbd, munge and MariaDB (Debian packages)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client slurmdbd munge mariadb-server >/dev/null
}

write_config() {
  mkdir -p "$B"/{etc,log,run,state/ctld,munge}
  local n
  for n in $NODES; do mkdir -p "$B/state/d-$n"; done
  chmod 700 "$B/munge"
  [ -s "$B/munge/munge.key" ] || {
    head -c 1024 /dev/urandom >"$B/munge/munge.key"
    chmod 400 "$B/munge/munge.key"
  }
  # A new cluster would number jobs from 1 again, and submitit's folders are
  # keyed by job id: a stale result file of an earlier cluster could then be
  # read as a new job's. Start ids from the clock instead (only read when the
  # state folder is new; a restarted cluster goes on from its saved id).
  local first_id=$((($(date +%s) % 600000) * 100 + 1))
  cat >"$CONF" <<EOF
ClusterName=moolibci
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job waits this long before it starts again (default 120 s).
AuthInfo=socket=$SOCK,cred_expire=10
StateSaveLocation=$B/state/ctld
SlurmdSpoolDir=$B/state/d-%n
SlurmctldPidFile=$B/run/slurmctld.pid
SlurmdPidFile=$B/run/slurmd-%n.pid
SlurmctldLogFile=$B/log/slurmctld.log
SlurmdLogFile=$B/log/slurmd-%n.log
MailProg=/bin/true
# No cgroups in a container: track processes by /proc, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Queued batch jobs start in ~0.5 s instead of 1-3 s. A requeued job waits 10 s
# (its BeginTime), then for the next periodic pass of the scheduler: every 2 s
# here instead of 60 (backfill's 30), so a requeue takes ~12 s, not 15-60.
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=2,bf_interval=2
# slurmd listens on 127.0.0.1 only.
CommunicationParameters=NoInAddrAny
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MinJobAge=300
FirstJobId=$first_id
# Accounting through slurmdbd: without it sacct fails and submitit never sees a
# cancelled or killed job (job.result() then waits forever).
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$((PORT + 2))
# The slurmctld-slurmdbd link ignores AuthInfo; this is where it finds munge.
AccountingStoragePass=$SOCK
NodeName=node1 NodeAddr=127.0.0.1 CPUs=$NCPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$NCPUS ThreadsPerCore=1 RealMemory=16000 State=UNKNOWN
NodeName=node2 NodeAddr=127.0.0.1 Port=$((PORT + 4)) CPUs=4 Boards=1 SocketsPerBoard=1 CoresPerSocket=4 ThreadsPerCore=1 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=node1 Default=YES MaxTime=INFINITE State=UP
PartitionName=two Nodes=node1,node2 MaxTime=INFINITE State=UP
EOF
  # slurmdbd reads slurmdbd.conf beside slurm.conf; it must be private.
  cat >"$B/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$SOCK
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$((PORT + 2))
SlurmUser=root
LogFile=$B/log/slurmdbd.log
PidFile=$B/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$((PORT + 3))
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$B/etc/slurmdbd.conf"
}

start_mariadb() {
  alive "$B/run/mysqld.pid" && return
  if [ ! -d "$B/mysql/mysql" ]; then
    mariadb-install-db --datadir="$B/mysql" --user=root --auth-root-authentication-method=normal \
      --skip-test-db >"$B/log/mariadb-install.log" 2>&1
  fi
  # --no-defaults: ignore /etc/mysql; setsid: not in this shell's process group.
  setsid mariadbd --no-defaults --datadir="$B/mysql" --user=root --bind-address=127.0.0.1 \
    --port=$((PORT + 3)) --socket="$B/run/mysqld.sock" --pid-file="$B/run/mysqld.pid" \
    --log-error="$B/log/mysqld.err" --innodb-buffer-pool-size=32M --skip-name-resolve \
    </dev/null >/dev/null 2>&1 &
  wait_for 30 mariadb-admin --socket="$B/run/mysqld.sock" ping \
    || { say "MariaDB did not start:"; tail -20 "$B/log/mysqld.err" >&2; exit 1; }
  mariadb --socket="$B/run/mysqld.sock" -uroot -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
}

start() {
  if up && alive "$B/run/slurmdbd.pid"; then
    say "already running ($CONF)"
    echo "export SLURM_CONF=$CONF"
    return
  fi
  install_packages
  write_config
  alive "$B/run/munged.pid" || munged --key-file="$B/munge/munge.key" --socket="$SOCK" \
    --pid-file="$B/run/munged.pid" --log-file="$B/log/munged.log" --seed-file="$B/munge/seed"
  start_mariadb
  alive "$B/run/slurmdbd.pid" || slurmdbd
  wait_for 30 sacctmgr -n show cluster \
    || { say "slurmdbd did not answer:"; tail -20 "$B/log/slurmdbd.log" >&2; exit 1; }
  alive "$B/run/slurmctld.pid" || slurmctld
  local n
  for n in $NODES; do
    alive "$B/run/slurmd-$n.pid" || slurmd -N "$n"
  done
  wait_for 60 up || { say "the nodes did not come up:"; tail -n 20 "$B"/log/slurm*.log >&2; exit 1; }
  # slurmctld registers the cluster with slurmdbd by itself; sacct works after that.
  wait_for 30 sh -c "sacctmgr -n -P show cluster format=cluster | grep -qx moolibci" \
    || { say "the cluster did not register with slurmdbd"; exit 1; }
  sacct -n >/dev/null
  say "up: $NCPUS CPUs on partition debug (node node1), partition two adds node2; state under $B"
  echo "export SLURM_CONF=$CONF"
}

stop_pid() {  # stops the daemon of a PID file: SIGTERM, then SIGKILL after 10 s
  local f=$1 pid
  alive "$f" || return 0
  pid=$(cat "$f")
  kill "$pid"
  for _ in $(seq 100); do
    alive "$f" || return 0
    sleep 0.1
  done
  kill -9 "$pid" 2>/dev/null || true
}

stop() {
  [ -f "$CONF" ] || { say "nothing to stop under $B"; return; }
  # Jobs first, so no job's processes outlive slurmd.
  if up; then
    scancel --full --user="$(id -un)" 2>/dev/null || true
    wait_for 15 sh -c '[ -z "$(squeue -h -t R,CG -o %i)" ]' || true
  fi
  local n
  for n in $NODES; do stop_pid "$B/run/slurmd-$n.pid"; done
  stop_pid "$B/run/slurmd.pid"  # a cluster started by an older version of this script
  stop_pid "$B/run/slurmctld.pid"
  stop_pid "$B/run/slurmdbd.pid"
  stop_pid "$B/run/mysqld.pid"
  stop_pid "$B/run/munged.pid"
  say "stopped"
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  status)
    if up; then sinfo; squeue; else say "down"; exit 1; fi
    ;;
  clean)
    stop
    rm -rf "$B"
    ;;
  *)
    echo "usage: $0 start|stop|status|env|clean" >&2
    exit 2
    ;;
esac
