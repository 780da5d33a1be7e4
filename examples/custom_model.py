"""A model of your own for hpctrain: a function that takes the data's input
shape and class count and returns a list of layers, hpctrain's or your own
(a subclass of hpctrain.nn.Layer: see docs/models.md for the contract).

    mpirun -n 2 python -m hpctrain.train --model examples/custom_model.py:build --steps 200

Every rank imports this file itself; nothing of it is sent between ranks.
"""
from hpctrain.nn import Dense, Flatten, Layer


class LeakyReLU(Layer):
    """max(x, slope * x), in place (the layer before keeps its own input)."""

    def __init__(self, slope=0.1):
        self.slope = float(slope)

    def forward(self, x, train):
        self.negative = x < 0
        x[self.negative] *= self.slope
        return x

    def backward(self, dy, need_dx):
        dy[self.negative] *= self.slope
        return dy

    def describe(self):
        return f"LeakyReLU({self.slope:g})"


def build(input_shape, classes):
    return [Flatten(), Dense(128), LeakyReLU(0.1), Dense(64), LeakyReLU(0.1), Dense(classes)]
