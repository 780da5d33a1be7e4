"""The sum of squares of the fused, summed gradient buffer, for --clip-norm in
ring mode: the same bits whether each rank holds every bucket's sum
(allreduce) or only its own part of each (--shard-optimizer on, reduce-scatter).

Float sums depend on how they are split, so both ways split alike: every
bucket is cut into the strategy's parts (`strategy.parts`, the shards of
all the ranks), each part's sum of squares is taken on its own
(clipping.sum_squares), and the parts are added with math.fsum, which is
correctly rounded and so blind to their order. Unsharded, a rank holds
every part and computes them all: no message. Sharded, it holds one part
per bucket; one Allgather of a float64 per bucket and rank (a few dozen
bytes) brings everyone the rest. Either way every rank gets the same norm.

Beyond communicators and arrays this imports hpctrain.clipping.sum_squares:
the arithmetic of a norm, shared with the ps server (comm/ps/aggregate.py),
so both modes take a norm by the same reduction.

    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_clip.py
"""
import numpy as np

from ..optim.clipping import sum_squares
from .strategy import waiting


def part_ranges(buckets, parts):
    """The ranges a norm's sums of squares are taken over: each bucket
    (lo, hi) cut by parts(hi - lo) (-> [(a, b)]); empty ranges kept (the
    pipeline's --clip-norm cuts ring mode's alike: pipeline/grad_norm.py)."""
    return [(lo + a, lo + b) for lo, hi in buckets for a, b in parts(hi - lo)]


class BucketNorm:
    """partials() of buffer once FusedAllreduce has summed
    every bucket of `buckets` ([(lo, hi)] of the buffer) with `strategy`.
    sharded: this rank holds only strategy.shard of each bucket, and
    `comm` (every rank of the strategy's) carries the parts under `watchdog`."""

    def __init__(self, strategy, buckets, buffer, sharded=False, comm=None, watchdog=None):
        self.buffer, self.sharded, self.comm, self.watchdog = buffer, sharded, comm, watchdog
        # Empty ranges stay: sharded, every rank sends one value per bucket.
        self.ranges = part_ranges(buckets, (lambda n: [strategy.shard(n)]) if sharded else strategy.parts)
        if sharded:
            if comm is None:
                raise ValueError("a sharded norm needs the communicator of the ranks holding the parts")
            self._mine = np.zeros(len(self.ranges), np.float64)
            self._everyone = np.zeros(len(self.ranges) * comm.Get_size(), np.float64)

    def partials(self):
        """The sums of squares of every part of the buffer (sharded: of every
        rank's part, after a collective over comm)."""
        mine = sum_squares([self.buffer[a:b] for a, b in self.ranges])
        if not self.sharded:
            return mine
        self._mine[...] = mine
        with waiting(self.watchdog, "clip norm: sums of squares allgather"):
            self.comm.Allgather(self._mine, self._everyone)
        return self._everyone

