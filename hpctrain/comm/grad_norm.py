"""The one gradient norm of a data-parallel update (--clip-norm; ring mode
and every pipeline stage alike, comm/data_parallel.py): the same bits
whether a rank holds the whole summed gradient (allreduce), only its part
of each bucket (--shard-optimizer on, reduce-scatter) or only a pipeline
stage's slice of it.

Float sums depend on how they are split, so every way splits alike: the
whole model's gradient is cut into ring mode's buckets, each bucket into
the strategy's parts (`part_ranges`: the shards of all the ranks), each
part's sum of squares is taken on its own (clipping.sum_squares) and the
parts are added with math.fsum (optim/clipping.py), correctly rounded and
so blind to their order. A rank sums the squares of its piece of each part
(what it holds summed: everything, its shard, a stage's slice) into a slot
of its own, (part, chunk, replica); one Allreduce of the slots brings every
piece to every rank, and as each slot has one contributor the sum is exact
in any reduction order: every rank gets the same partials, hence the same
factor. Where a rank holds every part (the ring unsharded) there is no
message at all. Where a part crosses a pipeline stage's (or chunk's) cut it
is summed in two pieces, and the norm differs from ring mode's by float64
rounding (tests/test_pipeline.py).

Beyond communicators and arrays this imports optim.clipping.sum_squares:
the arithmetic of a norm, shared with the ps server (comm/ps/aggregate.py),
so every mode takes a norm by the same reduction.

    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_clip.py
"""
import numpy as np
from mpi4py import MPI

from ..optim.clipping import sum_squares
from .strategy import waiting


class TensorNorm:
    """Where a tensor-parallel rank's norm pieces go (GradNorm's `tensor`):
    the group's size and this rank's place in it (each slot gets a place
    per tensor rank), the ranges of the rank's buffer it counts
    (nn/tensor_parallel.counted_ranges), and `comm`, the tensor axis's
    communicator where GradNorm's own comm does not span it (ring mode:
    one tensor rank's replicas), None where it does (a pipeline's world)."""

    def __init__(self, size, rank, counted, comm=None):
        self.size, self.rank, self.counted, self.comm = int(size), int(rank), list(counted), comm


def _meet(owned, counted):
    """The ranges both lists cover (each sorted and disjoint)."""
    return [(max(a, c), min(b, d)) for a, b in owned for c, d in counted if max(a, c) < min(b, d)]


def part_ranges(buckets, parts):
    """The ranges a norm's sums of squares are taken over: each bucket
    (lo, hi) cut by parts(hi - lo) (-> [(a, b)]); empty ranges kept."""
    return [(lo + a, lo + b) for lo, hi in buckets for a, b in parts(hi - lo)]


class GradNorm:
    """partials(grads): the sums of squares of the whole model's summed
    gradient over `ranges` (part_ranges, model coordinates), on every rank
    of `comm` (None: this rank holds every part, nothing is sent).

    held: per local buffer k (the model's, or a pipeline stage's chunks)
    (c, lo, ranges): the model's chunk c (0 in ring mode), the buffer's
    offset lo in the model, and the ranges of it (buffer coordinates) this
    rank holds summed. chunks: how many the model is cut into (1, P or PV);
    replicas, replica: how many ranks hold pieces of one chunk's parts, and
    this rank's index among them. Part i's piece on chunk c, replica q has
    slot (i C + c) R + q; grads: per local buffer, its gradient."""

    def __init__(self, ranges, held, chunks=1, replicas=1, replica=0, comm=None, watchdog=None, tensor=None):
        self.comm, self.watchdog, self.tensor = comm, watchdog, tensor
        R = replicas
        T, t = 1, 0
        if tensor is not None:   # a tensor rank counts its slices, and the replicated tensors on rank 0 alone
            held = [(c, lo, _meet(owned, [(a - lo, b - lo) for a, b in tensor.counted])) for c, lo, owned in held]
            T, t = tensor.size, tensor.rank
        self._mine = [(((i * chunks + c) * R + replica) * T + t, k, max(a - lo, o_lo), min(b - lo, o_hi))
                      for k, (c, lo, owned) in enumerate(held)
                      for i, (a, b) in enumerate(ranges) for o_lo, o_hi in owned
                      if max(a - lo, o_lo) < min(b - lo, o_hi)]
        self._slots = np.array([slot for slot, _, _, _ in self._mine], np.int64)
        self._pieces = np.zeros(len(ranges) * chunks * R * T, np.float64)
        self._all = np.zeros_like(self._pieces)

    def partials(self, grads):
        self._pieces[...] = 0
        # a part may meet two held ranges of one rank: its pieces add up there, in one order
        np.add.at(self._pieces, self._slots, sum_squares([grads[k][a:b] for _, k, a, b in self._mine]))
        if self.comm is None:
            out = self._pieces
        else:
            with waiting(self.watchdog, "clip norm: sums of squares allreduce"):
                self.comm.Allreduce(self._pieces, self._all)   # the default op: a sum
            out = self._all
        if self.tensor is None or self.tensor.comm is None:
            return out
        # --tensor-parallel where comm is one tensor rank's replicas: each tensor rank's slots
        # filled by the others (every slot one rank's: exact in any order)
        with waiting(self.watchdog, "clip norm: the tensor ranks' sums of squares allreduce"):
            self.tensor.comm.Allreduce(MPI.IN_PLACE, out)
        return out
