"""Where the ranks of a communicator are: which share a node, how many nodes,
the host of every rank. Built once (collective) and handed to the allreduce
factory (comm/__init__.py), so strategies that care about nodes (a
hierarchical allreduce: inside a node, then across node leaders; a sharded
optimizer update) can be added without changing how strategies are made.

The node is MPI's shared-memory split (Split_type(COMM_TYPE_SHARED)), the
truth whatever host names or the launcher say; host names are for messages,
gathered as fixed-width byte records (no pickle).

    with Topology(comm) as topology:
        strategy = make_allreduce("ring", topology, np)
    mpirun -n 3 python -m hpctrain.comm.topology      # prints each rank's place

Tests on one machine stand in for several nodes with a real split given as
`node_comm` (Topology(comm, node_comm=comm.Split(rank // 2, rank))): the
node-aware code then runs exactly as on a cluster. Production code never
passes it, so a run always sees MPI's shared-memory truth.
"""
import socket

import numpy as np
from mpi4py import MPI

from .records import allgather_bytes

HOST_BYTES = 64


def nodes_of(comm, node_comm):
    """The node index of every rank of comm, the same list on every rank:
    nodes numbered 0, 1, ... in the order of their lowest rank. node_comm:
    this rank's node, split from comm by COMM_TYPE_SHARED with key=rank (so
    its rank 0 is the node's lowest). Collective over comm."""
    leader = np.array([comm.Get_rank()], np.int64)
    node_comm.Bcast(leader, root=0)
    leaders = np.empty(comm.Get_size(), np.int64)
    comm.Allgather(leader, leaders)
    index = {first: i for i, first in enumerate(sorted(set(leaders.tolist())))}
    return [index[first] for first in leaders.tolist()]


class Topology:
    """comm: the communicator (not duplicated, not freed here); rank, size;
    node_comm: the ranks on this node (created here: free() it); local_rank,
    local_size: this rank within its node; node_of: the node index of every
    rank (nodes numbered by their lowest rank); node: this rank's node;
    num_nodes; local_sizes: the ranks on each node; hosts: every rank's host
    name. Collective to build over comm.

    node_comm: the nodes given instead of found (tests: a split of comm,
    ordered by rank within each part); taken over, freed by free()."""

    def __init__(self, comm, node_comm=None):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        if node_comm is None:
            node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.node_comm = node_comm
        self.local_rank, self.local_size = self.node_comm.Get_rank(), self.node_comm.Get_size()
        self.node_of = nodes_of(comm, self.node_comm)
        self.node = self.node_of[self.rank]
        self.num_nodes = max(self.node_of) + 1
        self.local_sizes = [self.node_of.count(i) for i in range(self.num_nodes)]
        self.hosts = allgather_bytes(comm, socket.gethostname(), HOST_BYTES)

    @property
    def is_leader(self):
        """The lowest rank of its node."""
        return self.local_rank == 0

    @property
    def equal_nodes(self):
        """Every node has as many ranks as every other (a hierarchical allreduce needs it)."""
        return len(set(self.local_sizes)) == 1

    def by_node(self):
        """The ranks of comm ordered by node, then by rank: a ring in this
        order crosses each node boundary once per direction, wherever the
        launcher placed the ranks (round-robin placement would cross at every hop)."""
        return sorted(range(self.size), key=lambda r: (self.node_of[r], r))

    def free(self):
        """Free the communicators created here (collective over comm)."""
        if self.node_comm is not None:
            self.node_comm.Free()
            self.node_comm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()
        return False

    def __repr__(self):
        return (f"Topology(rank {self.rank}/{self.size}, node {self.node}/{self.num_nodes} "
                f"on {self.hosts[self.rank]}, local {self.local_rank}/{self.local_size})")


if __name__ == "__main__":
    with Topology(MPI.COMM_WORLD) as t:
        print(t, flush=True)
