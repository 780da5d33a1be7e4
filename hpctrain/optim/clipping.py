"""Gradient clipping by global norm (`--clip-norm C`): the arithmetic, no MPI.

    g *= min(1, C / (||g|| + EPS))         ||g||: the 2-norm of the whole averaged gradient

as PyTorch's clip_grad_norm_ does it. Where the gradient is spread over
ranks (a sharded ring, several parameter servers) each holds sums of squares
of its parts (`sum_squares`), the parts are brought together
(comm/grad_norm.py, the ps servers' communicator), and `global_norm` adds them
with math.fsum: correctly rounded, so the order the parts arrive in (MPI's
reduction order, rank order) cannot change a bit, and every rank computes
the same factor.

Squares are taken in float64: the square of a float32 is exact there, and a
float64 sum keeps the norm far from float32's rounding. The factor is not
applied to the gradient itself: the caller folds it into the optimizer's
grad_scale (optim.SGD.set_grad_scale), which multiplies every element once
anyway, so clipping costs one read of the gradient, not a read and a write.

    python -m pytest -q tests/test_clip.py
"""
import math

import numpy as np

from ..base.device import array_module, to_host

# PyTorch's clip_grad_norm_ guard: a zero gradient divides by 1e-6, not by 0.
EPS = 1e-6


def sum_squares(views):
    """float64 sum of squares of each 1-D array in `views` (all on one
    device), as a NumPy array: one device-to-host copy, whatever their
    number. Each view is summed on its own, by the same reduction of the same
    length, so the same values give the same bits wherever they are held."""
    if not views:
        return np.zeros(0, np.float64)
    xp = array_module(views[0])
    out = xp.zeros(len(views), np.float64)
    for i, v in enumerate(views):
        if v.size:
            w = v.astype(np.float64)    # a fresh, aligned copy: the sum's blocking never depends on v's address
            xp.multiply(w, w, out=w)
            out[i] = w.sum()
    return to_host(out)


def global_norm(partials, scale=1.0):
    """The 2-norm from sums of squares of disjoint parts (any order, any
    number of zeros): sqrt(fsum(partials)) * scale. scale: e.g. 1/workers,
    when the parts are of a summed gradient and the norm is the average's."""
    return math.sqrt(math.fsum(float(p) for p in partials)) * scale


def clip_factor(norm, max_norm):
    """min(1, max_norm / (norm + EPS)): what the gradient is multiplied by.
    A diverging run's norm of inf gives 0 and nan gives 1 (min keeps 1.0):
    either way the loss check after the step reports the divergence."""
    return min(1.0, max_norm / (norm + EPS))


def clip_(grads, max_norm):
    """Clip one whole gradient in place (an async ps worker's own gradient);
    returns its norm before clipping. grads: a 1-D NumPy or CuPy array."""
    norm = global_norm(sum_squares([grads]))
    factor = clip_factor(norm, max_norm)
    if factor < 1.0:
        grads *= grads.dtype.type(factor)
    return norm


class Clip:
    """One run's --clip-norm: `scaled(partials, grad_scale)` each step turns
    the sums of squares of a summed gradient's parts into the grad_scale the
    update should use, and keeps the pre-clip norms for the records."""

    def __init__(self, max_norm):
        self.max_norm = float(max_norm)
        self.norm = float("nan")     # the last step's norm, before clipping
        self.steps = self.clipped = 0
        self._sum, self._count = 0.0, 0

    def scaled(self, partials, grad_scale):
        """grad_scale (what turns the summed gradient into the average, e.g.
        1/workers) times the clip factor of the average's norm. Unclipped
        steps get grad_scale itself, bit for bit what a run without
        --clip-norm uses."""
        norm = global_norm(partials, grad_scale)
        factor = clip_factor(norm, self.max_norm)
        self.record(norm, factor < 1.0)
        return grad_scale * factor if factor < 1.0 else grad_scale

    def clip_(self, grads):
        """Clip one whole gradient in place (an async ps worker's own)."""
        norm = clip_(grads, self.max_norm)
        self.record(norm, clip_factor(norm, self.max_norm) < 1.0)

    def record(self, norm, clipped):
        self.norm = norm
        self.steps += 1
        self.clipped += bool(clipped)
        self._sum += norm
        self._count += 1

    def mean_norm(self):
        """The mean pre-clip norm since the last call (a progress record's
        `grad_norm`); nan if no step was recorded."""
        mean = self._sum / self._count if self._count else float("nan")
        self._sum, self._count = 0.0, 0
        return mean

    def totals(self):
        """For the final record: the setting and how often it acted in this run."""
        return {"clip_norm": self.max_norm, "clipped_steps": self.clipped, "clip_steps": self.steps}
