#!/usr/bin/env bash
# netns.sh up N | down -- the simulated cluster's network: N "nodes" on this one
# machine, node hpt-nI a network namespace hpt-TAG-nI (names.sh: TAG is this
# checkout's) with its own eth0 10.79.0.(10+I)/24, joined by veth pairs (host
# end hpt-TAG-vI) on the bridge hpt-TAG-br. The bridge has no address: nothing
# in the root namespace talks to the nodes, so every checkout's cluster can
# use the same addresses on its own bridge.
# Each node gets /etc/netns/hpt-TAG-nI/{hosts,hostname,machine-id} (ip netns
# exec mounts them over /etc) and a boot_id of its own (on.sh mounts it): UCX,
# which MPICH uses, decides "same machine, use shared memory" from boot_id,
# and with the real, shared one no byte would cross the veths.
# Every object created is appended to $HPT_CLUSTER_DIR/created; `down` removes
# exactly those, newest first, and nothing else (it kills no process: stop
# SLURM and jobs first, see slurm.sh). Needs root. About 0.5 s each way.
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin
. "$(dirname "$(readlink -f "$0")")/names.sh"
D=$HPT_CLUSTER_DIR
LOG=$D/created
BR=$HPT_BRIDGE
NET=10.79.0

rec() { echo "$*" >> "$LOG"; }

up() {
    local n=$1 i node ns veth ip4
    [[ $n =~ ^[0-9]+$ ]] && (( n >= 2 && n <= 50 )) || { echo "netns.sh: up N with 2 <= N <= 50" >&2; exit 2; }
    mkdir -p "$D/nodes"; touch "$LOG"
    if ! ip link show "$BR" >/dev/null 2>&1; then ip link add "$BR" type bridge; rec bridge "$BR"; fi
    ip link set "$BR" up
    if [[ ! -d /etc/netns ]]; then mkdir -p /etc/netns; rec dir /etc/netns; fi
    for ((i = 0; i < n; i++)); do
        node=hpt-n$i; ns=$(hpt_netns "$node"); veth=$(hpt_veth "$node"); ip4=$NET.$((10 + i))
        if [[ ! -e /run/netns/$ns ]]; then ip netns add "$ns"; rec netns "$ns"; fi
        if ! ip link show "$veth" >/dev/null 2>&1; then
            ip link add "$veth" type veth peer name eth0 netns "$ns"; rec veth "$veth"
        fi
        ip link set "$veth" master "$BR" up
        ip -n "$ns" link set lo up
        ip -n "$ns" -4 addr show dev eth0 | grep -q " $ip4/" || ip -n "$ns" addr add "$ip4/24" dev eth0
        ip -n "$ns" link set eth0 up
        if [[ ! -d /etc/netns/$ns ]]; then mkdir -p "/etc/netns/$ns"; rec dir "/etc/netns/$ns"; fi
        {   echo "127.0.0.1 localhost"
            for ((j = 0; j < n; j++)); do echo "$NET.$((10 + j)) hpt-n$j"; done
        } > "/etc/netns/$ns/hosts"
        echo "$node" > "/etc/netns/$ns/hostname"
        [[ -s /etc/netns/$ns/machine-id ]] || tr -d - < /proc/sys/kernel/random/uuid > "/etc/netns/$ns/machine-id"
        grep -qx "file /etc/netns/$ns/hosts" "$LOG" || rec file "/etc/netns/$ns/hosts" "/etc/netns/$ns/hostname" "/etc/netns/$ns/machine-id"
        mkdir -p "$D/nodes/$node"
        [[ -s $D/nodes/$node/boot_id ]] || cat /proc/sys/kernel/random/uuid > "$D/nodes/$node/boot_id"
    done
    for _ in $(seq 50); do ip -br link show master "$BR" | grep -q DOWN || break; sleep 0.1; done
    echo "netns.sh: $n nodes up: hpt-n0..hpt-n$((n - 1)) = $NET.10..$NET.$((9 + n)) (namespaces $(hpt_netns hpt-n0)..) on $BR"
}

down() {
    [[ -s $LOG ]] || { echo "netns.sh: nothing to remove"; return 0; }
    local kind names pids
    tac "$LOG" | while read -r kind names; do
        case $kind in
            file)   rm -f -- $names ;;
            dir)    rmdir -- "$names" 2>/dev/null || echo "netns.sh: left non-empty $names" ;;
            veth)   ip link del "$names" 2>/dev/null || true ;;
            netns)  pids=$(ip netns pids "$names" 2>/dev/null | tr '\n' ' ')
                    [[ -z $pids ]] || echo "netns.sh: warning: processes still in $names: $pids"
                    ip netns del "$names" ;;
            bridge) ip link del "$names" 2>/dev/null || true ;;
        esac
    done
    rm -f "$LOG"; rm -rf "$D/nodes"
    echo "netns.sh: torn down"
}

case ${1:-} in
    up) up "${2:-3}" ;;
    down) down ;;
    *) echo "usage: netns.sh up N | down" >&2; exit 2 ;;
esac
