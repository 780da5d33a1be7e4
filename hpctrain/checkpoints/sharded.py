"""A sharded optimizer's state (--shard-optimizer on) in and out of the one
full-length checkpoint: each rank owns some ranges of the flat buffer
(comm/data_parallel.py: its shard of each bucket), and the chief gathers the owned parts into
full-length arrays (the same file an unsharded run writes; a resume puts
each rank's owned parts back through state/consumers.py). Raw int64 and
float buffers through Gather(v), no pickle; every wait under the watchdog.

    mpirun -n 2 python -m mpi4py -m pytest --only-mpi tests/test_shard_optimizer.py
"""
import numpy as np

from .. import device


def displacements(counts):
    """Where each rank's part starts in one Gatherv/Scatterv buffer that holds
    the parts back to back, counts[r] elements for rank r."""
    return np.concatenate([[0], np.cumsum(counts)[:-1]])


class ShardedState:
    """Collective over comm. root: the chief's rank in comm; chief_rank: its
    world rank (named when a wait stalls); xp: where the state lives."""

    def __init__(self, comm, optimizer, root, chief_rank, watchdog, xp):
        self.comm, self.optimizer, self.root, self.chief_rank = comm, optimizer, root, chief_rank
        self.watchdog, self.xp = watchdog, xp
        self.layout = self._layout()

    def _layout(self):
        """On the chief, every rank's owned ranges (a list of int64 (k, 2)
        arrays, by rank of comm) and their sizes; None elsewhere."""
        comm, root = self.comm, self.root
        mine = np.array(self.optimizer.ranges, np.int64).reshape(-1, 2)
        counts = np.zeros(comm.Get_size(), np.int64) if comm.Get_rank() == root else None
        with self.watchdog.waiting("optimizer shard layout gather", peer=None):
            comm.Gather(np.array([mine.shape[0]], np.int64), counts, root=root)
            everyone = None
            if counts is not None:
                everyone = np.empty((int(counts.sum()), 2), np.int64)
                starts = displacements(counts)
                comm.Gatherv(mine.ravel(), [everyone.ravel(), (counts * 2, starts * 2)], root=root)
            else:
                comm.Gatherv(mine.ravel(), None, root=root)
        if everyone is None:
            return None
        ranges = np.split(everyone, starts[1:])
        return ranges, np.array([int((r[:, 1] - r[:, 0]).sum()) for r in ranges], np.int64)

    def gather(self):
        """Each rank's owned parts of every state array into full-length host
        arrays on the chief; {} elsewhere."""
        layout, n = self.layout, self.optimizer.full_size
        device.synchronize(self.xp)
        out = {}
        for name, compact in self.optimizer.state().items():
            host = device.to_host(compact)
            with self.watchdog.waiting(f"checkpoint gather (optimizer state {name})", peer=None):
                if layout is None:
                    self.comm.Gatherv(host, None, root=self.root)
                    continue
                ranges, sizes = layout
                parts = np.empty(int(sizes.sum()), host.dtype)
                displs = displacements(sizes)
                self.comm.Gatherv(host, [parts, (sizes, displs)], root=self.root)
            full = np.zeros(n, host.dtype)
            for owned, start in zip(ranges, displs):
                c = int(start)
                for lo, hi in owned:
                    full[lo:hi] = parts[c:c + hi - lo]
                    c += hi - lo
            out[name] = full
        return out
