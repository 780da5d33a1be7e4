"""A model of your own for hpctrain: a function that takes the data's input
shape and class count and returns a list of layers, hpctrain's or your own
(a subclass of hpctrain.nn.Layer: see docs/models.md for the contract).

    mpirun -n 2 python -m hpctrain.train --model examples/custom_model.py:build --steps 200

Every rank imports this file itself; nothing of it is sent between ranks.
"""
from hpctrain.nn import Dense, Flatten, Layer


class LeakyReLU(Layer):
    """max(x, slope * x), in place on its input: it says so (inplace), and
    hpctrain hands it a copy wherever the input is still read (a Residual's
    skip path, a layer before it that keeps its output). Its backward reads
    its own mask, not its output (keeps_output = False: no copy needed after
    a Dense, which keeps its input). hpctrain checks both claims once, when
    the model is built (docs/models.md)."""
    inplace = True
    keeps_output = False

    def __init__(self, slope=0.1):
        self.slope = float(slope)

    def forward(self, ctx, x, train):
        # what backward needs goes on ctx, the runner's per-call context
        # (one per micro-batch in flight), never on self; its buffers are
        # kept between calls: a warm step allocates nothing
        ctx.negative = ctx.buffer("negative", x.shape, bool)
        self.xp.less(x, 0, out=ctx.negative)
        x[ctx.negative] *= self.slope
        return x

    def backward(self, ctx, dy, need_dx):
        dy[ctx.negative] *= self.slope
        return dy

    def describe(self):
        return f"LeakyReLU({self.slope:g})"


def build(input_shape, classes):
    return [Flatten(), Dense(128), LeakyReLU(0.1), Dense(64), LeakyReLU(0.1), Dense(classes)]
