#!/usr/bin/env bash
# slurm_up.sh [STATEDIR] -- bring up a real single-node SLURM on this machine
# for the tests: munged, slurmctld and slurmd started by hand (no systemd),
# state and logs under STATEDIR (default $HPCTRAIN_SLURM_STATE or
# /tmp/hpctrain-slurm). Needs root. Installs slurmctld/slurmd/slurm-client/munge
# with apt-get only when they are missing. Idempotent: when the SLURM this
# script started is up with the same config, it says so and exits 0 at once.
#
# Environment: HPCTRAIN_SLURM_CPUS (CPUs the node advertises, default 4),
# HPCTRAIN_SLURM_WAIT (seconds to wait for the node to go idle, default 30),
# HPCTRAIN_SLURM_PMIX=1 (srun --mpi=pmix for Open MPI: SLURM's PMIx plugin
# dlopens <pmix dir>/libpmix.so, which on Debian only libpmix-dev has, not
# libpmix2; installed if missing, and a slurmd that started without it, and so
# cannot load the plugin, is restarted).
#
# Exit codes: 0 up; 1 daemons failed to come up; 2 not root;
# 3 packages missing and could not be installed; 4 /etc/slurm/slurm.conf
# exists and was not written by this script (refuses to touch a real SLURM).
# The last line printed always says which.
set -uo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
STATEDIR=${1:-${HPCTRAIN_SLURM_STATE:-/tmp/hpctrain-slurm}}
CPUS=${HPCTRAIN_SLURM_CPUS:-4}
WAIT_S=${HPCTRAIN_SLURM_WAIT:-30}
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
MARK="# Written by hpctrain tests/slurm/slurm_up.sh"
NODE=$(hostname -s)
T0=$(date +%s.%N)

elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'; }

