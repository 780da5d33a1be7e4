"""Linear: y = x W (+ b) over the last axis of an input of any shape, each
position by itself: a transformer's projections on (batch, T, E). Dense
(nn/layers.py) stays the flat layer of the MLPs and CNNs, which refuses a
spatial input with a hint to flatten it; this one is for token vectors.
Weights N(0, std) (nanoGPT's 0.02, `normal`), the bias zero or absent
(`bias=False`: a tied output head, `Linear(vocab, bias=False).tie("W",
embedding, "E", transposed=True)`).

    python -m pytest -q tests/test_transformer_layers.py -k Linear
"""
import math

from . import threads
from ..precision import draw_dtype
from .layers import Layer, LayerError
from .tensor_parallel import split_linear


def normal(rng, shape, std, dtype):
    """N(0, std^2) in C order of `shape`, drawn from `rng` as he_normal draws
    (nn/layers.py): float32 draws for float32 buffers, float64 for float64."""
    w = rng.standard_normal(math.prod(shape), dtype=draw_dtype(dtype))
    w *= std
    return w.astype(dtype, copy=False).reshape(shape)


class Linear(Layer):
    """(batch, ..., fan_in) -> (batch, ..., units); W is (fan_in, units)."""
    keeps_output = False   # its backward reads its input
    tensor = None   # --tensor-parallel: ("column", group, kind) or ("row", group) (nn/tensor_parallel.py)

    def __init__(self, units, bias=True, std=0.02):
        self.units, self.bias, self.std = int(units), bool(bias), float(std)
        if self.units < 1:
            raise LayerError(f"Linear({units}): at least one unit")

    def configure(self, in_shape):
        super().configure(in_shape)
        # here: this rank's units (all of them but in a column-parallel layer)
        self.fan_in, self.here, self._cuts = split_linear(self, self.in_shape[-1], self.units, self.bias)
        self.out_shape = (*self.in_shape[:-1], self.here)
        # --sequence-parallel: a column layer gathers every rank's positions before it, a row
        # layer keeps this rank's after it (the sum's reduce-scatter); the positions: the first axis
        self.gathers = self.keeps_part = False
        if self.tensor is not None and self.tensor[1].sequence:
            size = self.tensor[1].size
            if self.tensor[0] == "column":
                self.gathers = True
                self.out_shape = (self.in_shape[0] * size, *self.out_shape[1:])
            else:
                self.keeps_part = True
                self.tensor[1].positions(self.in_shape[0])
                self.out_shape = (self.in_shape[0] // size, *self.out_shape[1:])
        return self.out_shape

    decays = ("W",)

    def param_shapes(self):
        return [("W", (self.fan_in, self.here))] + ([("b", (self.here,))] if self.bias else [])

    def tensor_cuts(self):
        return self._cuts

    def init(self, rng, params, dtype):
        params["W"][...] = normal(rng, params["W"].shape, self.std, dtype)

    def forward(self, ctx, x, train):
        xp, W = self.xp, self.params["W"]
        if self.gathers:   # every rank's positions
            whole = ctx.buffer("whole", (x.shape[0], x.shape[1] * self.tensor[1].size, *x.shape[2:]), x.dtype)
            self.tensor[1].allgather(x, whole)
            x = whole
        rows = x.reshape(-1, self.fan_in)
        h = ctx.buffer("partial" if self.keeps_part else ("out", train), (rows.shape[0], self.here), W.dtype)
        row_parallel = self.tensor is not None and self.tensor[0] == "row"

        def part(t, lo, hi):
            xp.matmul(rows[lo:hi], W, out=h[lo:hi])
            if self.bias and not row_parallel:
                h[lo:hi] += self.params["b"]
        self._split_rows(rows.shape[0], part, rows.shape[0])
        ctx.rows = rows
        if self.keeps_part:   # summed over the group, this rank's positions kept, then the bias
            out = ctx.buffer(("out", train), (x.shape[0], *self.out_shape), W.dtype)
            self.tensor[1].reduce_scatter(h.reshape(*x.shape[:-1], self.here), out)
            if self.bias:
                out += self.params["b"]
            return out
        if row_parallel:   # the partial products added over the group, then the bias each rank holds whole
            self.tensor[1].sum(h)
            if self.bias:
                h += self.params["b"]
        return h.reshape(*x.shape[:-1], self.here)

    def backward(self, ctx, dy, need_dx):
        xp, rows, W, dW = self.xp, ctx.rows, self.params["W"], self.grads["W"]
        if self.keeps_part:   # the bias's gradient from this rank's positions, summed; then every rank's
            if self.bias:
                dy.reshape(-1, self.here).sum(axis=0, out=self.grads["b"])
                self.tensor[1].sum(self.grads["b"])
            whole = ctx.buffer("dwhole", (dy.shape[0], dy.shape[1] * self.tensor[1].size, *dy.shape[2:]), dy.dtype)
            self.tensor[1].allgather(dy, whole)
            dy = whole
        d = dy.reshape(-1, self.here)
        dx = ctx.buffer("dx", rows.shape, dy.dtype) if need_dx else None

        def weight():
            self._split_rows(self.fan_in, lambda t, lo, hi: xp.matmul(rows[:, lo:hi].T, d, out=dW[lo:hi]),
                             d.shape[0])
            if self.bias and not self.keeps_part:
                d.sum(axis=0, out=self.grads["b"])

        def inputs():
            self._split_rows(d.shape[0], lambda t, lo, hi: xp.matmul(d[lo:hi], W.T, out=dx[lo:hi]), d.shape[0])
        if not need_dx:
            weight()
            return None
        self.pair(weight, inputs)
        dx = dx.reshape(*dy.shape[:-1], self.fan_in)
        if self.gathers:   # summed over the group, this rank's positions kept
            part = ctx.buffer("dpart", (dy.shape[0], *self.in_shape), dy.dtype)
            self.tensor[1].reduce_scatter(dx, part)
            return part
        if self.tensor is not None and self.tensor[0] == "column":
            self.tensor[1].sum(dx)   # each rank's units' part of the input gradient, added
        return dx

    def _split_rows(self, n, work, rows):
        """Dense's rule (nn/layers.py Dense._split_rows): a product over
        ranges of its output's rows, whole BLAS row tiles, so the bits do not
        depend on the threads."""
        self.split(n, work, unit=threads.row_unit(1), most=threads.most(macs=rows * self.fan_in * self.here))

    def train_floats(self):
        # its output and the gradient handed back
        return 2 * math.prod(self.out_shape)

    def flops(self):
        return math.prod(self.in_shape[:-1]) * self.fan_in * self.here

    def describe(self):
        return f"Linear({self.units}{'' if self.bias else ', bias=False'})"
