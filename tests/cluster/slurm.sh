#!/usr/bin/env bash
# slurm.sh up | down | cli CMD... | stop-node NODE | start-node NODE
# A real multi-node SLURM on the simulated cluster of netns.sh (which must be up):
#   munged     in the root netns, own key, own socket under $HPT_CLUSTER_DIR/munge
#              (a unix socket is a path, so every netns reaches it)
#   slurmctld  in hpt-n0, the login node; slurmd in hpt-n1.. (each via on.sh,
#              so it has the node's name, address and boot_id)
# Everything under $HPT_CLUSTER_DIR (names.sh: one per checkout), job ids from
# $HPT_FIRST_JOB_ID; the ports are the usual 6817/6818, each in the cluster's
# own namespaces, so clusters of two checkouts and tests/slurm's SLURM (root
# namespace) do not clash.
# The daemons run through symlinks named hpt-slurmctld/hpt-slurmd, so nobody
# else's `pgrep -x slurmd` mistakes them for its own, and they are stopped by
# the pids in our own pid files (checked against /proc/PID/exe), never by name.
#   cli CMD...        runs a SLURM client in hpt-n0 against this cluster
#                     (srun and slurmstepd connect back to the submitting host
#                     by name: clients must run inside a node)
#   stop-node NODE    kills NODE's slurmd and every process in NODE's netns (its
#                     job steps and ranks): the node fails as when it loses power
#   start-node NODE   starts NODE's slurmd again (it re-registers; ReturnToService=2
#                     puts a node marked down back into service)
# Env: HPT_SLURMD_TIMEOUT (default 5): seconds before slurmctld marks a silent
# node down (it pings every SlurmdTimeout/3 s, so a node that died is down
# about SlurmdTimeout + 2 s later). Needs root and Debian's
# slurmctld/slurmd/slurm-client/munge (installed with apt-get if missing, as
# tests/slurm/slurm_up.sh does).
set -uo pipefail
export PATH=$PATH:/usr/sbin:/sbin
here=$(dirname "$(readlink -f "$0")")
. "$here/names.sh"
D=$HPT_CLUSTER_DIR
S=$D/slurm
CONF=$S/etc/slurm.conf
M=$D/munge

nodes() { hpt_nodes | grep -vx hpt-n0; }
cli() { "$here/on.sh" hpt-n0 env SLURM_CONF="$CONF" "$@"; }
alive() {  # alive PID: running and not a zombie waiting for its reaper
    [ -n "$1" ] && [ -r "/proc/$1/stat" ] || return 1
    [ "$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)" != Z ]
}
pid_of() {  # pid_of PIDFILE EXE: the pid in the file, if that process runs EXE
    local p; [ -s "$1" ] && p=$(cat "$1") && [ "$(readlink "/proc/$p/exe" 2>/dev/null)" = "$2" ] && alive "$p" && echo "$p"
}
stop_pid() {  # stop_pid LABEL PIDFILE EXE
    local p; p=$(pid_of "$2" "$3") || { rm -f "$2"; return 0; }
    kill -TERM "$p" 2>/dev/null
    for _ in $(seq 100); do alive "$p" || break; sleep 0.1; done
    alive "$p" && kill -KILL "$p" 2>/dev/null
    rm -f "$2"
}
# What the daemons' /proc/PID/exe is, resolved when asked: on a fresh machine
# SLURM is installed by `up` below, and Debian's /usr/sbin/slurmd is then a link
# through /etc/alternatives to slurmd-wlm. Resolved before the install, it named
# a path no process runs, so the first slurmd was never recognised as started.
slurmd_exe() { readlink -f /usr/sbin/slurmd; }
ctld_exe() { readlink -f /usr/sbin/slurmctld; }
munged_exe() { readlink -f /usr/sbin/munged; }

start_slurmd() {
    local n=$1
    mkdir -p "$S/$n/spool"
    pid_of "$S/$n/slurmd.pid" "$(slurmd_exe)" >/dev/null && return 0
    "$here/on.sh" "$n" "$D/bin/hpt-slurmd" -f "$CONF" -N "$n" || return 1
    # A first slurmd on a machine probes its plugins and hardware before it
    # writes its pid file: allow it 30 s (a later start takes well under one).
    for _ in $(seq 300); do pid_of "$S/$n/slurmd.pid" "$(slurmd_exe)" >/dev/null && return 0; sleep 0.1; done
    return 1
}

. "$here/../slurm/mpich_segments.sh"   # sweep_dead_mpich_segments

