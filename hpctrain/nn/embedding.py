"""Token layers: `Embedding`, integer token ids in, vectors out (its matrix
E, vocab x dim, row t the vector of token t), the first layer of a model
whose input kind is "tokens" (nn/spec.py INPUT_KINDS: the reader gives
integer ids). Its matrix is the tensor a language model's output head
reads again, transposed (`Dense(vocab).tie("W", embedding, "E",
transposed=True)`, nn/tied.py).

    python -m pytest -q tests/test_tied.py -k embedding
"""
import math

import numpy as np

from . import compiled, passes
from ..base.precision import draw_dtype
from .layers import Layer, LayerError
from .tensor_parallel import Cut, nearly_even


class Embedding(Layer):
    """(batch, *shape) token ids -> (batch, *shape, dim): row x of E for each
    id x. The ids may come as integers (a token reader) or as floats holding
    whole numbers (a layer before it that makes tokens, a pipeline stage's
    received activations); an id outside [0, vocab) is one line.
    Normal(0, 1/dim) weights (the scale nanoGPT's std 0.02 gives at dim
    ~2500; here the logits of a tied head start near unit variance), or
    Normal(0, std^2) where `std` is given (nn/gpt.py: nanoGPT's 0.02). No
    gradient reaches the ids: its input gradient is zeros."""
    input_kind = "tokens"
    keeps_output = False   # its backward reads the ids, not its output
    needs_params_without_dx = False   # dE from the ids and dy
    tokenwise = True

    def __init__(self, vocab, dim, std=None, role=None):
        # role "vocab": its rows cut over a tensor group (Megatron's VocabParallelEmbedding; its head tied
        # to it with role "vocab" too: nn/tensor_parallel.py)
        self.vocab, self.dim = int(vocab), int(dim)
        self.std = None if std is None else float(std)
        if self.vocab < 1 or self.dim < 1:
            raise LayerError(f"Embedding({vocab}, {dim}): the vocabulary and the width must be at least 1")
        if role not in (None, "vocab"):
            raise LayerError(f"Embedding({vocab}, {dim}): role {role!r} is not None or 'vocab'")
        self.role = role

    def configure(self, in_shape):
        super().configure(in_shape)
        self.out_shape = (*self.in_shape, self.dim)
        # the rows this rank holds: all, or its part of the vocabulary [lo, hi)
        self.rows, self._cuts = (0, self.vocab), {}
        group = self.group
        if group is not None:
            if self.vocab < group.size:   # a rank without rows: its tied head would have no columns
                tokens = f"{self.vocab} token{'s' * (self.vocab != 1)}"
                raise LayerError(f"a vocabulary of {tokens} cannot be cut over {group.size} ranks (one token's row "
                                 f"each at least)")
            bounds = nearly_even(self.vocab, group.size)
            self.rows, self._cuts = bounds[group.rank:group.rank + 2], {"E": Cut(0, 1, bounds)}
            if group.sequence:   # --sequence-parallel: this rank's positions of the vectors
                _, count = group.positions(self.in_shape[0])
                self.out_shape = (count, *self.in_shape[1:], self.dim)
        return self.out_shape

    decays = ("E",)

    def param_shapes(self):
        return [("E", (self.rows[1] - self.rows[0], self.dim))]

    def tensor_cuts(self):
        return self._cuts

    def init(self, rng, params, dtype):
        E = rng.standard_normal(self.vocab * self.dim, dtype=draw_dtype(dtype))
        E *= np.sqrt(1.0 / self.dim) if self.std is None else self.std
        params["E"][...] = E.astype(dtype, copy=False).reshape(self.vocab, self.dim)

    def forward(self, ctx, x, train):
        xp = self.xp
        ids = ctx.buffer("ids", x.shape, np.intp)
        ids[...] = x   # whole numbers as floats: exact below 2**24
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.vocab:
            raise LayerError(f"{self.describe()}: token id {low if low < 0 else high} is outside [0, {self.vocab})")
        y = ctx.buffer(("out", train), (*x.shape, self.dim), self.params["E"].dtype)
        if self.group is not None:   # this rank's rows, zeros for the others' ids, added over the group
            lo, hi = self.rows
            inside = ctx.buffer("inside", x.shape, bool)
            xp.logical_and(ids >= lo, ids < hi, out=inside)
            ids -= lo
            ids *= inside   # an id outside: row 0, zeroed below
            whole = ctx.buffer("whole", y.shape, y.dtype) if self.group.sequence else y
            xp.take(self.params["E"], ids.reshape(-1), axis=0, out=whole.reshape(-1, self.dim))
            whole *= inside[..., None]
            if self.group.sequence:   # summed over the group, this rank's positions kept
                y = ctx.buffer(("part", train), (x.shape[0], *self.out_shape), y.dtype)
                self.group.reduce_scatter(whole, y)
            else:
                self.group.sum(y)
            ctx.inside = inside
        else:
            xp.take(self.params["E"], ids.reshape(-1), axis=0, out=y.reshape(-1, self.dim))
        ctx.ids = ids
        return y

    def bind(self, xp, params, grads, state):
        super().bind(xp, params, grads, state)
        self.compiled = compiled.on() and xp is np
        if self.compiled:
            passes.prepare(("add_rows",))

    def _add_rows(self, out, ids, rows):
        """out[ids[p]] += rows[p] for each position p in order."""
        if self.compiled and rows.dtype == out.dtype and rows.flags.c_contiguous:
            passes.add_rows(ids, rows, out)
        else:
            self.xp.add.at(out, ids, rows)

    def backward(self, ctx, dy, need_dx):
        # each id's row gets the sum of its positions' gradients, in the
        # order of the positions (np.add.at: unbuffered, one add at a time; compiled, a loop that
        # does the same adds, 0.9 ms against 0.02 a step of the small GPT: nn/passes.py)
        dE = self.grads["E"]
        dE[...] = 0
        if self.group is not None:   # this rank's rows: its ids' positions, in their order
            if self.group.sequence:   # every rank's positions' gradient
                whole = ctx.buffer("dwhole", (*ctx.ids.shape, self.dim), dy.dtype)
                self.group.allgather(dy, whole)
                dy = whole
            inside = ctx.inside.reshape(-1)
            self._add_rows(dE, ctx.ids.reshape(-1)[inside], dy.reshape(-1, self.dim)[inside])
        else:
            self._add_rows(dE, ctx.ids.reshape(-1), dy.reshape(-1, self.dim))
        if not need_dx:
            return None
        return self.xp.zeros(ctx.ids.shape, dy.dtype)

    def train_floats(self):
        # its output and the gradient handed back (the ids: one word a position)
        return 2 * math.prod(self.out_shape) + math.prod(self.in_shape)

    def flops(self):
        return math.prod(self.out_shape)   # a copy of each row

    def describe(self):
        return f"Embedding({self.vocab}, {self.dim})"
