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

`Container`: what a layer made of named inner layers (`inner`: (prefix,
layer) pairs) shares, a Residual's and a transformer Block's: the inner
tensors under "prefix.name", their initial values, their binding, and
each inner layer's dropout stream.

    python -m pytest -q tests/test_layers.py -k in_place
"""
from .layers import Context, Layer, Noise


class Container(Layer):
    """A layer whose tensors are its inner layers' (`inner`), prefixed."""

    def _prefixed(self, of):
        return [(f"{prefix}.{name}", shape) for prefix, layer in self.inner for name, shape in getattr(layer, of)()]

    def param_shapes(self):
        return self._prefixed("param_shapes")

    def state_shapes(self):
        return self._prefixed("state_shapes")

    @staticmethod
    def _split(views, prefix):
        return {name[len(prefix) + 1:]: v for name, v in views.items() if name.split(".", 1)[0] == prefix}

    def init(self, rng, params, dtype):
        for prefix, layer in self.inner:
            layer.init(rng, self._split(params, prefix), dtype)

    def init_state(self, state):
        for prefix, layer in self.inner:
            layer.init_state(self._split(state, prefix))

    def bind(self, xp, params, grads, state):
        super().bind(xp, params, grads, state)
        for prefix, layer in self.inner:
            layer.bind(xp, self._split(params, prefix), self._split(grads, prefix), self._split(state, prefix))

    def _set_inner_noise(self, ctx, noise, contexts):
        """Each inner layer's randomness (contexts: theirs, in `inner`'s order), a stream of its own."""
        ctx.noise = noise
        for j, ((_, layer), inner) in enumerate(zip(self.inner, contexts)):
            layer.set_noise(inner, None if noise is None else Noise(*noise[:3], stream=noise.stream * 64 + j + 1))


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

    def forward(self, ctx, x, train, before=None):
        """before(k), where given, runs before layer k (a store's per-layer hook)."""
        for k, layer in enumerate(self.layers):
            if before is not None:
                before(k)
            if self.copies[k]:
                x = self.copy_input(ctx, k, x)
            x = layer.forward(ctx.inner[k], x, train)
        return x

    def copy_input(self, ctx, k, x):
        """Layer k's input copied into the slot's buffer for it (copies[k])."""
        buf = ctx.buffer(("copy", k), x.shape, x.dtype)
        self.xp.copyto(buf, x)
        return buf
