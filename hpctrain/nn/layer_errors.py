"""The two errors of the layer contract (nn/layers.py, which names them
too): a layer that does not fit its input, and a layer whose code breaks
the contract. A module of their own so that what layers import
(nn/tensor_parallel.py) can raise them without importing the layers.

    python -c "from hpctrain.nn.layers import LayerError; print(LayerError.__module__)"
"""


class LayerError(ValueError):
    """A layer that does not fit its input: one line saying why."""


class LayerCodeError(LayerError):
    """A layer that breaks the contract: its own code raised, returned
    something that is not what the contract asks, or wrote where it must not
    (nn/spec.py, nn/check.py). One line naming the layer; `traceback`: the
    traceback of the layer's own code when it raised, else None."""

    def __init__(self, line, traceback=None):
        super().__init__(line)
        self.traceback = traceback