log_tails() {
    local f
    for f in "$STATEDIR"/slurmctld.log "$STATEDIR"/slurmd.log "$STATEDIR"/*.stderr \
             /var/log/munge/munged.log; do
        [ -s "$f" ] || continue
        echo "---- tail $f" >&2
        tail -n 15 "$f" >&2
    done
}

fail() {  # fail CODE MESSAGE [--logs]
    local code=$1 msg=$2
    [ "${3:-}" = --logs ] && log_tails
    echo "slurm_up: FAILED after $(elapsed) s: $msg" >&2
    exit "$code"
}

[ "$(id -u)" -eq 0 ] || fail 2 "needs root (starts munged/slurmctld/slurmd, writes $CONF)"
case $STATEDIR in /*) ;; *) STATEDIR=$PWD/$STATEDIR ;; esac

# ---- packages -------------------------------------------------------------
have_all() {
    local c
    for c in sbatch srun sinfo scontrol slurmctld slurmd munged munge unmunge; do
        command -v "$c" >/dev/null 2>&1 || [ -x "/usr/sbin/$c" ] || return 1
    done
}
export PATH=$PATH:/usr/sbin:/sbin
WANT_PMIX=${HPCTRAIN_SLURM_PMIX:-0}
have_pmix() { [ "$WANT_PMIX" != 1 ] || ls /usr/lib/*/pmix*/lib/libpmix.so >/dev/null 2>&1; }
if ! have_all || ! have_pmix; then
    command -v apt-get >/dev/null 2>&1 || fail 3 "SLURM is not installed and there is no apt-get"
    export DEBIAN_FRONTEND=noninteractive
    PKGS="slurmctld slurmd slurm-client munge"
    [ "$WANT_PMIX" = 1 ] && PKGS="$PKGS libpmix-dev"
    echo "slurm_up: installing $PKGS with apt-get" >&2
    # No package lists yet (fresh image): update first; otherwise try the
    # cached lists and update only if that fails (stale lists give 404s).
    if ! ls /var/lib/apt/lists/*_Packages* >/dev/null 2>&1; then
        timeout 300 apt-get update -q -o DPkg::Lock::Timeout=120 >"${TMPDIR:-/tmp}/slurm_up.apt.log" 2>&1
    fi
    if ! timeout 600 apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=120 $PKGS >>"${TMPDIR:-/tmp}/slurm_up.apt.log" 2>&1; then
        timeout 300 apt-get update -q -o DPkg::Lock::Timeout=120 >>"${TMPDIR:-/tmp}/slurm_up.apt.log" 2>&1
        timeout 600 apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=120 $PKGS >>"${TMPDIR:-/tmp}/slurm_up.apt.log" 2>&1 || {
            tail -n 15 "${TMPDIR:-/tmp}/slurm_up.apt.log" >&2
            fail 3 "apt-get install $PKGS failed (log: ${TMPDIR:-/tmp}/slurm_up.apt.log)"
        }
    fi
    have_all || fail 3 "installed $PKGS but the SLURM/munge commands are still missing"
    have_pmix || fail 3 "installed $PKGS but there is still no libpmix.so for SLURM's PMIx plugin"
fi

# ---- config ----------------------------------------------------------------
# Why each key is set: see tests/slurm/README.md.
gen_conf() {
    cat <<EOF
$MARK -- do not edit; rewritten on config change.
# statedir=$STATEDIR
ClusterName=hpctrain-test
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
EnforcePartLimits=ALL
ReturnToService=2
SlurmdTimeout=30
SlurmctldTimeout=30
MessageTimeout=10
InactiveLimit=0
KillWait=2
MinJobAge=5
JobRequeue=1
PreemptMode=OFF
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
MailProg=/bin/true
StateSaveLocation=$STATEDIR/ctld
SlurmdSpoolDir=$STATEDIR/slurmd
SlurmctldPidFile=$STATEDIR/slurmctld.pid
SlurmdPidFile=$STATEDIR/slurmd.pid
SlurmctldLogFile=$STATEDIR/slurmctld.log
SlurmdLogFile=$STATEDIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}
NEW_CONF=$(gen_conf)

if [ -e "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    fail 4 "$CONF exists and was not written by this script; refusing to touch a real SLURM"
fi

# pid_alive PIDFILE: the daemon named by the file (slurmctld.pid -> slurmctld)
# runs under that pid, and is not a zombie (pid 1 here may reap slowly).
pid_alive() {
    local p name st
    [ -s "$1" ] && p=$(cat "$1") || return 1
    name=$(basename "$1" .pid)
    [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$name" ] || return 1
    st=$(sed 's/^.*) //' "/proc/$p/stat" 2>/dev/null | cut -c1)
    [ -n "$st" ] && [ "$st" != Z ]
}
munge_ok() { timeout 5 munge -n 2>/dev/null | timeout 5 unmunge >/dev/null 2>&1; }
node_state() { timeout 5 sinfo -h -o %t 2>/dev/null | head -n 1; }

# A slurmd started before libpmix.so existed has no PMIx plugin until restarted.
pmix_ok() { [ "$WANT_PMIX" != 1 ] || ! grep -q "can not load PMIx library" "$STATEDIR/slurmd.log" 2>/dev/null; }
if [ -e "$CONF" ] && [ "$(cat "$CONF")" = "$NEW_CONF" ] \
   && pid_alive "$STATEDIR/slurmctld.pid" && pid_alive "$STATEDIR/slurmd.pid" && munge_ok && pmix_ok; then
    case $(node_state) in
        idle|mix|alloc|comp)
            echo "slurm_up: already up: node $NODE $(node_state), CPUs=$CPUS, state $STATEDIR"
            exit 0 ;;
    esac
fi

# Something of ours is there but not healthy, or the config changed: restart.
if [ -e "$CONF" ]; then
    OLD_STATEDIR=$(sed -n 's/^# statedir=//p' "$CONF")
    "$HERE/slurm_down.sh" "${OLD_STATEDIR:-$STATEDIR}" >/dev/null || true
    [ "$OLD_STATEDIR" != "$STATEDIR" ] && "$HERE/slurm_down.sh" "$STATEDIR" >/dev/null || true
fi

mkdir -p "$CONF_DIR" "$STATEDIR/ctld" "$STATEDIR/slurmd"
rm -f "$STATEDIR"/*.log "$STATEDIR"/*.stderr
printf '%s\n' "$NEW_CONF" >"$CONF.tmp" && mv "$CONF.tmp" "$CONF"

# ---- munge -------------------------------------------------------------------
KEY=/etc/munge/munge.key
id munge >/dev/null 2>&1 || fail 1 "no 'munge' user (is the munge package installed?)"
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s "$KEY" ]; then
    if command -v mungekey >/dev/null 2>&1; then
        runuser -u munge -- mungekey --create --keyfile="$KEY" 2>/dev/null \
            || dd if=/dev/urandom of="$KEY" bs=1 count=1024 status=none
    else
        dd if=/dev/urandom of="$KEY" bs=1 count=1024 status=none
    fi
fi
chown munge:munge "$KEY" && chmod 0400 "$KEY"
if munge_ok; then
    :   # someone's munged is already serving; use it, do not own it
else
    rm -f "$STATEDIR/munged.pid"
    # As the munge user like the init script does; as root only with --force.
    runuser -u munge -- munged >"$STATEDIR/munged.stderr" 2>&1 \
        || munged --force >>"$STATEDIR/munged.stderr" 2>&1 \
        || fail 1 "munged did not start" --logs
    for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
    munge_ok || fail 1 "munged started but munge -n | unmunge fails" --logs
    cp /run/munge/munged.pid "$STATEDIR/munged.pid" 2>/dev/null   # ours: slurm_down stops it
fi

. "$HERE/mpich_segments.sh"   # sweep_dead_mpich_segments
sweep_dead_mpich_segments

# ---- slurmctld, slurmd --------------------------------------------------------
# -c: cold start. Jobs left over from an earlier, killed session must not be
# recovered (and, with JobRequeue=1, re-run) in a fresh test session.
slurmctld -c >"$STATEDIR/slurmctld.stderr" 2>&1 || fail 1 "slurmctld exited with $?" --logs
for _ in $(seq 50); do pid_alive "$STATEDIR/slurmctld.pid" && break; sleep 0.1; done
pid_alive "$STATEDIR/slurmctld.pid" || fail 1 "slurmctld did not stay up" --logs
slurmd >"$STATEDIR/slurmd.stderr" 2>&1 || fail 1 "slurmd exited with $?" --logs

state=""
deadline=$(( $(date +%s) + WAIT_S ))
while [ "$(date +%s)" -lt "$deadline" ]; do
    state=$(node_state)
    case $state in idle|mix|alloc) break ;; esac
    pid_alive "$STATEDIR/slurmctld.pid" || fail 1 "slurmctld died" --logs
    pid_alive "$STATEDIR/slurmd.pid" || [ ! -s "$STATEDIR/slurmd.pid" ] || fail 1 "slurmd died" --logs
    sleep 0.2
done
case $state in
    idle|mix|alloc)
        echo "slurm_up: up in $(elapsed) s: node $NODE $state, CPUs=$CPUS, partition debug, conf $CONF, state $STATEDIR" ;;
    *)  fail 1 "node $NODE not idle after ${WAIT_S} s (sinfo state: '${state:-no answer}')" --logs ;;
esac