up() {
    local n nodes_list nodelines="" t0=$SECONDS
    mapfile -t nodes_list < <(nodes)
    [ -e "/run/netns/$(hpt_netns hpt-n0)" ] && [ ${#nodes_list[@]} -ge 1 ] || { echo "slurm.sh: run netns.sh up 3 first" >&2; exit 1; }
    if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
        [ -d /var/lib/apt/lists ] && ls /var/lib/apt/lists | grep -q Packages || apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            slurmctld slurmd slurm-client munge >/dev/null || { echo "slurm.sh: cannot install SLURM" >&2; exit 3; }
    fi
    # A clean slate every time: no daemons, job ids or jobs from an earlier session.
    down >/dev/null
    sweep_dead_mpich_segments
    rm -rf "$S"; mkdir -p "$S/etc" "$S/ctld" "$D/bin"
    if ! [ -n "$(pid_of "$M/munged.pid" "$(munged_exe)")" ]; then
        rm -rf "$M"; install -d -o munge -g munge -m 0755 "$M"
        dd if=/dev/urandom of="$M/munge.key" bs=1 count=1024 status=none
        chown munge:munge "$M/munge.key"; chmod 0400 "$M/munge.key"
        runuser -u munge -- /usr/sbin/munged --socket="$M/munge.socket.2" --key-file="$M/munge.key" \
            --pid-file="$M/munged.pid" --log-file="$M/munged.log" --seed-file="$M/munged.seed" \
            || { echo "slurm.sh: munged did not start" >&2; exit 1; }
        for _ in $(seq 50); do [ -S "$M/munge.socket.2" ] && break; sleep 0.1; done
    fi
    for n in "${nodes_list[@]}"; do
        nodelines+="NodeName=$n NodeAddr=$(awk -v n="$n" '$2==n {print $1}' "/etc/netns/$(hpt_netns "$n")/hosts") CPUs=2 State=UNKNOWN"$'\n'
    done
    awk -v dir="$D" -v nodes="${nodelines%$'\n'}" -v nl="$(IFS=,; echo "${nodes_list[*]}")" \
        -v to="${HPT_SLURMD_TIMEOUT:-5}" -v first="$HPT_FIRST_JOB_ID" \
        '{ gsub(/@DIR@/, dir); gsub(/@NODELIST@/, nl); gsub(/@SLURMD_TIMEOUT@/, to); gsub(/@FIRST_JOB_ID@/, first)
           if ($0 == "@NODES@") $0 = nodes; print }' \
        "$here/slurm.conf.in" > "$CONF"
    : > "$S/etc/plugstack.conf"
    # ip netns exec mounts a fresh /sys without cgroups; slurmd 22.05 dies at
    # start unless the (unused: proctrack/linuxproc, task/none) plugin is named.
    printf 'CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n' > "$S/etc/cgroup.conf"
    ln -sfn /usr/sbin/slurmctld "$D/bin/hpt-slurmctld"
    ln -sfn /usr/sbin/slurmd "$D/bin/hpt-slurmd"
    "$here/on.sh" hpt-n0 "$D/bin/hpt-slurmctld" -c -f "$CONF" || { echo "slurm.sh: slurmctld did not start" >&2; exit 1; }
    for _ in $(seq 100); do cli scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
    cli scontrol ping 2>/dev/null | grep -q UP || { echo "slurm.sh: slurmctld is not answering"; tail -5 "$S/ctld/slurmctld.log"; exit 1; }
    for n in "${nodes_list[@]}"; do start_slurmd "$n" || { echo "slurm.sh: slurmd on $n did not start"; tail -5 "$S/$n/slurmd.log"; exit 1; }; done
    for _ in $(seq 150); do
        [ "$(cli sinfo -h -N -o %T 2>/dev/null | grep -cE '^(idle|mixed|allocated)')" = "${#nodes_list[@]}" ] && break
        sleep 0.2
    done
    [ "$(cli sinfo -h -N -o %T 2>/dev/null | grep -cE '^(idle|mixed|allocated)')" = "${#nodes_list[@]}" ] \
        || { echo "slurm.sh: nodes not ready:"; cli sinfo -N; exit 1; }
    echo "slurm.sh: up in $((SECONDS - t0)) s: slurmctld in hpt-n0, slurmd in ${nodes_list[*]}"
}

down() {
    local pf n
    if [ -n "$(pid_of "$S/ctld/slurmctld.pid" "$(ctld_exe)")" ]; then
        jobs=$(cli squeue -h -o %i 2>/dev/null)
        # shellcheck disable=SC2086
        [ -z "$jobs" ] || cli scancel $jobs
    fi
    for pf in "$S"/hpt-n*/slurmd.pid; do [ -e "$pf" ] && stop_pid slurmd "$pf" "$(slurmd_exe)"; done
    stop_pid slurmctld "$S/ctld/slurmctld.pid" "$(ctld_exe)"
    stop_pid munged "$M/munged.pid" "$(munged_exe)"
    # What is left in our nodes (job steps, ranks) goes too: netns.sh down kills nothing.
    for n in $(hpt_nodes); do
        kill_node_processes "$n"
    done
    echo "slurm.sh: down"
}

kill_node_processes() {  # kill_node_processes NODE
    local ns pids
    ns=$(hpt_netns "$1")
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    # shellcheck disable=SC2086
    [ -z "$pids" ] || kill -KILL $pids 2>/dev/null
    for _ in $(seq 50); do [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && return 0; sleep 0.1; done
}

case ${1:-} in
    up) up ;;
    down) down ;;
    cli) shift; cli "$@" ;;
    stop-node) kill_node_processes "${2:?stop-node NODE}"; rm -f "$S/$2/slurmd.pid"; sweep_dead_mpich_segments; echo "slurm.sh: $2 stopped" ;;
    start-node) start_slurmd "${2:?start-node NODE}" && echo "slurm.sh: slurmd on $2 started" ;;
    *) echo "usage: slurm.sh up | down | cli CMD... | stop-node NODE | start-node NODE" >&2; exit 2 ;;
esac
