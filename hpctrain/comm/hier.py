"""Hierarchical allreduce (`--allreduce hier`): inside each node, then across
nodes, then inside each node again — Horovod's hierarchical allreduce, and
what NCCL does across nodes.

With M nodes of L ranks each:
1. reduce-scatter inside the node (a ring over the node's communicator, shared
   memory): local rank l ends with chunk (l+1) mod L of the buffer, summed
   over its node;
2. allreduce of that chunk across nodes (a ring over the M ranks that have
   the same local rank, one per node, ordered by node): summed over everyone;
3. allgather inside the node: every rank gets every chunk.
Each node sends 2(M-1)/M of the buffer over its link (its L inter-node rings
each carry 1/L of it, in parallel), against 2(N-1)/N for a flat ring over
all N = M*L ranks, and the inter-node ring has 2(M-1) steps, not 2(N-1).
The intra-node ring's traffic stays in shared memory.

The strategy interface (comm/strategy.py) in two levels: reduce_scatter is
the node's reduce-scatter then the inter-node ring's reduce-scatter of the
node chunk, so this rank owns a sub-slice of its node chunk, summed over all
ranks; ranks with different local ranks own different node chunks, ranks
with the same local rank own different sub-slices of the same chunk: the
parts are disjoint and cover the buffer (the sharded optimizer needs this).
allgather undoes it in reverse order. `shard(n)` computes the same range
without communication.

One node (M = 1): the inter-node ring has one rank and does nothing; hier is
the node's ring, which is then the flat ring in rank order, bit for bit.
Unequal ranks per node: the factory (comm/__init__.py) uses the node-ordered
flat ring instead and says so. NumPy or CuPy buffers, as ring.py (the rings
do the device syncs); the factory wraps it for CuPy exactly as it wraps the ring.
`waits` goes to both rings: hpctrain.dist's napping exchanges where ranks
outnumber cores (ring_allreduce.py says why), the same messages and adds,
the same bits.

    mpirun -n 4 python -m hpctrain.comm.hier       # self-check on a fake 2-node split
"""
from .ring_allreduce import RingAllreduce


class HierAllreduce:
    """Allreduce over topology.comm in two levels (topology: comm/topology.py,
    equal ranks per node). Collective to build; `free()` releases the
    communicators. Every wait is inside one of the two rings, each bounded by
    the watchdog and naming world ranks. waits: both rings' (RingAllreduce's)."""

    name = "hier"

    def __init__(self, topology, watchdog=None, waits=None):
        if not topology.equal_nodes:
            raise ValueError(f"hier needs equal ranks per node, got {topology.local_sizes}")
        comm = topology.comm
        self.size, self.rank = topology.size, topology.rank
        self.num_nodes, self.local_size = topology.num_nodes, topology.local_size
        self.intra = RingAllreduce(topology.node_comm, watchdog, label="hier intra-node ring", waits=waits)
        # One inter-node ring per local rank, its members in node order.
        cross = comm.Split(topology.local_rank, key=topology.node)
        try:
            self.inter = RingAllreduce(cross, watchdog, label="hier inter-node ring", waits=waits)
        finally:
            cross.Free()   # the ring keeps its own duplicate

    def shard(self, n):
        a, b = self.intra.shard(n)
        c, d = self.inter.shard(b - a)
        return a + c, a + d

    def parts(self, n):
        # Each node chunk is cut again by the inter-node ring (shard's two levels).
        return [(a + c, a + d) for a, b in self.intra.parts(n) for c, d in self.inter.parts(b - a)]

    def allreduce(self, buf):
        if self.size == 1 or buf.size == 0:
            return buf
        a, b = self.intra.reduce_scatter(buf)
        self.inter.allreduce(buf[a:b])
        self.intra.allgather(buf)
        return buf

    def reduce_scatter(self, buf):
        if self.size > 1 and buf.size > 0:
            a, b = self.intra.reduce_scatter(buf)
            self.inter.reduce_scatter(buf[a:b])
        return self.shard(buf.size)

    def allgather(self, buf):
        if self.size > 1 and buf.size > 0:
            a, b = self.intra.shard(buf.size)
            self.inter.allgather(buf[a:b])
            self.intra.allgather(buf)
        return buf

    def free(self):
        """Release both rings' communicators (collective over topology.comm)."""
        self.intra.free()
        self.inter.free()


if __name__ == "__main__":
    from mpi4py import MPI

    from .strategy import self_check
    from .topology import Topology
    world = MPI.COMM_WORLD
    # Two ranks per "node" (a real split standing in for nodes), and the real nodes.
    with Topology(world, node_comm=world.Split(world.rank // 2, world.rank)) as fake:
        if fake.equal_nodes:
            self_check(HierAllreduce(fake), f"hier allreduce, {fake.num_nodes} fake node(s) of {fake.local_size}")
    with Topology(world) as real:
        if real.equal_nodes:
            self_check(HierAllreduce(real), f"hier allreduce, {real.num_nodes} real node(s)")
