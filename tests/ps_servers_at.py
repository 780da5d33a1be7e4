"""Run hpctrain.mnist with the parameter servers at the world ranks the test
names, not where --ps-ranks would put them: every rank of a test job is on
one node, where both rules give ranks 0..K-1. A test switch, so it lives
here (as tests/faults/inject_ps.py does), not in production code.

    PS_SERVERS=1,3 mpirun -n 4 python tests/ps_servers_at.py --mode ps --num-ps 2

PS_SERVERS: the servers' world ranks, comma-separated, sorted (--num-ps of them).
"""
import os
import sys

# Nothing that loads numpy or MPI here: hpctrain.mnist configures the process
# first. Session imports cluster.Cluster later (after MPI starts), so the
# class patched now is the one it builds.
from hpctrain import cluster, mnist

SERVERS = [int(r) for r in os.environ["PS_SERVERS"].split(",")]


class ServersAt(cluster.Cluster):
    def __init__(self, comm, mode="ring", num_ps=0, ps_rule="spread", servers=None):
        super().__init__(comm, mode, num_ps, ps_rule, servers=SERVERS if mode == "ps" else servers)


if __name__ == "__main__":
    cluster.Cluster = ServersAt
    sys.exit(mnist.main())
