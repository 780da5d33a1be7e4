"""Topology (comm/topology.py): nodes from MPI's shared-memory split, every
rank's host, and the communicators it made freed. Expectations are computed
from what every rank reports, so the file passes on one node or many.

    python -m pytest -q tests/test_topology.py
    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_topology.py
"""
import socket

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.comm.topology import Topology

COMMS = [pytest.param(MPI.COMM_SELF, id="self"), pytest.param(MPI.COMM_WORLD, id="world")]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("comm", COMMS)
def test_nodes_ranks_and_hosts_agree(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    with Topology(comm) as t:
        assert t.comm is comm and (t.rank, t.size) == (rank, size)
        assert len(t.node_of) == size and t.node == t.node_of[rank]
        assert t.num_nodes == len(set(t.node_of)) and sorted(set(t.node_of)) == list(range(t.num_nodes))
        same_node = [r for r in range(size) if t.node_of[r] == t.node]
        assert t.local_size == len(same_node) and t.local_rank == same_node.index(rank)
        assert t.is_leader == (rank == same_node[0])
        assert t.hosts[rank] == socket.gethostname()[:64] and len(t.hosts) == size
        assert all(t.hosts[r] == t.hosts[rank] for r in same_node)
        # Every rank sees the same map.
        mine = np.array(t.node_of, np.int64)
        first = mine.copy()
        comm.Bcast(first, root=0)
        assert np.array_equal(mine, first)
    assert t.node_comm is None   # freed on exit
    t.free()                     # and freeing twice is harmless
