"""--clip-norm in a pipeline: the global norm of the whole model's averaged
gradient, which no stage holds whole, taken from the very sums of squares
that ring mode's norm takes (comm/grad_norm.py), so that the pipeline clips as
`--accumulate-steps M --clip-norm C` on the same replicas does.

Ring mode sums squares over parts of its fused buckets (buckets ending on
layer starts, up to --fusion-mb; each cut into the strategy's R parts) and
adds the parts with math.fsum (optim/clipping.py), correctly rounded and so blind
to their order. Here every stage cuts the same parts (`ring_ranges`: the same
bucket_bounds, the same `parts`) and sums the squares of its piece of each
(with --shard-optimizer each replica of its own part, the only one it holds
reduced); one world Allreduce brings every piece to every rank, each piece
in a slot of its own: each slot has one non-zero term, so the sum is exact
in any reduction order and every rank gets the same partials, hence the
same factor.
Where no part crosses a stage's boundary (buckets of one layer each: a small
--fusion-mb), the partials are ring mode's, bit for bit, and so are the
parameters; a part that does cross (or a chunk's boundary, with the
interleaved schedule's chunks) is summed in two pieces, and the norm
differs from ring mode's by float64 rounding (tests/test_pipeline.py).
Takes a communicator; never imports MPI itself.

    mpirun -n 4 python -m hpctrain.train --pipeline-stages 2 --micro-batches 4 --clip-norm 1 --fusion-mb 0.01
"""
import numpy as np

from ..optim.clipping import sum_squares
from ..comm.grad_norm import part_ranges
from .stages import ring_buckets


def ring_ranges(spec, fusion_elems, parts):
    """The gradient ranges [(lo, hi)] whose sums of squares ring mode's
    --clip-norm adds (loops/ring_step.py: its buckets, each cut into parts)."""
    return part_ranges(ring_buckets(spec, fusion_elems), parts)


class StageNorm:
    """partials(grads): the sums of squares of the whole model's summed
    gradient over `ranges` (ring mode's parts, gradient coordinates), on every
    rank of `comm` (the world). slices: per local chunk (one with one chunk a
    stage) (c, lo, owned): the model's chunk c (the stage itself with one),
    its slice starting at `lo`, summed where `owned` says (slice
    coordinates): a replica's part when the update is sharded (only that
    part is summed over the replicas), the whole slice on replica 0
    otherwise; chunks: how many the model is cut into (P, or PV). Part i's
    piece on chunk c, replica q has slot (i C + c) R + q, so every slot has
    one contributor. grads: per local chunk, its gradient slice."""

    def __init__(self, ranges, slices, chunks, grid, comm, watchdog):
        self.comm, self.watchdog = comm, watchdog
        R = grid.replicas
        self._mine = [((i * chunks + c) * R + grid.replica, k, max(a - lo, o_lo), min(b - lo, o_hi))
                      for k, (c, lo, owned) in enumerate(slices)
                      for i, (a, b) in enumerate(ranges) for o_lo, o_hi in owned
                      if max(a - lo, o_lo) < min(b - lo, o_hi)]
        self._slots = np.array([slot for slot, _, _, _ in self._mine], np.int64)
        self._pieces = np.zeros(len(ranges) * chunks * R, np.float64)
        self._all = np.zeros_like(self._pieces)

    def partials(self, grads):
        self._pieces[...] = 0
        # a part may meet two owned ranges of one rank: its pieces add up there, in one order
        np.add.at(self._pieces, self._slots, sum_squares([grads[k][a:b] for _, k, a, b in self._mine]))
        with self.watchdog.waiting("clip norm: sums of squares over the stages", peer=None):
            self.comm.Allreduce(self._pieces, self._all)   # the default op: a sum
        return self._all
