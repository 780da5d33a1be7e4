"""Where decoupled weight decay applies: sorted (lo, hi) ranges of a flat
buffer (the model's matrices, nn/spec.py decay_ranges, with
--weight-decay-on matrices), as the optimizers (base.py) walk them
within each range they update. No mask of the buffer's size: a range
update finds its first decayed range by bisection and walks on from there,
allocating no array.

    python -c "from hpctrain.optim.decay import Decayed; print(list(Decayed([(2, 5), (8, 9)], 10).pieces(0, 10, 0.9)))"
"""
from bisect import bisect_right


def decay_in(ranges, pieces):
    """`ranges` [(lo, hi)] of the model, as they fall in a buffer made of
    the model's `pieces` [(lo, hi)] laid one after another (a pipeline
    stage's slice, a server's slices, a shard's owned ranges): sorted, in
    the buffer's coordinates. None (decay everywhere) stays None."""
    if ranges is None:
        return None
    out, at = [], 0
    for lo, hi in pieces:
        out += [(max(a, lo) - lo + at, min(b, hi) - lo + at) for a, b in ranges if max(a, lo) < min(b, hi)]
        at += hi - lo
    return sorted(out)


class Decayed:
    """The decayed ranges of a buffer of `size` elements (None: all of it):
    sorted, disjoint, touching ones merged (fewer pieces a step)."""

    def __init__(self, ranges, size):
        self.ranges = None if ranges is None else _checked(ranges, size)
        # where each range ends, for bisect: the first one [lo, hi) meets
        self._ends = None if ranges is None else [hi for _, hi in self.ranges]

    def within(self, lo, hi):
        """The parts of [lo, hi) that decay, in order."""
        if self.ranges is None:
            yield lo, hi
            return
        for k in range(bisect_right(self._ends, lo), len(self.ranges)):
            a, b = self.ranges[k]
            if a >= hi:
                return
            yield max(a, lo), min(b, hi)

    def pieces(self, lo, hi, keep):
        """[lo, hi) cut where decay starts and stops: (a, b, factor), factor
        `keep` inside the ranges and 1.0 outside (a multiply by 1.0 changes
        no bit)."""
        if self.ranges is None:
            yield lo, hi, keep
            return
        at = lo
        for a, b in self.within(lo, hi):
            if at < a:
                yield at, a, 1.0
            yield a, b, keep
            at = b
        if at < hi:
            yield at, hi, 1.0


def _checked(ranges, size):
    out = []
    for lo, hi in sorted((int(lo), int(hi)) for lo, hi in ranges if hi > lo):
        if lo < 0 or hi > size or (out and lo < out[-1][1]):
            raise ValueError(f"decay range {(lo, hi)} overlaps another or leaves [0, {size})")
        if out and lo == out[-1][1]:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)
