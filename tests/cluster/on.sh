#!/usr/bin/env bash
# on.sh NODE CMD... -- run CMD "on" simulated node NODE (hpt-nI, from netns.sh):
# in its network namespace (hpt-TAG-nI, names.sh; ip netns exec also gives a
# private mount namespace with /etc/netns/hpt-TAG-nI/* over /etc), in a UTS
# namespace of its own whose hostname is NODE, with the node's own boot_id
# mounted over /proc/sys/kernel/random/boot_id. Every step execs, so the pid
# the caller gets is CMD's own and signals and exit codes pass straight through.
# Works from the root namespace and from inside another node.
set -eu
node=${1:?usage: on.sh NODE CMD...}; shift
[[ $# -ge 1 ]] || { echo "usage: on.sh NODE CMD..." >&2; exit 2; }
. "$(dirname "$(readlink -f "$0")")/names.sh"
ns=$(hpt_netns "$node")
[[ $node =~ ^hpt-n[0-9]+$ && -e /run/netns/$ns ]] || { echo "on.sh: no such simulated node: $node" >&2; exit 255; }
export HOSTNAME=$node
exec ip netns exec "$ns" env HPT_BOOT_ID="$HPT_CLUSTER_DIR/nodes/$node/boot_id" \
    unshare --uts sh -c '
        hostname "$0" || exit 255
        mount --bind "$HPT_BOOT_ID" /proc/sys/kernel/random/boot_id || exit 255
        unset HPT_BOOT_ID
        exec "$@"' "$node" "$@"
