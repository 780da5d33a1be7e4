"""A list of layers run forward one after another, with the copies the
in-place rule needs (nn/layers.py): a layer that overwrites its input
(`inplace = True`) gets a copy of it wherever something still reads that
input, namely when the input is kept by whoever made it (a Residual's skip
path needs x after the block has run) or when the nearest layer before it
that is not a view keeps its output for its own backward (`keeps_output`:
a user's Tanh that saves y). Everywhere else it works on the array it is
handed, as ReLU after Dense does: the zoo's models make no copy at all.

The copies are decided once, from the layers' declarations, and their
buffers are kept between calls, in the slot's context (nn/layers.py
Context): a step allocates nothing once warm.

    python -m pytest -q tests/test_layers.py -k in_place
"""
from .layers import Context


def input_copies(layers, input_kept=False):
    """Per layer, whether it gets a copy of its input. input_kept: the
    chain's own input is read again after the chain (a Residual's paths)."""
    copies, kept = [], bool(input_kept)
    for layer in layers:
        copies.append(bool(layer.inplace and kept))
        if not layer.view:   # a view hands its input on: whoever keeps that still does
            kept = bool(layer.keeps_output)
    return copies


class Chain:
    """layers[0], layers[1], ... forward over x (xp: NumPy or CuPy). The
    copies' buffers are per slot, like the layers' own: `context()` is a
    Context whose `inner` holds each layer's, and the copies go in it."""

    def __init__(self, layers, xp, input_kept=False):
        self.layers, self.xp = list(layers), xp
        self.copies = input_copies(self.layers, input_kept)

    def context(self):
        return Context(self.xp, [layer.context() for layer in self.layers])

    def forward(self, ctx, x, train):
        for k, layer in enumerate(self.layers):
            if self.copies[k]:
                x = self.copy_input(ctx, k, x)
            x = layer.forward(ctx.inner[k], x, train)
        return x

    def copy_input(self, ctx, k, x):
        """Layer k's input copied into the slot's buffer for it (copies[k])."""
        buf = ctx.buffer(("copy", k), x.shape, x.dtype)
        self.xp.copyto(buf, x)
        return buf
