"""LayerNorm on the layer contract (nn/layers.py): each position's vector
normalised over its last axis (mean 0, variance 1, the biased variance as
PyTorch's nn.LayerNorm), then scaled and shifted per feature: gamma
(starts at 1) and beta (starts at 0); eps 1e-5. Any leading shape: a
transformer's (batch, T, E), a flat (batch, E).

    python -m pytest -q tests/test_transformer_layers.py -k LayerNorm
"""
import math

import numpy as np

from . import compiled, passes, threads
from .layers import Layer

EPS = 1e-5


class LayerNorm(Layer):
    """y = (x - mean) / sqrt(var + eps) * gamma + beta over the last axis."""
    keeps_output = False   # its backward reads the normalised input and 1/std
    tokenwise = True
    kernel = "layer norm"
    # joined to a tensor group (--sequence-parallel): it normalises this rank's positions (nn/tensor_parallel.py)

    def __init__(self, eps=EPS):
        self.eps = float(eps)

    def configure(self, in_shape):
        super().configure(in_shape)
        self.width = self.in_shape[-1]
        return self.out_shape

    def param_shapes(self):
        return [("gamma", (self.width,)), ("beta", (self.width,))]

    def init(self, rng, params, dtype):
        params["gamma"][...] = 1

    def bind(self, xp, params, grads, state):
        super().bind(xp, params, grads, state)
        # compiled layers: a row's statistics and its normalising in one pass each way (nn/passes.py)
        self.compiled = compiled.on() and xp is np
        if self.compiled:
            passes.prepare(("layer_norm", "layer_norm_backward"))

    def _rows(self, work, rows):
        """work(thread, lo, hi) over row ranges [lo, hi) of rows, on the compute threads."""
        # the compiled passes take some 0.6 ns an element: a part of MIN_FLOATS is worth its hand-off
        self.in_parallel(len(rows), work, floats=rows.size)

    def forward(self, ctx, x, train):
        xp, gamma, beta = self.xp, self.params["gamma"], self.params["beta"]
        rows = x.reshape(-1, self.width)
        if self.compiled and rows.flags.c_contiguous:
            xhat = ctx.xhat = ctx.buffer("xhat", rows.shape, x.dtype)
            rstd = ctx.rstd = ctx.buffer("rstd", (rows.shape[0], 1), x.dtype)
            y = ctx.buffer(("out", train), rows.shape, x.dtype)
            self._rows(lambda _, lo, hi: passes.layer_norm(rows[lo:hi], gamma, beta, self.eps, xhat[lo:hi],
                                                           rstd[lo:hi].reshape(-1), y[lo:hi]), rows)
            return y.reshape(x.shape)
        xhat = ctx.buffer("xhat", rows.shape, x.dtype)
        xp.subtract(rows, rows.mean(axis=1, keepdims=True), out=xhat)
        rstd = ctx.buffer("rstd", (rows.shape[0], 1), x.dtype)
        scratch = ctx.buffer("scratch", rows.shape, x.dtype)
        xp.multiply(xhat, xhat, out=scratch)
        scratch.mean(axis=1, keepdims=True, out=rstd)
        rstd += x.dtype.type(self.eps)
        xp.sqrt(rstd, out=rstd)
        xp.divide(1, rstd, out=rstd)
        xhat *= rstd
        y = ctx.buffer(("out", train), rows.shape, x.dtype)
        xp.multiply(xhat, gamma, out=y)
        y += beta
        ctx.xhat, ctx.rstd = xhat, rstd
        return y.reshape(x.shape)

    def backward(self, ctx, dy, need_dx):
        xp, xhat, rstd = self.xp, ctx.xhat, ctx.rstd
        d = dy.reshape(-1, self.width)
        scratch = ctx.buffer("scratch", d.shape, dy.dtype)

        def sums():   # gamma's and beta's gradients
            xp.multiply(d, xhat, out=scratch)
            scratch.sum(axis=0, out=self.grads["gamma"])
            d.sum(axis=0, out=self.grads["beta"])
        g = ctx.buffer("dx", d.shape, dy.dtype) if need_dx else None
        compiled = self.compiled and d.flags.c_contiguous
        gamma = self.params["gamma"]

        def inputs():   # dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy gamma: a pass a row
            self._rows(lambda _, lo, hi: passes.layer_norm_backward(d[lo:hi], gamma, xhat[lo:hi],
                                                                    rstd[lo:hi].reshape(-1), g[lo:hi]), d)
        if need_dx and compiled and self.group is None and self.width > 1:
            if threads.serial():   # one thread: the sums in the same pass, NumPy's column sums' bits
                both = ctx.buffer("both", (2, self.width), dy.dtype)
                passes.layer_norm_backward(d, gamma, xhat, rstd.reshape(-1), g, both)
                self.grads["gamma"][...], self.grads["beta"][...] = both
                return g.reshape(dy.shape)
            self.pair(inputs, sums)   # on two threads, the sums beside it (threads.pair)
            return g.reshape(dy.shape)
        sums()
        if self.group is not None:   # --sequence-parallel: this rank's positions' part, summed over the group
            both = ctx.buffer("both", (2, self.width), dy.dtype)
            both[0], both[1] = self.grads["gamma"], self.grads["beta"]
            self.group.sum(both)
            self.grads["gamma"][...], self.grads["beta"][...] = both
        if not need_dx:
            return None
        if compiled:
            inputs()
            return g.reshape(dy.shape)
        xp.multiply(d, gamma, out=g)
        xp.multiply(g, xhat, out=scratch)
        m2 = scratch.mean(axis=1, keepdims=True)
        m1 = g.mean(axis=1, keepdims=True)
        xp.multiply(xhat, m2, out=scratch)
        g -= m1
        g -= scratch
        g *= rstd
        return g.reshape(dy.shape)

    def train_floats(self):
        # its output, the normalised input, scratch, the input gradient
        return 4 * math.prod(self.in_shape) + math.prod(self.in_shape[:-1])

    def flops(self):
        return 4 * math.prod(self.in_shape)

    def describe(self):
        return "LayerNorm" if self.eps == EPS else f"LayerNorm(eps={self.eps:g})"

