"""Linear: y = x W (+ b) over the last axis of an input of any shape, each
position by itself: the MLPs' and CNNs' dense layers on (batch, fan_in), a
transformer's projections on (batch, T, E). One class; `Dense` (below)
is the same layer with He-normal weights (variance 2 / fan_in, for ReLU
nets), the name the MLPs, the CNNs and users' model files have always
written; `Linear` draws N(0, std), nanoGPT's 0.02 unless given (each the
draw it has always made, so a user's model starts where it always did).
The bias zero or absent (`bias=False`: a tied head). `role`, chosen where the model is written as Megatron-LM chooses
ColumnParallelLinear or RowParallelLinear (nn/tensor_parallel.py):
"column", "row", "vocab" (a head's units over the vocabulary) or None.

    python -m pytest -q tests/test_transformer_layers.py -k Linear
"""
import math

from . import blas, threads
from ..base.precision import draw_dtype
from .layers import Layer, LayerError, he_normal
from .tensor_parallel import split_linear

ROLES = (None, "column", "row", "vocab")


def normal(rng, shape, std, dtype):
    """N(0, std^2) in C order of `shape`, drawn from `rng` as he_normal draws
    (nn/layers.py): float32 draws for float32 buffers, float64 for float64."""
    w = rng.standard_normal(math.prod(shape), dtype=draw_dtype(dtype))
    w *= std
    return w.astype(dtype, copy=False).reshape(shape)


