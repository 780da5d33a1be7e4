#!/usr/bin/env bash
# slurm_down.sh [STATEDIR] -- stop the SLURM that slurm_up.sh started: cancel
# its jobs, `scontrol shutdown`, then TERM/KILL whatever is still alive by the
# pid files in STATEDIR, and munged only if slurm_up.sh started it. Bounded
# (about 20 s at worst). STATEDIR defaults to the one recorded in
# /etc/slurm/slurm.conf, else $HPCTRAIN_SLURM_STATE, else /tmp/hpctrain-slurm.
# Leaves packages, config and logs in place. Exit 0 when nothing of ours runs.
set -uo pipefail
export PATH=$PATH:/usr/sbin:/sbin

CONF=/etc/slurm/slurm.conf
MARK="# Written by hpctrain tests/slurm/slurm_up.sh"
OURS=0
[ -e "$CONF" ] && grep -qF "$MARK" "$CONF" && OURS=1
RECORDED=""
[ "$OURS" = 1 ] && RECORDED=$(sed -n 's/^# statedir=//p' "$CONF")
STATEDIR=${1:-${RECORDED:-${HPCTRAIN_SLURM_STATE:-/tmp/hpctrain-slurm}}}

# A pid from a pid file counts only if that process still runs the daemon
# named in the file (pids get reused) and is not a zombie awaiting its reaper.
pid_of() {  # pid_of PIDFILE NAME
    local p
    [ -s "$1" ] && p=$(cat "$1") && [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$2" ] && echo "$p"
}
alive() {
    [ -n "$1" ] && [ -r "/proc/$1/stat" ] || return 1
    local st; st=$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)
    [ -n "$st" ] && [ "$st" != Z ]
}
wait_gone() {  # wait_gone SECONDS PID...
    local end=$(( $(date +%s) + $1 )); shift
    while [ "$(date +%s)" -lt "$end" ]; do
        local any=0 p
        for p in "$@"; do alive "$p" && any=1; done
        [ "$any" = 0 ] && return 0
        sleep 0.2
    done
    return 1
}

CTLD=$(pid_of "$STATEDIR/slurmctld.pid" slurmctld)
SLURMD=$(pid_of "$STATEDIR/slurmd.pid" slurmd)
MUNGED=$(pid_of "$STATEDIR/munged.pid" munged)
PIDS=""
for p in $CTLD $SLURMD; do alive "$p" && PIDS="$PIDS $p"; done

if [ -n "$PIDS" ]; then
    # Only talk to the controller when the config is ours: never shut down a real SLURM.
    if [ "$OURS" = 1 ] && alive "$CTLD"; then
        jobs=$(timeout 5 squeue -h -o %i 2>/dev/null)
        [ -n "$jobs" ] && timeout 5 scancel $jobs 2>/dev/null
        timeout 10 scontrol shutdown >/dev/null 2>&1
    fi
    if ! wait_gone 10 $PIDS; then
        for p in $PIDS; do alive "$p" && kill -TERM "$p" 2>/dev/null; done
        if ! wait_gone 5 $PIDS; then
            for p in $PIDS; do alive "$p" && kill -KILL "$p" 2>/dev/null; done
            wait_gone 2 $PIDS
        fi
    fi
fi
if alive "$MUNGED"; then
    kill -TERM "$MUNGED" 2>/dev/null
    wait_gone 5 "$MUNGED" || kill -KILL "$MUNGED" 2>/dev/null
fi
rm -f "$STATEDIR/munged.pid"

left=""
for p in $PIDS; do alive "$p" && left="$left $p"; done
if [ -n "$left" ]; then
    echo "slurm_down: FAILED: still running:$left (state $STATEDIR)" >&2
    exit 1
fi
rm -f "$STATEDIR/slurmctld.pid" "$STATEDIR/slurmd.pid"
echo "slurm_down: stopped (state $STATEDIR)"
