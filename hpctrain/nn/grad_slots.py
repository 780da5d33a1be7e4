"""The model's gradient without a full-length buffer (--zero 2): each of
ring mode's buckets writes into one of a few bucket-sized slots, which the
bucket's reduce-scatter and update free again, so a rank holds one or
two buckets' worth of gradients being written or on the wire (and with
--clip-norm its 1/N shard of the summed gradient: comm/data_parallel.py),
not the whole model's.

A model built over GradSlots (nn/spec.ModelSpec.build(grads=...)) binds
every layer's gradient views to its bucket's slot, once: `slots[lo:hi]` for
a range inside one bucket is the view of it in that bucket's slot (the
store's views, a tied tensor's home, the accumulation's per-layer ranges
are all such ranges: layers never straddle buckets, comm/fusion.py cuts
them on layer starts). Buckets take the `shared` slots in turn, in the
order backprop fills them, so bucket i reuses bucket i - shared's slot:
`reuses(i)` names that bucket, whose sum must be done before any layer of
bucket i writes (comm/fusion.py waits for it). Two slots where a
communication thread sums a bucket while backprop writes the next (with
overlap), one where each bucket is summed before backprop goes on. A
bucket that holds the home of a tied tensor gets a slot of its own: its
first writer (the GPT's head, tied to the embedding) writes it long before
the bucket's other layers finish, while other buckets come and go through
the shared slots.

Every layer writes (never adds to) its gradient views, every element of a
bucket is some layer's, so a slot needs no zeroing between buckets: what
the previous bucket left is overwritten.

--zero 3 (nn/sharded_store.py) gathers each bucket's parameters into slots
of this kind too; a bucket whose layers all write their gradient over
their parameters (`grads_may_overwrite_params`, nn/layers.py) then has no
gradient slot: `over` names those buckets and the parameters' slots, and
`[lo:hi]` of such a bucket is its view in its parameters' slot, where its
reduce-scatter then runs (one slot a bucket instead of two).

    mpirun -n 2 python -m mpi4py -m pytest --only-mpi tests/test_zero.py
"""
import bisect

import numpy as np

from ..base.precision import FLOAT32

OVERLAPPED = 2   # shared slots with overlap: one bucket written by backprop, the one before it on the wire


class GradSlots:
    """The gradient of a model of `size` elements cut into `buckets` [(lo,
    hi)] (ring mode's, in the order backprop finishes them: from the end of
    the buffer), with `homes` [(lo, hi)]: tied tensors' home ranges, whose
    buckets get slots of their own; the others take `shared` slots in
    turn. dtype, xp: the buffers'. over: (the parameters' GradSlots over the
    same buckets, the indices of the buckets whose gradient is written in
    their parameters' slot), or None."""

    def __init__(self, size, buckets, xp=np, dtype=FLOAT32.grads, homes=(), shared=OVERLAPPED, over=None):
        self.size, self.shape, self.dtype = int(size), (int(size),), np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.buckets = [(int(lo), int(hi)) for lo, hi in buckets]
        if sorted(self.buckets) != _cover(self.buckets, self.size):
            raise ValueError(f"buckets {self.buckets} do not cover [0, {size}) once")
        self.bucket_at = bucket_finder(self.buckets)
        params, self.over = (None, frozenset()) if over is None else (over[0], frozenset(over[1]))
        kept = [i for i in range(len(self.buckets)) if i not in self.over]   # the buckets with slots here
        at = {i: k for k, i in enumerate(kept)}
        slot_of, reuses, sizes = assign([self.buckets[i] for i in kept],
                                        {at[i] for i in {self.bucket_at(lo) for lo, hi in homes if hi > lo} if i in at},
                                        shared)
        self.slots = [xp.zeros(n, self.dtype) for n in sizes]
        # bucket -> the array its gradient is written in (its own slot, or its parameters'), and the
        # bucket that wrote there before it (None: nobody this pass)
        # and bucket -> its own slot's index (None: in its parameters')
        self._slot, self._reuses = [None] * len(self.buckets), [None] * len(self.buckets)
        self.slot_of = [None] * len(self.buckets)
        for k, i in enumerate(kept):
            self.slot_of[i], self._slot[i] = slot_of[k], self.slots[slot_of[k]]
            self._reuses[i] = None if reuses[k] is None else kept[reuses[k]]
        last = {}   # a parameters' slot -> the last bucket so far whose gradient is written there
        for i in sorted(self.over):
            slot = params.slot_of[i]
            self._slot[i], self._reuses[i], last[slot] = params.slots[slot], last.get(slot), i

    def reuses(self, i):
        """The bucket whose slot bucket i takes over, the last to write its
        gradient there before it (None: a fresh one)."""
        return self._reuses[i]

    @property
    def nbytes(self):
        """What the slots hold (bytes), the gradient this rank keeps while backprop runs."""
        return sum(int(s.nbytes) for s in self.slots)

    def __getitem__(self, key):
        """[lo:hi] inside one bucket: its view in the bucket's slot."""
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("GradSlots takes [lo:hi] ranges only")
        lo, hi = key.start or 0, self.size if key.stop is None else key.stop
        i = self.bucket_at(lo)
        b_lo, b_hi = self.buckets[i]
        if hi > b_hi:
            raise ValueError(f"[{lo}:{hi}) crosses the end of bucket [{b_lo}:{b_hi})")
        return self._slot[i][lo - b_lo:hi - b_lo]


def bucket_finder(buckets):
    """offset -> the index in `buckets` [(lo, hi)] (covering [0, n) once)
    of the bucket holding model offset `offset`."""
    los = sorted(lo for lo, _ in buckets)
    index = {lo: i for i, (lo, _) in enumerate(buckets)}
    return lambda offset: index[los[bisect.bisect_right(los, offset) - 1]]


def assign(buckets, own, shared):
    """(slot of each bucket, the bucket whose slot each reuses or None, each
    slot's length): the buckets of `own` (indices) a slot each, the others
    the `shared` slots in turn."""
    slot_of, reuses, last, sizes, turns = [], [], [None] * shared, [], 0
    for i, (lo, hi) in enumerate(buckets):
        if i in own:
            slot_of.append(len(sizes))
            sizes.append(hi - lo)
            reuses.append(None)
            continue
        turn = turns % shared
        turns += 1
        if last[turn] is None:
            last[turn] = (len(sizes), None)
            sizes.append(0)
        slot, before = last[turn]
        sizes[slot] = max(sizes[slot], hi - lo)
        slot_of.append(slot)
        reuses.append(before)
        last[turn] = (slot, i)
    return slot_of, reuses, sizes


def slot_elements(spec, buckets, shared=1, extra=(), over=()):
    """Elements the slots of a model `spec` over `buckets` hold (the start-up
    memory check's count); extra: more buckets [(lo, hi)] with slots of their
    own; over: indices of buckets without a slot (GradSlots' `over`)."""
    homes = {i for t in spec.ties for i, (lo, hi) in enumerate(buckets) if lo <= t.lo < hi} | \
        {buckets.index(b) for b in extra}
    kept = [i for i in range(len(buckets)) if i not in set(over)]
    return sum(assign([buckets[i] for i in kept], {kept.index(i) for i in homes if i in kept}, shared)[2])


def _cover(buckets, size):
    """The buckets a partition of [0, size) would be, sorted (for the check)."""
    out, at = [], 0
    for lo, hi in sorted(buckets):
        if lo != at:
            return None
        out.append((lo, hi))
        at = hi
    return out if at == size else None