class Linear(Layer):
    """(batch, ..., fan_in) -> (batch, ..., units); W is (fan_in, units)."""
    keeps_output = False   # its backward reads its input
    needs_params_without_dx = False   # dW from its input and dy, db from dy
    grads_may_overwrite_params = True   # W read for dx only: with dW over W (--zero 3), dx first
    tokenwise = True       # each position by itself: decoded by its own forward (nn/decode.py)

    def __init__(self, units, bias=True, std=0.02, role=None):
        self.units, self.bias = int(units), bool(bias)
        self.std = None if std is None else float(std)
        if self.units < 1:
            raise LayerError(f"{self.describe()}: at least one unit")
        if role not in ROLES:
            raise LayerError(f"{self.describe()}: role {role!r} is none of {', '.join(map(repr, ROLES))}")
        self.role = role

    def join(self, group, role=None):
        """--tensor-parallel: this layer as rank group.rank's slice of itself,
        by its role (`role`: the one the spec pairs it in where it was built
        without one: nn/tensor_split.py)."""
        self.group = group
        self.role = role or self.role

    def configure(self, in_shape):
        super().configure(in_shape)
        # here: this rank's units (all of them but in a column-parallel layer)
        self.fan_in, self.here, self._cuts = split_linear(self, self.in_shape[-1], self.units, self.bias)
        self.out_shape = (*self.in_shape[:-1], self.here)
        # --sequence-parallel: a column layer gathers every rank's positions before it, a row
        # layer keeps this rank's after it (the sum's reduce-scatter); the positions: the first axis
        self.gathers = self.keeps_part = False
        if self.group is not None and self.group.sequence:
            size = self.group.size
            if self.role == "row":
                self.keeps_part = True
                self.group.positions(self.in_shape[0])
                self.out_shape = (self.in_shape[0] // size, *self.out_shape[1:])
            else:
                self.gathers = True
                self.out_shape = (self.in_shape[0] * size, *self.out_shape[1:])
        return self.out_shape

    decays = ("W",)

    def param_shapes(self):
        return [("W", (self.fan_in, self.here))] + ([("b", (self.here,))] if self.bias else [])

    def tensor_cuts(self):
        return self._cuts

    def init(self, rng, params, dtype):
        shape = params["W"].shape
        params["W"][...] = he_normal(rng, shape, self.fan_in, dtype) if self.std is None else \
            normal(rng, shape, self.std, dtype)

    def bind(self, xp, params, grads, state):
        super().bind(xp, params, grads, state)
        # --zero 3 binds dW over W where it can (grads_may_overwrite_params): dx, W's last read, then goes first
        self._dx_first = "W" in grads and bool(xp.may_share_memory(params["W"], grads["W"]))

    def forward(self, ctx, x, train):
        xp, W, group = self.xp, self.params["W"], self.group
        if self.gathers:   # every rank's positions
            whole = ctx.buffer("whole", (x.shape[0], x.shape[1] * group.size, *x.shape[2:]), x.dtype)
            group.allgather(x, whole)
            x = whole
        rows = x.reshape(-1, self.fan_in)
        h = ctx.buffer("partial" if self.keeps_part else ("out", train), (rows.shape[0], self.here), W.dtype)
        row_parallel = group is not None and self.role == "row"

        def part(t, lo, hi):
            blas.matmul(xp, rows[lo:hi], W, h[lo:hi])
            if self.bias and not row_parallel:
                h[lo:hi] += self.params["b"]
        self._rows_in_parallel(rows.shape[0], part, rows.shape[0])
        ctx.rows = rows
        if self.keeps_part:   # summed over the group, this rank's positions kept, then the bias
            out = ctx.buffer(("out", train), (x.shape[0], *self.out_shape), W.dtype)
            group.reduce_scatter(h.reshape(*x.shape[:-1], self.here), out)
            if self.bias:
                out += self.params["b"]
            return out
        if row_parallel:   # the partial products added over the group, then the bias each rank holds whole
            group.sum(h)
            if self.bias:
                h += self.params["b"]
        return h.reshape(*x.shape[:-1], self.here)

    def backward(self, ctx, dy, need_dx):
        xp, rows, W, dW, group = self.xp, ctx.rows, self.params["W"], self.grads["W"], self.group
        if self.keeps_part:   # the bias's gradient from this rank's positions, summed; then every rank's
            if self.bias:
                dy.reshape(-1, self.here).sum(axis=0, out=self.grads["b"])
                group.sum(self.grads["b"])
            whole = ctx.buffer("dwhole", (dy.shape[0], dy.shape[1] * group.size, *dy.shape[2:]), dy.dtype)
            group.allgather(dy, whole)
            dy = whole
        d = dy.reshape(-1, self.here)
        dx = ctx.buffer("dx", rows.shape, dy.dtype) if need_dx else None

        def weight():
            self._rows_in_parallel(self.fan_in, lambda t, lo, hi: blas.matmul(xp, rows[:, lo:hi].T, d, dW[lo:hi]),
                                   d.shape[0])
            if self.bias and not self.keeps_part:
                d.sum(axis=0, out=self.grads["b"])

        def inputs():
            self._rows_in_parallel(d.shape[0], lambda t, lo, hi: blas.matmul(xp, d[lo:hi], W.T, dx[lo:hi]),
                                   d.shape[0])
        if not need_dx:
            weight()
            return None
        if self._dx_first:   # the same products, one after the other: dW is written over W
            inputs()
            weight()
        else:
            self.pair(weight, inputs)
        dx = dx.reshape(*dy.shape[:-1], self.fan_in)
        if self.gathers:   # summed over the group, this rank's positions kept
            part = ctx.buffer("dpart", (dy.shape[0], *self.in_shape), dy.dtype)
            group.reduce_scatter(dx, part)
            return part
        if group is not None and self.role != "row":
            group.sum(dx)   # each rank's units' part of the input gradient, added
        return dx

    def _rows_in_parallel(self, n, work, rows):
        """A product over ranges of its output's rows (whole BLAS row tiles:
        threads.ROW_TILE), on the compute threads where it is large enough:
        each output row is the one it is in one GEMM. Not by columns: BLAS
        sums a column in other bits when it is cut off from its neighbours."""
        self.in_parallel(n, work, unit=threads.ROW_TILE, macs=rows * self.fan_in * self.here)

    def train_floats(self):
        # its output and the gradient handed back
        return 2 * math.prod(self.out_shape)

    def flops(self):
        return math.prod(self.in_shape[:-1]) * self.fan_in * self.here

    def describe(self):
        # He-initialised with a bias it is the layer model identities have always named Dense
        # (checkpoints compare the identity, a digest of these lines: nn/spec.py)
        if self.std is None and self.bias:
            return f"Dense({self.units})"
        return f"Linear({self.units}{'' if self.bias else ', bias=False'})"


class Dense(Linear):
    """Linear with He-normal weights and a bias: the MLPs', the CNNs' and
    users' model files' dense layer (nothing else of its own)."""

    def __init__(self, units, role=None):
        super().__init__(units, bias=True, std=None, role=role)
