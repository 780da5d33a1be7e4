#!/usr/bin/env bash
# names.sh -- the names of this checkout's simulated cluster, so that two
# checkouts testing as root on one machine never share a namespace, an
# interface or a state directory. Sourced by the other scripts here; run it
# to see the names:
#   names.sh               HPT_TAG, HPT_CLUSTER_DIR and HPT_BRIDGE as KEY=VALUE lines
#   names.sh netns NODE    the network namespace of node NODE (hpt-nI)
#   names.sh veth NODE     the host end of NODE's veth pair
# The tag is the first 6 hex digits of the SHA-256 of the checkout's
# absolute path. Nodes keep their host names hpt-n0, hpt-n1, ... inside
# (/etc/hosts, SLURM's NodeName, the tests' expectations); what lives in the
# machine's shared name spaces carries the tag: network namespaces
# hpt-TAG-nI, veth host ends hpt-TAG-vI, the bridge hpt-TAG-br (Linux allows
# 15 characters in an interface name: hpt-TAG-v49 has 13), and the state
# directory /tmp/hpctrain-cluster-TAG ($HPT_CLUSTER_DIR overrides it).
_hpt_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
HPT_TAG=$(printf %s "$_hpt_root" | sha256sum | cut -c1-6)
HPT_CLUSTER_DIR=${HPT_CLUSTER_DIR:-/tmp/hpctrain-cluster-$HPT_TAG}
HPT_BRIDGE=hpt-$HPT_TAG-br
# SLURM numbers this cluster's jobs from here: MPICH names a job's shared
# memory after its PMI name (job.step under srun), and /dev/shm is one for
# the whole machine, so two clusters (or the single-node SLURM of
# tests/slurm, numbering from 1) running the same job number at once would
# open one segment. Blocks of 1000 ids, below SLURM's MaxJobId (67043328).
HPT_FIRST_JOB_ID=$(( (1 + 0x${HPT_TAG:0:4} % 60000) * 1000 ))
unset _hpt_root

hpt_netns() { echo "hpt-$HPT_TAG-${1#hpt-}"; }   # hpt-n1 -> hpt-TAG-n1
hpt_veth() { local n=${1#hpt-n}; echo "hpt-$HPT_TAG-v$n"; }
hpt_node() { echo "hpt-${1#hpt-$HPT_TAG-}"; }     # hpt-TAG-n1 -> hpt-n1
# The nodes that are up, by host name, in order (hpt-n0 first).
hpt_nodes() {
    ls /run/netns 2>/dev/null | grep -E "^hpt-$HPT_TAG-n[0-9]+\$" | sort -V |
        while read -r ns; do hpt_node "$ns"; done
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    case ${1:-} in
        "") printf 'HPT_TAG=%s\nHPT_CLUSTER_DIR=%s\nHPT_BRIDGE=%s\nHPT_FIRST_JOB_ID=%s\n' \
                "$HPT_TAG" "$HPT_CLUSTER_DIR" "$HPT_BRIDGE" "$HPT_FIRST_JOB_ID" ;;
        netns) hpt_netns "${2:?names.sh netns NODE}" ;;
        veth) hpt_veth "${2:?names.sh veth NODE}" ;;
        *) echo "usage: names.sh [netns NODE | veth NODE]" >&2; exit 2 ;;
    esac
fi
