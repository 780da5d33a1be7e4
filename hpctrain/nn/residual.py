"""The residual container on the layer contract (nn/layers.py):
`Residual(block, projection=None)` is y = f(x) + skip(x), f the layer list
`block`, skip the identity or `projection` (a layer or a layer list, e.g.
a 1x1 strided Conv2d and a BatchNorm2d), so a ResNet is a layer list too.

To the spec it is one layer whose tensors are its inner layers', named
`block{j}.{name}` and `proj{j}.{name}` (nested containers nest the
prefixes): ModelSpec lays them out, names them `layer{k}/block0.W`, and
hands them back through `bind`/`init`/`init_state`, which this splits by
prefix. Inner layers initialise in order, block first, then projection.

    python -m hpctrain.nn --model resnet --shape 32,32,3
"""
import math

from .chain import Chain, Container, input_copies
from .layers import Context, LayerError


def _shape(shape):
    return "x".join(map(str, shape))


class Residual(Container):
    keeps_output = False   # its backward reads its inner layers' own buffers

    def __init__(self, block, projection=None):
        self.block = list(block)
        self.projection = [] if projection is None else \
            list(projection) if isinstance(projection, (list, tuple)) else [projection]
        if not self.block:
            raise LayerError("Residual: the block is empty")
        self.inner = [(f"block{j}", layer) for j, layer in enumerate(self.block)] + \
                     [(f"proj{j}", layer) for j, layer in enumerate(self.projection)]
        # each path runs while the other still needs x (and so may the layer
        # before): an in-place layer that would overwrite it gets a copy (nn/chain.py)
        self._chains = None

    def configure(self, in_shape):
        super().configure(in_shape)
        shape = self.in_shape
        for layer in self.block:
            shape = tuple(layer.configure(shape))
        skip = self.in_shape
        for layer in self.projection:
            skip = tuple(layer.configure(skip))
        if shape != skip:
            raise LayerError(f"{self.describe()}: the block gives {_shape(shape)}, the skip path {_shape(skip)}"
                             + ("" if self.projection else ": give a projection"))
        self.out_shape = shape
        return shape

    def bind(self, xp, params, grads, state):
        super().bind(xp, params, grads, state)   # the inner layers (nn/chain.Container), prefixed
        self._chains = Chain(self.block, xp, input_kept=True), Chain(self.projection, xp, input_kept=True)

    @property
    def min_batch(self):
        return max(layer.min_batch for _, layer in self.inner)

    def context(self):
        """The block's chain context and the projection's, as `inner`."""
        block, projection = self._chains
        return Context(self.xp, [block.context(), projection.context()])

    def _inner_contexts(self, ctx):
        """(inner layer, its context), in `inner`'s order: block, then projection."""
        block, projection = ctx.inner
        return zip((layer for _, layer in self.inner), block.inner + projection.inner)

    def set_noise(self, ctx, noise):
        self._set_inner_noise(ctx, noise, [inner for _, inner in self._inner_contexts(ctx)])

    # --- forward and backward -------------------------------------------------
    def forward(self, ctx, x, train):
        block, projection = self._chains
        a = block.forward(ctx.inner[0], x, train)
        skip = projection.forward(ctx.inner[1], x, train)
        y = ctx.buffer(("out", train), a.shape, a.dtype)
        self.xp.add(a, skip, out=y)
        return y

    def backward(self, ctx, dy, need_dx):
        block, projection = (c.inner for c in ctx.inner)
        # The skip path first: the block's layers may overwrite dy (ReLU does).
        skip = dy
        if any(layer.inplace for layer in self.projection):
            skip = ctx.buffer("dy_skip", dy.shape, dy.dtype)
            self.xp.copyto(skip, dy)
        for i in range(len(self.projection) - 1, -1, -1):
            skip = self.projection[i].backward(projection[i], skip, need_dx)
        if need_dx and not self.projection:
            skip = ctx.buffer("dskip", dy.shape, dy.dtype)
            self.xp.copyto(skip, dy)
        d = dy
        for i in range(len(self.block) - 1, -1, -1):
            d = self.block[i].backward(block[i], d, need_dx or i > 0)
        if not need_dx:
            return None
        skip += d
        return skip

    def train_floats(self):
        copies = sum(input_copies(self.block, True)) + sum(input_copies(self.projection, True))
        copy = math.prod(self.in_shape) * (copies + (not self.projection))
        return (sum(layer.train_floats() for _, layer in self.inner) + 2 * math.prod(self.out_shape) + copy)

    def scratch_floats(self):
        return sum(layer.scratch_floats() for _, layer in self.inner)

    def flops(self):
        return sum(layer.flops() for _, layer in self.inner) + math.prod(self.out_shape)

    def describe(self):
        inner = ">".join(layer.describe() for layer in self.block)
        proj = "|" + ">".join(layer.describe() for layer in self.projection) if self.projection else ""
        return f"Residual[{inner}{proj}]"
