"""The ps exchange through shared memory: on one node, every worker's flat
gradient buffer and every server's parameter slice (and its per-worker reply
buffers) live in one MPI-3 shared-memory window over the node's ranks
(MPI_Win_allocate_shared). A push then moves no bytes: the server reads the
worker's gradient where backprop wrote it. A pull is one copy: the worker
copies the server's slice into its own parameters. Headers still go as MPI
messages, and carry the order: the sender calls MPI_Win_sync before its
header, the receiver after it (the MPI-3 "passive target epoch, Win_sync,
point-to-point" pattern for shared memory).

    mpirun -n 4 python -m hpctrain.mnist --mode ps --num-ps 2                     # auto: shared memory
    mpirun -n 4 python -m hpctrain.mnist --mode ps --num-ps 2 --ps-exchange mpi   # messages only

Why: as messages, each worker's 2.6 MB goes each way through MPICH's
shared-memory cells, copied in by the sender and out by the receiver, in
chunks both processes must be running for. With 4 ranks on 2 cores they
often are not, and a round waited on that more than on its work.

Who takes part (`open_shared`, collective over the node's communicator): the
ranks of a node that has a server and a worker, when every worker there is
a NumPy worker (a GPU worker's buffers are device memory: it keeps the
messages) and /dev/shm has room. Every rank of the node makes the same
choice; a pair on two nodes always uses messages. Where a node could but
does not, the chief's line says why.

Lifetime: the window lives until MPI_Finalize (or MPI_Abort), which frees
what is left (MPICH and Open MPI both do). `close()` only ends this rank's
access epoch: MPI_Win_free is collective over the node, and the ways out of
a run do not meet at one point (a save that failed on the chief ends the
workers with an error while the servers are done; a worker left behind never
comes back), so a free there could wait for a rank that has left. A worker's
model computes in its part until the process ends.
"""
import math
import os

import numpy as np
from mpi4py import MPI

from ..deadline import NO_WATCHDOG

SHM_DIR = "/dev/shm"
SHM_HEADROOM = 1.25     # room asked of /dev/shm beyond the window itself


def shm_room(path=SHM_DIR):
    """Bytes free for shared memory on this node (None: unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def segment_floats(is_ps, num_params, server_size, num_workers, reply_bufs):
    """This rank's part of the window: a worker's whole gradient buffer; a
    server's slice, then (reply_bufs) one reply buffer per worker."""
    if not is_ps:
        return num_params
    return server_size * (1 + (num_workers if reply_bufs else 0))


def open_shared(cluster, *, enabled, able, num_params, server_sizes, reply_bufs, dtype, watchdog=NO_WATCHDOG,
                room=shm_room):
    """(the node's SharedExchange or None, why not): where the node uses
    messages, `why` says so in words for the chief's line ("" when the flag or
    the node's roles decided). Collective over cluster.local_comm (every rank
    of the node calls it).

    Beyond communicators this takes the run's Cluster (hpctrain/run/cluster.py):
    the choice is the node's, so it needs every rank's node (node_of) and
    role (ps_ranks), the number of workers and the node communicator, which
    the Cluster holds together.

    enabled: --ps-exchange auto (False: mpi); able: this rank can take part
    (a NumPy worker, or a server); server_sizes: each server's slice length;
    reply_bufs: servers keep one reply buffer per worker (async, backups)."""
    local = cluster.local_comm
    mine = [r for r in range(cluster.size) if cluster.node_of[r] == cluster.node_of[cluster.rank]]
    roles = {r in cluster.ps_ranks for r in mine}
    if not enabled or roles != {True, False}:    # same on every rank of the node: no agreement needed
        return None, ""
    W = cluster.num_workers
    sizes = [segment_floats(r in cluster.ps_ranks, num_params,
                            server_sizes[cluster.ps_ranks.index(r)] if r in cluster.ps_ranks else 0, W, reply_bufs)
             for r in mine]
    need, free = sum(sizes) * np.dtype(dtype).itemsize * SHM_HEADROOM, room()
    vote = np.array([1 if able else 0, 1 if free is None or need <= free else 0], np.int32)
    with watchdog.waiting("shared-memory exchange: agreement on the node", peer=mine):
        local.Allreduce(MPI.IN_PLACE, vote, op=MPI.MIN)
    if not vote[0]:
        return None, "a worker on this node is a GPU worker (device buffers go as messages)"
    if not vote[1]:
        return None, (too_little_room(need, free) if free is not None else
                      f"{SHM_DIR} on another rank of this node has too little room for the window")
    return SharedExchange(local, mine, sizes[mine.index(cluster.rank)], dtype, watchdog), ""


def too_little_room(need, free):
    """The fallback's words for need > free bytes: need rounded up and free
    down to 0.1 MB, so the need always reads as more than what is free."""
    up, down = math.ceil(need / 2**20 * 10) / 10, math.floor(free / 2**20 * 10) / 10
    return (f"{SHM_DIR} on this node has too little room for the window ({up:,.1f} MB "
            f"with headroom; {down:,.1f} MB free here)")


class SharedExchange:
    """One node's window. ranks: the node's world ranks, in node-rank order
    (the node communicator is split with key = world rank); floats: this
    rank's part, in elements of dtype (the run's precision.params)."""

    def __init__(self, local_comm, ranks, floats, dtype, watchdog=NO_WATCHDOG):
        self.ranks, self.dtype = list(ranks), np.dtype(dtype)
        item = self.dtype.itemsize
        self.watchdog = watchdog
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")   # each rank's part page-aligned, on its own NUMA node
        with watchdog.waiting("shared-memory exchange: allocating the window", peer=self.ranks):
            self.win = MPI.Win.Allocate_shared(max(1, floats) * item, item, info=info, comm=local_comm)
        info.Free()
        self.win.Lock_all(MPI.MODE_NOCHECK)    # one passive epoch for the whole run: Win_sync needs one
        self._parts = {}

    def on_node(self, rank):
        return rank in self.ranks

    def part(self, rank):
        """The whole segment of world rank `rank` (on this node), as the window's dtype."""
        if rank not in self._parts:
            mem, _ = self.win.Shared_query(self.ranks.index(rank))
            self._parts[rank] = np.frombuffer(mem, self.dtype)
        return self._parts[rank]

    def worker_grads(self, rank, num_params):
        """A worker's flat gradient buffer (its model computes into it)."""
        return self.part(rank)[:num_params]

    def server_params(self, rank, size):
        return self.part(rank)[:size]

    def server_reply_bufs(self, rank, size, num_workers):
        return self.part(rank)[size: size * (1 + num_workers)].reshape(num_workers, size)

    def sync(self):
        """A memory barrier for the window: before a header that says the data
        is there, and after receiving one, before reading."""
        self.win.Sync()

    def close(self):
        """This rank is done with the window (local; MPI_Finalize frees it)."""
        self.win.Unlock_all()
