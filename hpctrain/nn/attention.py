"""Causal multi-head self-attention on the layer contract (nn/layers.py),
nanoGPT's CausalSelfAttention: on (batch, T, E),

    q, k, v = split(x Wqkv + bqkv)           one fused projection E -> 3E
    per head h (E / heads wide):  A = softmax(q k^T / sqrt(head width) + mask)
    y = concat_h(dropout(A) v) Wo + bo       the output projection E -> E

the mask -inf above the diagonal (position t sees positions <= t), the
softmax with each row's maximum subtracted first. The attention dropout
(on A, as nanoGPT's attn_dropout) is a Dropout held inside (`inner`), its
draws per sample as every Dropout's; the dropout after the output
projection is the Block's (nn/transformer.py). Weights N(0, 0.02), the
output projection N(0, out_std) (nanoGPT: 0.02 / sqrt(2 layers)), biases 0.
Plain xp arithmetic: batched matmuls over (batch, heads), the same code on
NumPy and CuPy. Scores are computed in full (T x T) and masked; the
per-sample memory is O(heads T^2) (train_floats counts it). With compiled
layers on (numba) the softmax and its backward are one pass a row over
the unmasked part (nn/passes.py), within float32 rounding of this path.

    python -m pytest -q tests/test_transformer_layers.py -k attention
"""
import math

import numpy as np

from . import blas, compiled, passes, threads
from .layers import Context, Dropout, Layer, LayerError, Noise
from .linear import normal
from .tensor_parallel import Cut


