"""Run hpctrain.mnist with the parameter servers at the world ranks the test
names, not where --ps-ranks would put them: every rank of a test job is on
one node, where both rules give ranks 0..K-1. A test switch, so it lives
here (as tests/faults/inject_ps.py does), not in production code.

    PS_SERVERS=1,3 mpirun -n 4 python tests/ps_servers_at.py --mode ps --num-ps 2

PS_SERVERS: the servers' world ranks, comma-separated, sorted (--num-ps of them).
test_ps_ranks.py also patches cluster.server_ranks with `servers_at` to build
a Cluster with its servers where the test says.
"""
import os
import sys

# Nothing that loads numpy or MPI here: hpctrain.mnist configures the process
# first. Cluster looks cluster.server_ranks up when it is built (after MPI
# starts), so the function patched now is the one it asks.
from hpctrain.run import cluster
from hpctrain import train as entry


def servers_at(servers):
    """A stand-in for cluster.server_ranks (which Cluster asks) that puts the
    ps servers at `servers`, world ranks, whatever the rule; with no servers
    (ring mode) the rule stands."""
    by_rule = cluster.server_ranks

    def server_ranks(node_of, num_ps, rule):
        if not num_ps:
            return by_rule(node_of, num_ps, rule)
        size = len(node_of)
        if sorted(set(servers)) != list(servers) or not set(servers) <= set(range(size)) \
                or len(servers) != min(num_ps, size):
            raise ValueError(f"servers {servers}: need {num_ps} distinct, sorted ranks of 0..{size - 1}")
        return list(servers)
    return server_ranks


if __name__ == "__main__":
    cluster.server_ranks = servers_at([int(r) for r in os.environ["PS_SERVERS"].split(",")])
    sys.exit(entry.main())
