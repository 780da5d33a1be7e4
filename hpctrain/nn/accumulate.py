"""A running sum in one order, a_0, then += a_1, += a_2, ...: what the step
gradient of every loop (comm/step_gradient.py) sums a step's micro-batches'
gradients, tied uses and losses with, so --accumulate-steps K in ring and
ps mode and a pipeline's --micro-batches M give the same bits (IEEE
addition commutes: the last addition, g + sum or sum + g, is one value).
Never imports MPI.

    python -m pytest -q tests/test_accumulate.py
"""


class Accumulation:
    """The running sum of arrays of one shape, into `out` (owned by the caller)."""

    def __init__(self, out):
        self.out = out
        self.count = 0

    def add(self, array):
        """The next one: the first is copied, every other added in order."""
        if self.count:
            self.out += array
        else:
            self.out[...] = array
        self.count += 1

    def add_range(self, part, lo, hi):
        """As add, for the next one's [lo:hi] only (`part`): the caller adds
        every range of it, then calls counted() (--zero 2 adds a layer at
        a time, as backprop finishes each: its slots hold one bucket)."""
        if self.count:
            self.out[lo:hi] += part
        else:
            self.out[lo:hi] = part

    def counted(self):
        """Every range of the next one was added (add_range)."""
        self.count += 1

    def into(self, target, lo=None, hi=None):
        """target[lo:hi] += the sum's [lo:hi] (all of it without lo, hi)."""
        view = target[lo:hi]   # a view, added into in place (GradSlots has no item assignment)
        view += self.out[lo:hi]

    def mean(self):
        """The sum times 1 / count (a new array)."""
        return self.out * (1.0 / self.count)

    def restart(self):
        """The next add starts a new sum (the buffer is kept)."""
        self.count = 0
