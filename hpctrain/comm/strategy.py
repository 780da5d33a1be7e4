"""The one interface every allreduce strategy has, and what they share.

A strategy sums contiguous 1-D arrays across the ranks of a communicator:

    allreduce(buf)       in place: every rank ends with the elementwise sum
    reduce_scatter(buf)  -> (lo, hi): buf[lo:hi] is this rank's part, fully
                         summed; the rest of buf is scratch (partial sums)
    allgather(buf)       every rank's part (buf[lo:hi] as reduce_scatter left
                         it) to everyone: the inverse of reduce_scatter's layout
    shard(n)             -> (lo, hi) this rank owns in a buffer of n elements
                         (known before any call, e.g. for a sharded update)
    parts(n)             -> [(lo, hi)] every rank's shard(n), in buffer order:
                         the partition itself (a rank holding the whole sum
                         computes per part what each owner computes on its
                         own: comm/grad_norm.py's sum of squares)

reduce_scatter followed by allgather equals allreduce. Parts are near-equal
(hpctrain/base/chunks.py); which rank owns which part is the strategy's own business
(the ring's rank r owns chunk r+1, MPI's Reduce_scatter gives rank r chunk r),
so always ask `shard`. Parts may be empty when a buffer is shorter than the
communicator. Attributes: `name`, `size`, `rank`.

Implementations: ring.py, mpi.py, nccl.py (flat, over one communicator);
hier.py (two rings: inside each node, then across nodes); staged.py wraps
any of the host ones for device buffers.

    python -m pytest -q tests/test_ring.py    # and under mpirun, see there
"""
from .deadline import NO_WATCHDOG

from ..base.chunks import chunk_bounds, chunk_parts


def waiting(watchdog, what, peer=None):
    """The watchdog's deadline around one blocking wait (None: no deadline,
    for the callers whose watchdog is optional)."""
    return (watchdog or NO_WATCHDOG).waiting(what, peer=peer)


def world_ranks(comm):
    """COMM_WORLD's rank of each rank of comm, in comm's order. Messages name
    these: a rank of a reordered or split communicator (a node-ordered ring,
    a node's ring) means nothing to whoever reads the line. Local, no messages."""
    from mpi4py import MPI
    mine, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return [int(r) for r in MPI.Group.Translate_ranks(mine, list(range(comm.Get_size())), world)]
    finally:
        mine.Free()
        world.Free()


class FlatStrategy:
    """Base of the strategies over one communicator, which they duplicate so
    their messages never match anyone else's. Subclasses give `name`,
    `owned_chunk()` and the three operations. `rank` is the position in comm
    (what ownership follows); `world_ranks` names peers in messages."""

    name = "?"

    def __init__(self, comm, watchdog=NO_WATCHDOG):
        from . import ulfm   # (MPI's import, here once MPI runs)
        self.comm = ulfm.made(comm.Dup())   # (revoked after a lost rank: --on-failure shrink)
        self.size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()
        self.world_ranks = world_ranks(self.comm)
        self.watchdog = watchdog or NO_WATCHDOG

    def owned_chunk(self):
        """Index of the chunk (of chunk_bounds(n, size)) this rank owns."""
        return self.rank

    def shard(self, n):
        bounds = chunk_bounds(n, self.size)
        k = self.owned_chunk()
        return bounds[k], bounds[k + 1]

    def parts(self, n):
        # Whoever owns which chunk, the chunks are the same ones.
        return chunk_parts(n, self.size)

    def waiting(self, what, peer=None):
        """peer: positions in comm (an int or a list), named as world ranks."""
        if isinstance(peer, int):
            peer = self.world_ranks[peer]
        elif isinstance(peer, (list, tuple, set)):
            peer = sorted(self.world_ranks[p] for p in peer)
        return self.watchdog.waiting(what, peer=peer)

    def free(self):
        """Release the duplicated communicator (collective)."""
        if self.comm is not None:
            self.comm.Free()
            self.comm = None


class WrappedStrategy:
    """Base of a strategy that wraps another, `inner` (staged.py, and
    device_buffers.BoundToDevice): size, rank and the partition (shard,
    parts) are the inner's; the subclass gives the three operations."""

    def __init__(self, inner):
        self.inner = inner
        self.size = inner.size
        self.rank = getattr(inner, "rank", 0)

    def shard(self, n):
        return self.inner.shard(n)

    def parts(self, n):
        return self.inner.parts(n)


def self_check(strategy, name):
    """A strategy's `python -m` check: allreduce of full(n, rank) gives
    sum(range(size)), and reduce_scatter + allgather gives the same buffer,
    for lengths 0, 1, below the world size, odd and large."""
    import numpy as np

    from ..base.precision import FLOAT32
    expect = sum(range(strategy.size))
    for n in (0, 1, strategy.size - 1, 7, 1000, 1 << 20):
        x = np.full(n, strategy.rank, dtype=FLOAT32.grads)
        y = x.copy()
        strategy.allreduce(x)
        assert np.all(x == expect), (n, x[:5])
        lo, hi = strategy.reduce_scatter(y)
        assert np.all(y[lo:hi] == expect), (n, lo, hi)
        strategy.allgather(y)
        assert np.array_equal(x, y), n
    if strategy.rank == 0:
        print(f"{name}, reduce-scatter + allgather OK on {strategy.size} ranks")