class CausalSelfAttention(Layer):
    keeps_output = False   # its backward reads q, k, v, the attention and the heads' outputs
    kernel = "attention"
    role = "heads"   # --tensor-parallel: its heads split over the group (nn/tensor_parallel.py)

    def __init__(self, heads, dropout=0.0, std=0.02, out_std=0.02):
        self.heads, self.std, self.out_std = int(heads), float(std), float(out_std)
        if self.heads < 1:
            raise LayerError(f"CausalSelfAttention({heads}): at least one head")
        self.drop = Dropout(dropout)
        self.inner = [("drop", self.drop)]

    def join(self, group):
        """--tensor-parallel: its heads' slice, its dropout their part of the mask."""
        self.group = group
        self.drop.join(group)

    def configure(self, in_shape):
        if len(in_shape) != 2:
            raise LayerError(f"{self.describe()} takes (positions, width) per sample, not "
                             f"{'x'.join(map(str, in_shape))}")
        super().configure(in_shape)
        self.T, self.width = self.in_shape
        # --sequence-parallel: it takes and gives this rank's positions, attending over all of them
        self.sequence = self.group is not None and self.group.sequence
        if self.sequence:
            self.T *= self.group.size
        if self.width % self.heads:
            raise LayerError(f"{self.describe()}: the width {self.width} is not a multiple of the heads")
        self.head_width = self.width // self.heads
        # this rank's heads (a tensor group's slice: q, k, v column-parallel, Wo row-parallel)
        self.heads_here, self._cuts = self.heads, {}
        if self.group is not None:
            size = self.group.size
            if self.heads % size:
                raise LayerError(f"{self.describe()}: {self.heads} heads are not a multiple of --tensor-parallel "
                                 f"{size}")
            self.heads_here = self.heads // size
            bounds = tuple(range(0, self.width + 1, self.width // size))
            self._cuts = {"Wqkv": Cut(1, 3, bounds), "bqkv": Cut(0, 3, bounds), "Wo": Cut(0, 1, bounds)}
        self.inner_width = self.heads_here * self.head_width
        self.drop.configure((self.heads_here, self.T, self.T))
        return self.out_shape

    decays = ("Wqkv", "Wo")

    def param_shapes(self):
        e, i = self.width, self.inner_width
        return [("Wqkv", (e, 3 * i)), ("bqkv", (3 * i,)), ("Wo", (i, e)), ("bo", (e,))]

    def tensor_cuts(self):
        return self._cuts

    def init(self, rng, params, dtype):
        params["Wqkv"][...] = normal(rng, params["Wqkv"].shape, self.std, dtype)
        params["Wo"][...] = normal(rng, params["Wo"].shape, self.out_std, dtype)

    def bind(self, xp, params, grads, state):
        super().bind(xp, params, grads, state)
        self.drop.bind(xp, {}, {}, {})
        # compiled layers: the softmax and its backward in one pass a row, the masked half skipped
        self.compiled = compiled.on() and xp is np
        if self.compiled:
            passes.prepare(("causal_softmax", "causal_softmax_backward"))

    def _product(self, a, b, out, bias=None):
        """out = a @ b (+ bias) over the compute threads, by ranges of out's
        rows in whole BLAS row tiles (Dense's rule: the bits do not depend on
        the threads); a weight's gradient passes its input transposed as `a`."""
        xp, macs = self.xp, a.shape[0] * a.shape[1] * b.shape[1]

        def rows(t, lo, hi):
            blas.matmul(xp, a[lo:hi], b, out[lo:hi])
            if bias is not None:
                out[lo:hi] += bias
        self.in_parallel(out.shape[0], rows, unit=threads.ROW_TILE, macs=macs)

    def _samples(self, work, n, products):
        """work(thread, lo, hi) over ranges [lo, hi) of the n samples, on the compute
        threads: a range's attention, its products stacked over (sample,
        head), each product its own, `products` of them, and its row-wise
        passes, so the bits do not depend on the threads. One hand-off for
        several steps: each costs tens of microseconds."""
        t, hw, h = self.T, self.head_width, self.heads_here
        self.in_parallel(n, work,   # the products, and the passes over (t, t) arrays
                         floats=4 * n * h * t * t, macs=products * n * h * t * t * hw)

    def _softmax(self, att, dtype):
        """The causal softmax of att's scores (samples, heads, t, t), in place."""
        t = att.shape[-1]
        if self.compiled:
            passes.causal_softmax(att.reshape(-1, t, t), 1 / math.sqrt(self.head_width))
            return
        xp = self.xp
        att *= dtype.type(1 / math.sqrt(self.head_width))
        att += self._mask(t, dtype)
        att -= att.max(axis=-1, keepdims=True)
        xp.exp(att, out=att)
        att /= att.sum(axis=-1, keepdims=True)

    def _softmax_backward(self, att, datt, weighted):
        """The softmax's backward on datt in place: A (dA - rowsum(dA A)), 0 where masked (A is)."""
        t = att.shape[-1]
        if self.compiled and datt.flags.c_contiguous:
            passes.causal_softmax_backward(att.reshape(-1, t, t), datt.reshape(-1, t, t),
                                           1 / math.sqrt(self.head_width))
            return
        self.xp.multiply(datt, att, out=weighted)
        datt -= weighted.sum(axis=-1, keepdims=True)
        datt *= att
        datt *= datt.dtype.type(1 / math.sqrt(self.head_width))

    def context(self):
        return Context(self.xp, [self.drop.context()])

    def set_noise(self, ctx, noise):
        ctx.noise = noise
        self.drop.set_noise(ctx.inner[0], None if noise is None else Noise(*noise[:3], stream=noise.stream * 64 + 1))

    def _mask(self, t, dtype):
        """(t, t): 0 on and below the diagonal, -inf above; a constant of the layer."""
        mask = self._constants.get("mask")
        if mask is None or mask.shape != (t, t) or mask.dtype != dtype:
            xp = self.xp
            above = xp.arange(t).reshape(1, t) > xp.arange(t).reshape(t, 1)
            mask = self._constants["mask"] = xp.where(above, -np.inf, 0).astype(dtype)
        return mask

    def _heads(self, a, n, t, which):
        """Part `which` (0 q, 1 k, 2 v) of a (n t, 3E) array as (n, heads, t, head width), a view."""
        return a.reshape(n, t, 3, self.heads_here, self.head_width)[:, :, which].transpose(0, 2, 1, 3)

    def forward(self, ctx, x, train):
        xp, W, b = self.xp, self.params["Wqkv"], self.params["bqkv"]
        if self.sequence:   # every rank's positions
            whole = ctx.buffer("whole", (x.shape[0], self.T, x.shape[2]), x.dtype)
            self.group.allgather(x, whole)
            x = whole
        (n, t, e), h, i = x.shape, self.heads_here, self.inner_width
        rows = x.reshape(n * t, e)
        qkv = ctx.buffer("qkv", (n * t, 3 * i), W.dtype)
        self._product(rows, W, qkv, b)
        q, k, v = (self._heads(qkv, n, t, j) for j in range(3))
        att = ctx.buffer("att", (n, h, t, t), W.dtype)

        def scores(_, lo, hi):
            xp.matmul(q[lo:hi], k[lo:hi].transpose(0, 1, 3, 2), out=att[lo:hi])
            self._softmax(att[lo:hi], W.dtype)
        self._samples(scores, n, 1)
        dropped = self.drop.forward(ctx.inner[0], att, train)
        merged = ctx.buffer("merged", (n, t, h, self.head_width), W.dtype)
        heads = merged.transpose(0, 2, 1, 3)   # each head's (t, head width) rows i apart: BLAS writes them there

        def weigh(_, lo, hi):
            xp.matmul(dropped[lo:hi], v[lo:hi], out=heads[lo:hi])
        self._samples(weigh, n, 1)
        merged = merged.reshape(n * t, i)
        y = ctx.buffer("partial" if self.sequence else ("out", train), (n * t, e), W.dtype)
        whole = self.group is None   # else the bias after the sum over the group
        self._product(merged, self.params["Wo"], y, self.params["bo"] if whole else None)
        ctx.rows, ctx.heads, ctx.att, ctx.dropped, ctx.merged = rows, (q, k, v), att, dropped, merged
        if self.sequence:   # summed over the group, this rank's positions kept
            out = ctx.buffer(("out", train), (n, *self.in_shape), W.dtype)
            self.group.reduce_scatter(y.reshape(n, t, e), out)
            out += self.params["bo"]
            return out
        if not whole:   # each rank's heads' part of the projection, added over the group
            self.group.sum(y)
            y += self.params["bo"]
        return y.reshape(n, t, e)

    def backward(self, ctx, dy, need_dx):
        xp, Wo = self.xp, self.params["Wo"]
        if self.sequence:   # bo's gradient from this rank's positions, summed; then every rank's positions
            dy.reshape(-1, dy.shape[-1]).sum(axis=0, out=self.grads["bo"])
            self.group.sum(self.grads["bo"])
            whole = ctx.buffer("dwhole", (dy.shape[0], self.T, dy.shape[2]), dy.dtype)
            self.group.allgather(dy, whole)
            dy = whole
        (n, t, e), h, i = dy.shape, self.heads_here, self.inner_width
        d = dy.reshape(n * t, e)
        dmerged = ctx.buffer("dmerged", (n * t, i), dy.dtype)

        def out_weight():
            self._product(ctx.merged.T, d, self.grads["Wo"])
            if not self.sequence:
                d.sum(axis=0, out=self.grads["bo"])
        self.pair(out_weight, lambda: self._product(d, Wo.T, dmerged))
        # the heads' gradients read and q, k, v's written in place, rows i (3 i) apart: BLAS takes a
        # matrix's row stride as it is (lda, ldc) and packs its operands anyway, so these are the bits
        # of contiguous copies, without the copies
        dheads = dmerged.reshape(n, t, h, self.head_width).transpose(0, 2, 1, 3)
        q, k, v = ctx.heads
        dqkv = ctx.buffer("dqkv", (n * t, 3 * i), dy.dtype)
        dq, dk, dv = (self._heads(dqkv, n, t, j) for j in range(3))
        datt = ctx.buffer("datt", (n, h, t, t), dy.dtype)
        dropped = ctx.dropped

        def values(_, lo, hi):   # dv = A^T dheads; dA = dheads v^T
            xp.matmul(dropped[lo:hi].transpose(0, 1, 3, 2), dheads[lo:hi], out=dv[lo:hi])
            xp.matmul(dheads[lo:hi], v[lo:hi].transpose(0, 1, 3, 2), out=datt[lo:hi])
        self._samples(values, n, 2)
        datt = self.drop.backward(ctx.inner[0], datt, True)
        weighted = None if self.compiled and datt.flags.c_contiguous else ctx.buffer("weighted", datt.shape, dy.dtype)

        def keys(_, lo, hi):   # the softmax's backward, then dq = dS k, dk = dS^T q
            self._softmax_backward(ctx.att[lo:hi], datt[lo:hi], None if weighted is None else weighted[lo:hi])
            xp.matmul(datt[lo:hi], k[lo:hi], out=dq[lo:hi])
            xp.matmul(datt[lo:hi].transpose(0, 1, 3, 2), q[lo:hi], out=dk[lo:hi])
        self._samples(keys, n, 2)

        def in_weight():
            self._product(ctx.rows.T, dqkv, self.grads["Wqkv"])
            dqkv.sum(axis=0, out=self.grads["bqkv"])
        dx = ctx.buffer("dx", (n * t, e), dy.dtype) if need_dx else None
        if not need_dx:
            in_weight()
            return None
        self.pair(in_weight, lambda: self._product(dqkv, self.params["Wqkv"].T, dx))
        if self.sequence:   # summed over the group, this rank's positions kept
            part = ctx.buffer("dpart", (n, *self.in_shape), dy.dtype)
            self.group.reduce_scatter(dx.reshape(n, t, e), part)
            return part
        if self.group is not None:   # each rank's heads' part of the input gradient, added over the group
            self.group.sum(dx)
        return dx.reshape(n, t, e)

    def train_floats(self):
        t, e, h, i = self.T, self.width, self.heads_here, self.inner_width
        # forward: qkv (3), merged (this rank's heads' width; the heads write into it), out; backward:
        # dmerged, dqkv (3) (the same), dx; the attention, its gradient and the softmax's scratch
        # (heads t^2 each), the dropout's
        return 8 * t * i + 3 * t * e + 3 * h * t * t + self.drop.train_floats()

    def flops(self):
        t, e, i = self.T, self.width, self.inner_width
        return 4 * t * e * i + 2 * t * t * i   # the two projections; scores and A v in full (the mask after)

    def describe(self):
        drop = f", dropout={self.drop.p:g}" if self.drop.p else ""
        return f"CausalSelfAttention({self.heads}{drop})"
