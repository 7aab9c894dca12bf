#!/usr/bin/env bash
# A real single-node SLURM for the tests of SLURM jobs (tests/strategy/test_slurm.py) and for trying the sbatch
# script of docs/scaling-out.md on one machine: Debian's `slurm-wlm` daemons and `munge` from the OS packages, a
# minimal slurm.conf for this one node (node "localhost", its CPUs and memory, one partition "debug"), munged,
# slurmctld and slurmd started, and a wait until `sinfo` shows the node idle. Idempotent: with the cluster already
# up it checks and exits at once (well under a second).
#
#   bash scripts/setup_slurm.sh          # as root (apt-get installs the packages and the daemons run as root)
#
# Exit codes: 0 the cluster is up; 3 this machine does not allow it (not root, no apt-get, the packages cannot be
# installed): the last line says why and the tests of SLURM jobs skip with that line; 1 it should have worked but
# did not (a daemon did not start, the node never became idle): the last line and the daemons' logs say why.
#
# No cgroups (proctrack/linuxproc, task/none, no accounting): containers rarely let a daemon manage them, and a
# test cluster needs none of it. The daemons run as root (SlurmUser=root): no state folders to hand to a `slurm`
# user. A slurm.conf this script did not write (a machine that has its own SLURM) is never changed: the script
# then only checks that its cluster answers.
set -uo pipefail

MARKER="# written by lightning_rec scripts/setup_slurm.sh"
CONF=${SLURM_CONF:-/etc/slurm/slurm.conf}  # where SLURM's commands and daemons read it
NODE=localhost  # the node's name: what SLURM_NODELIST says, so MASTER_ADDR resolves on any machine
LOG_DIR=/var/log/slurm
DEADLINE=${SLURM_SETUP_TIMEOUT:-60}  # seconds to wait for the node to become idle

say() { echo "setup_slurm: $*"; }
cannot() { say "SLURM cannot be set up on this machine: $*"; exit 3; }
fail() {
    say "SLURM did not come up: $*"
    for log in "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log"; do
        [[ -f $log ]] && { echo "--- last lines of $log"; tail -n 15 "$log"; }
    done
    say "SLURM did not come up: $*"  # again: the tests quote the last line
    exit 1
}

render() {  # the slurm.conf for this node
    cpus=$(nproc)
    memory=$(($(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 * 9 / 10))  # MiB, a margin for the OS
    cat <<EOF
$MARKER
ClusterName=lightning-rec
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
# No cgroups: a container rarely lets a daemon manage them.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
# FIFO, a scheduling pass every second: a requeued job starts as soon as it may (the default pass is every 60 s).
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# The node as configured here, not as slurmd measures it (a container may see the host's CPUs and memory).
SlurmdParameters=config_overrides
ReturnToService=2
# A requeued job waits cred_expire + 1 seconds before it may start again (SLURM's default: 121 s); a job step's
# credential lives as long, plenty for one machine.
AuthInfo=cred_expire=5
KillWait=10
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

node_state() { sinfo --noheader --nodes="$NODE" --format=%T 2>/dev/null | head -n 1; }
ours() { [[ -f $CONF ]] && head -n 1 "$CONF" | grep -qxF "$MARKER"; }
running() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# --- already up, with this configuration: nothing to do --------------------------------------------------------
if command -v sinfo >/dev/null && [[ -f $CONF ]]; then
    state=$(node_state)
    if ! ours; then
        state=$(sinfo --noheader --format=%T 2>/dev/null | head -n 1)
        [[ $state == idle* || $state == mixed* ]] && { say "this machine's own SLURM is up ($state)"; exit 0; }
        cannot "$CONF was not written by this script (this machine has its own SLURM), and its cluster does not answer"
    fi
    if [[ $state == idle* || $state == mixed* || $state == allocated* ]] && render | cmp -s - "$CONF"; then
        say "the cluster is up (node $NODE: $state)"
        exit 0
    fi
fi

# --- the packages ---------------------------------------------------------------------------------------------
if [[ $(id -u) -ne 0 ]]; then
    cannot "installing and starting SLURM's daemons needs root (this is uid $(id -u))"
fi
missing=()
for binary in slurmctld slurmd sinfo munged; do
    command -v "$binary" >/dev/null || missing+=("$binary")
done
if ((${#missing[@]})); then
    command -v apt-get >/dev/null || cannot "no apt-get to install slurm-wlm and munge (missing: ${missing[*]})"
    packages=(slurmctld slurmd slurm-client munge)  # slurm-wlm's daemons and commands, without its extras
    say "installing ${packages[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -q --no-install-recommends "${packages[@]}" >/tmp/setup_slurm.apt.log 2>&1; then
        apt-get update -q >>/tmp/setup_slurm.apt.log 2>&1
        apt-get install -y -q --no-install-recommends "${packages[@]}" >>/tmp/setup_slurm.apt.log 2>&1 ||
            cannot "apt-get install ${packages[*]} failed: $(tail -n 1 /tmp/setup_slurm.apt.log)"
    fi
fi

# --- munge: the daemons' authentication -----------------------------------------------------------------------
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
fi
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged || fail "munged did not start (see /var/log/munge/munged.log)"
    munge -n | unmunge >/dev/null 2>&1 || fail "munge does not answer after munged started"
fi

# --- slurm.conf: this one node --------------------------------------------------------------------------------
if ! [[ -f $CONF ]] || ours; then
    mkdir -p "$(dirname "$CONF")" /var/spool/slurmctld /var/spool/slurmd "$LOG_DIR"
    render >"$CONF.new"
    if ! cmp -s "$CONF.new" "$CONF"; then
        mv "$CONF.new" "$CONF"
        changed=1
    else
        rm "$CONF.new"
    fi
fi

# --- the daemons ----------------------------------------------------------------------------------------------
if [[ -n ${changed:-} ]]; then  # a new configuration: the daemons read it at start
    for pidfile in /run/slurmd.pid /run/slurmctld.pid; do
        if running $pidfile; then
            pid=$(cat $pidfile)
            kill "$pid"
            while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done  # until it is gone (it exits within a second)
        fi
    done
fi
running /run/slurmctld.pid || slurmctld || fail "slurmctld did not start"
running /run/slurmd.pid || slurmd -N "$NODE" || fail "slurmd did not start"

deadline=$((SECONDS + DEADLINE))
while :; do
    state=$(node_state)
    case $state in
        idle* | mixed* | allocated*) break ;;
        down* | drain* | drained*)
            # A node that was down (a restart, a daemon killed) comes back once told; retried until the deadline.
            scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true ;;
    esac
    ((SECONDS < deadline)) || fail "node $NODE is '${state:-not listed}' after ${DEADLINE}s, not idle"
    sleep 0.5  # polling sinfo for the node's state, with the deadline above
done
say "the cluster is up (node $NODE: $state, $(sinfo --noheader --format=%c --nodes="$NODE") CPUs)"
