"""An optimizer that owns only some ranges of a flat buffer, its state kept
compact (ZeRO: --zero 1, 2 and 3 in ring mode, comm/data_parallel.py).

    python -m pytest -q tests/test_shard_optimizer.py
"""
from .base import Wrapper
from .decay import decay_in


class Sharded(Wrapper):
    """An optimizer that owns only `ranges` [(lo, hi), ...] (disjoint) of a
    flat buffer, its state kept compact: the owned ranges one after another,
    in buffer order, so the state is sum(hi - lo) elements, not the buffer's
    length (ring mode with --zero 1: each rank updates the part of
    every bucket it owns after the reduce-scatter, ZeRO stage 1).

    `update(params, grads, lo, hi)` takes full-length buffers and a range that
    lies inside one owned range; the arithmetic is the inner optimizer's, per
    element, so each owned element gets bit for bit what the unsharded
    optimizer would give it. `t` (Adam's bias correction) is the inner's, the
    same on every rank. `state()` is compact."""

    def __init__(self, inner_factory, ranges, full_size, decay_ranges=None):
        """inner_factory(n, decay_ranges): the inner optimizer over n compact
        elements, decaying those of decay_ranges (its coordinates; given
        here in the full buffer's)."""
        self.full_size = full_size   # the buffer's length (checkpoints hold state this long)
        self.ranges = sorted((int(lo), int(hi)) for lo, hi in ranges if hi > lo)
        self.offsets, c = [], 0
        for i, (lo, hi) in enumerate(self.ranges):
            if i and lo < self.ranges[i - 1][1]:
                raise ValueError(f"overlapping owned ranges {self.ranges[i - 1]} and {(lo, hi)}")
            self.offsets.append(c)
            c += hi - lo
        self.size = c
        self.inner = inner_factory(c, decay_in(decay_ranges, self.ranges))
        self.xp, self.dtype = self.inner.xp, self.inner.dtype
        self.state_names = self.inner.state_names

    def begin(self, lr, grad_scale=1.0):
        self.inner.begin(lr, grad_scale)

    def set_grad_scale(self, grad_scale):
        self.inner.set_grad_scale(grad_scale)

    def state(self):
        return self.inner.state()

    def compact_offset(self, lo, hi):
        """Where buffer range [lo, hi), inside one owned range, starts in the compact layout."""
        for (r_lo, r_hi), c in zip(self.ranges, self.offsets):
            if r_lo <= lo and hi <= r_hi:
                return c + (lo - r_lo)
        raise ValueError(f"[{lo}, {hi}) is not within one owned range")

    def update(self, params, grads, lo, hi):
        if hi <= lo:
            return
        c = self.compact_offset(lo, hi)
        # Shifted views, so the inner optimizer's index c means element lo of
        # the buffers (c <= lo: the compact layout keeps buffer order).
        shift = lo - c
        self.inner.update(params[shift:], grads[shift:], c, c + hi - lo)

    def update_compact(self, params, grads, lo, hi, shard=False):
        """update(), the gradient given in the compact layout (--zero 2: the
        rank's shard of the summed gradient, comm/data_parallel.GradShard);
        shard: the parameters too (--zero 3: nn/sharded_store.ParamShard)."""
        if hi <= lo:
            return
        c = self.compact_offset(lo, hi)
        self.inner.update(params if shard else params[lo - c:], grads, c, c + hi - lo)
