"""The layout of the buffer the ring loop exchanges each step:

    [loss, stop, grads...]

Riding along with the gradient allreduce, the loss average and the ranks'
agreement to stop cost nothing extra; they sit at the front because layer 0
finishes last (backprop runs backwards), after the loss and any signal are
known, so the bucket that holds them (the last to be reduced) is ready no
earlier than it would be without them. The model's gradients are a view
into the wire (spec.build(grads=wire.body)), so backprop writes them in place.

With --shard-optimizer on, a second Wire carries the parameters in its
body (spec.build(params=param_wire.body)): the allgather half of each bucket moves that
buffer's range instead. The loss and stop slots ride the reduce-scatter as
always; the rank that owns them copies their sums into the second wire's
slots (`pass_head`) before its allgather, so every rank reads the summed
loss and stop there, with no extra message.

    python -m pytest -q tests/test_wire.py
"""
import numpy as np

LOSS, STOP, GRADS = 0, 1, 2


class Wire:
    """buffer: the whole flat array (what the strategy reduces); loss, stop,
    body: views of it. The body is the model's gradient buffer, or in the
    sharded step's second wire its parameter buffer. Offsets in the buffer
    are 'wire offsets'."""

    def __init__(self, num_grads, xp=np, dtype=np.float32):
        self.buffer = xp.zeros(GRADS + num_grads, dtype)
        self.loss = self.buffer[LOSS:LOSS + 1]
        self.stop = self.buffer[STOP:STOP + 1]
        self.body = self.buffer[GRADS:]

    @property
    def size(self):
        return self.buffer.size

    @property
    def dtype(self):
        return self.buffer.dtype

    @staticmethod
    def ready_from(layer_ranges):
        """For each layer i (ranges (lo, hi) in the gradient buffer): the lowest
        wire offset that is final once layer i's gradient is done. Layers
        finish from last to first; layer 0 finishes last, and with it the
        loss and stop in front of it (so 0)."""
        return [0] + [GRADS + lo for lo, _ in layer_ranges[1:]]

    @staticmethod
    def body_range(lo, hi):
        """The body's range (gradient or parameter buffer coordinates) of wire
        range [lo, hi): the loss and stop dropped."""
        return max(lo - GRADS, 0), hi - GRADS

    def pass_head(self, into, lo, hi):
        """Sharded step: the loss and stop slots within wire range [lo, hi)
        (summed there by the reduce-scatter) into Wire `into`, whose
        allgather then brings them to every rank."""
        top = min(hi, GRADS)
        if lo < top:
            into.buffer[lo:top] = self.buffer[lo:top]

    def set_stop(self, stop):
        self.stop[0] = 1.0 if stop else 0.0
