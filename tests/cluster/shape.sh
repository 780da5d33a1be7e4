#!/usr/bin/env bash
# shape.sh RATE | off -- make every compute node's link RATE (e.g. 1gbit) in
# both directions with a TBF qdisc (netem is not in every kernel; TBF is), so
# links between nodes are slower than shared memory inside one, as on a real
# cluster: on the host end of the veth for traffic into the node, on the
# node's eth0 for traffic out of it. `off` removes what this put there.
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin
rate=${1:?usage: shape.sh RATE | off}
. "$(dirname "$(readlink -f "$0")")/names.sh"
for node in $(hpt_nodes | grep -vx hpt-n0); do
    ns=$(hpt_netns "$node"); veth=$(hpt_veth "$node")
    tc qdisc del dev "$veth" root 2>/dev/null || true
    ip netns exec "$ns" tc qdisc del dev eth0 root 2>/dev/null || true
    if [ "$rate" != off ]; then
        # burst: enough for a 64 KiB TSO segment plus some; latency bounds the queue.
        tc qdisc add dev "$veth" root tbf rate "$rate" burst 256kb latency 100ms
        ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 100ms
    fi
done
echo "shape.sh: compute node links ${rate/off/unshaped}"
