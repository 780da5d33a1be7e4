"""--zero 3's collectives outside the step's buckets: the parameters live
in shards (nn/sharded_store.ParamShard: this rank's part of each of ring
mode's buckets, in the sharded optimizer's compact layout), so whatever
needs them whole takes them a bucket at a time.

- `Gatherer`: a bucket's parameters into its slot before its layers run
  (this rank's part copied in, then the strategy's allgather: the same
  ring, the same deadline and the same named stall as stage 1's gather
  after the update).
- `ShardsToChief`: compact arrays (the parameters, each optimizer state
  array) to the chief a bucket at a time, Gatherv into the bucket's
  place, for the checkpoint file's `Pieces`: the chief holds one bucket
  of one array at once, never the whole model. The others `send()` in
  the file's order meanwhile; a chief whose write fails `drain()`s the
  rest, so no sender is left waiting.
(A resume puts each rank's parts back through state/consumers.py.)

Raw buffers through Gatherv, no pickle; every wait under the
watchdog, naming the chief where the others wait for it.

    mpirun -n 2 python -m mpi4py -m pytest --only-mpi tests/test_zero3.py
"""
import numpy as np

from .. import device


class Gatherer:
    """gather(j, view): bucket j's parameters into `view` (its slot): this
    rank's part from the shard, the others' by the strategy's allgather."""

    def __init__(self, strategy, shard, xp, timeline=None):
        self.strategy, self.shard, self.xp, self.timeline = strategy, shard, xp, timeline

    def __call__(self, j, view):
        lo = self.shard.buckets[j][0]
        a, b = self.shard.owned[j]
        self.xp.copyto(view[a - lo:b - lo], self.shard.part(j))
        if self.timeline is None:
            self.strategy.allgather(view)
            return
        with self.timeline.span(f"allgather [{lo}:{lo + view.size})", cat="comm", bytes=int(view.nbytes)):
            self.strategy.allgather(view)


class _Layout:
    """Every rank's owned part of every bucket, (counts, displacements)
    inside the bucket per bucket, known on every rank (one Allgather)."""

    def __init__(self, comm, shard, watchdog):
        self.comm, self.shard, self.watchdog = comm, shard, watchdog
        mine = np.array([(a - lo, b - lo) for (a, b), (lo, _) in zip(shard.owned, shard.buckets)],
                        np.int64).reshape(-1, 2)
        everyone = np.empty((comm.Get_size(),) + mine.shape, np.int64)
        with watchdog.waiting("parameter shard layout allgather", peer=None):
            comm.Allgather(mine, everyone)
        self.counts = [everyone[:, j, 1] - everyone[:, j, 0] for j in range(len(shard.buckets))]
        self.displs = [everyone[:, j, 0] for j in range(len(shard.buckets))]
        # buffer order: the file's
        self.order = sorted(range(len(shard.buckets)), key=lambda j: shard.buckets[j][0])

    def part(self, array, j):
        """Bucket j's part of a compact array (the shard's layout), on the host."""
        a, b = self.shard.owned[j]
        c = self.shard.offset[j]
        return np.ascontiguousarray(device.to_host(array[c:c + b - a]))


class ShardsToChief(_Layout):
    """arrays: name -> a compact array (this rank's parts); `root`: the
    chief's rank in comm, `chief_rank` its world rank (named in a stall)."""

    def __init__(self, comm, shard, watchdog, arrays, root, chief_rank, dtype):
        super().__init__(comm, shard, watchdog)
        self.arrays, self.root, self.chief_rank, self.dtype = arrays, root, chief_rank, np.dtype(dtype)
        self._done = {name: 0 for name in arrays}   # how many buckets of each went to the chief

    def _bucket(self, name, j):
        """Collective: bucket j of `name`; the chief gets it whole, the others None."""
        lo, hi = self.shard.buckets[j]
        mine = self.part(self.arrays[name], j).astype(self.dtype, copy=False)
        chief = self.comm.Get_rank() == self.root
        out = np.empty(hi - lo, self.dtype) if chief else None
        with self.watchdog.waiting(f"checkpoint gather ({name} [{lo}:{hi}))",
                                   peer=None if chief else self.chief_rank):
            self.comm.Gatherv(mine, [out, (self.counts[j], self.displs[j])] if chief else None, root=self.root)
        self._done[name] += 1
        return out

    def pieces(self, name):
        """The chief: `name`'s buckets in buffer order, each as it arrives."""
        for j in self.order[self._done[name]:]:
            yield self._bucket(name, j)

    def send(self, names=None):
        """The others (and a chief that drains): every bucket of every array
        not yet gathered, names in the file's order."""
        for name in names or sorted(self.arrays):
            for j in self.order[self._done[name]:]:
                self._bucket(name, j)

    def drain(self):
        self.send()
