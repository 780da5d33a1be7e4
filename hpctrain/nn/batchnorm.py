"""Batch normalisation on the layer contract (nn/layers.py): BatchNorm2d
(per channel of an NHWC image) and BatchNorm1d (per feature of a flat
input), one code: statistics over every axis but the last.

Training normalises with the statistics of this rank's own batch (what DDP
does by default) and updates the running mean and variance, PyTorch's way:
running = 0.9 * running + 0.1 * batch, the variance unbiased (m/(m-1)).
Evaluation uses the running statistics. They are non-trainable state
(`state_shapes`: running_mean, running_var; starting at 0 and 1), in the
model's state buffer, outside the gradient. Each rank's running statistics
follow its own batches, so the loops make them agree before evaluation,
checkpoint and --save (docs/models.md: who averages them).
gamma starts at 1, beta at 0.

With compiled layers on (--compiled-layers, nn/compiled.py) training runs
numba's kernels (nn/passes.py): the statistics and the gradient's sums in float64, the
elementwise passes fused (the same float32 operations per element).

    python -m hpctrain.nn --model resnet --shape 32,32,3
"""
import math

import numpy as np

from . import compiled, passes
from .layers import Layer, LayerError

MOMENTUM = 0.1
EPS = 1e-5
# Floats in a row of the tiled per-channel passes (_rows): long enough to
# vectorise, short enough that the tiled operands stay in L1.
TILE_FLOATS = 2048


class _BatchNorm(Layer):
    rank = None   # the input's rank per sample: 3 (h, w, c) or 1 (features)
    keeps_output = False   # its backward reads its normalised input (NumPy) or its input (compiled), not y
    kernel = "batch norm"

    def configure(self, in_shape):
        if len(in_shape) != self.rank:
            want = "an image (height x width x channels)" if self.rank == 3 else "a flat input"
            raise LayerError(f"{self.describe()} takes {want}, not {'x'.join(map(str, in_shape))}")
        super().configure(in_shape)
        self.channels = self.in_shape[-1]
        per_sample = math.prod(self.in_shape[:-1])
        self.tile = max(d for d in range(1, per_sample + 1)
                        if per_sample % d == 0 and (d == 1 or d * self.channels <= TILE_FLOATS))
        return self.out_shape

    def param_shapes(self):
        return [("gamma", (self.channels,)), ("beta", (self.channels,))]

    def state_shapes(self):
        return [("running_mean", (self.channels,)), ("running_var", (self.channels,))]

    def init(self, rng, params, dtype):
        params["gamma"][...] = 1

    def init_state(self, state):
        state["running_mean"][...] = 0
        state["running_var"][...] = 1

    def bind(self, xp, params, grads, state):
        super().bind(xp, params, grads, state)
        self.compiled = compiled.on() and xp is np
        if self.compiled:   # compiled now (or loaded from numba's cache), not in the first step
            passes.prepare_batchnorm(self.channels, params["gamma"].dtype)

    # --- passes over (m, c) with c narrow ---------------------------------------
    # NumPy runs an (m, c) array's per-channel work slowly when c is narrow
    # (16 channels: the inner loop is 16 floats long): x2.sum(axis=0) took
    # 0.71 ms on 32768 x 16 where the GEMV ones @ x2 took 0.03, and x2 - mean
    # 0.28 ms where a same-shape subtract took 0.06. So the sums are GEMVs
    # (what Conv2d's bias gradient does), one per sample's pixels, their
    # results added in float64: one float32 GEMV over a batch's 25,088
    # pixels left resnet's gradients 1.2e-3 (relative) from float64's, these
    # 6.9e-7, for 7% more time a pass. The per-channel operands are
    # tiled along rows of r pixels (r * c floats a row): the same float
    # operation on every element, in long vectorised loops.
    def _rows(self, m):
        """(rows, width) to view an (m, c) array as: rows of `tile` whole
        pixels (a divisor of a sample's pixels, so rows never split one)."""
        return m // self.tile, self.tile * self.channels

    def _column_sums(self, a2):
        """Each column's sum of a2 (m, c), in a2's dtype: GEMVs over one
        sample's pixels each, their results added in float64."""
        per = math.prod(self.in_shape[:-1])
        n = a2.shape[0] // per
        part = self.xp.matmul(self.ones(per, a2.dtype), a2.reshape(n, per, a2.shape[1]))
        return part.sum(axis=0, dtype=np.float64).astype(a2.dtype)

    def _tiled(self, v, width):
        return self.xp.tile(v, width // self.channels)

    def forward(self, ctx, x, train):
        xp, c = self.xp, self.channels
        m = x.size // c
        shape = self._rows(m)
        xw = x.reshape(shape)
        y = ctx.buffer(("out", train), shape, x.dtype)
        # The sums whole, here; the elementwise passes over row ranges on
        # the compute threads (Layer.split): the same bits on any number.
        if not train:
            scale = self.params["gamma"] / xp.sqrt(self.state["running_var"] + EPS)
            mean, scale, beta = (self._tiled(v, shape[1]) for v in (self.state["running_mean"], scale,
                                                                       self.params["beta"]))

            def evaluate(t, lo, hi):
                xp.subtract(xw[lo:hi], mean, out=y[lo:hi])
                y[lo:hi] *= scale
                y[lo:hi] += beta
            self.in_parallel(shape[0], evaluate, floats=x.size)
            return y.reshape(x.shape)
        if self.compiled:
            mean, var = self._compiled_forward(ctx, x.reshape(m, c), y.reshape(m, c))
        else:
            mean, var = self._numpy_forward(ctx, x, y, shape)
        run_mean, run_var = self.state["running_mean"], self.state["running_var"]
        run_mean *= 1 - MOMENTUM
        run_mean += MOMENTUM * mean
        run_var *= 1 - MOMENTUM
        run_var += (MOMENTUM * m / max(m - 1, 1)) * var
        return y.reshape(x.shape)

    def _compiled_forward(self, ctx, x2, y2):
        """nn/passes.py's statistics (float64, on this thread) and one
        normalising pass over row ranges: (mean, variance) in x's dtype."""
        m, dtype = x2.shape[0], x2.dtype
        x2 = np.ascontiguousarray(x2)
        mean64, var64 = passes.bn_statistics(x2)
        mean, var = mean64.astype(dtype), var64.astype(dtype)
        ctx.inv_std = inv_std = (1 / np.sqrt(var64 + EPS)).astype(dtype)
        # x, not xhat, kept for the backward, which computes xhat again
        # with the same float32 operations (the same bits): one write fewer
        # a pass, one buffer fewer (a Conv2d keeps its input so too).
        # Measured in resnet's step (one thread, batch 32, the best of four
        # interleaved runs of 40 steps): its 9 layers' passes 7.5 -> 5.7 ms.
        ctx.x2, ctx.mean = x2, mean
        gamma, beta = self.params["gamma"], self.params["beta"]
        self.in_parallel(m, lambda t, lo, hi: passes.bn_normalise(x2[lo:hi], mean, inv_std, gamma, beta, y2[lo:hi]),
                         floats=x2.size)
        return mean, var

    def _numpy_forward(self, ctx, x, y, shape):
        """GEMV sums and tiled passes: (mean, variance)."""
        xp, c = self.xp, self.channels
        m = x.size // c
        xw = x.reshape(shape)
        mean = self._column_sums(x.reshape(m, c)) / m
        xhat = ctx.buffer("xhat", shape, x.dtype)
        prod = ctx.buffer("prod", shape, x.dtype)
        tiled = self._tiled(mean, shape[1])

        def centre(t, lo, hi):
            xp.subtract(xw[lo:hi], tiled, out=xhat[lo:hi])
            xp.multiply(xhat[lo:hi], xhat[lo:hi], out=prod[lo:hi])
        self.in_parallel(shape[0], centre, floats=x.size)
        var = self._column_sums(prod.reshape(m, c)) / m
        ctx.inv_std = 1 / xp.sqrt(var + EPS)
        inv_std, gamma, beta = (self._tiled(v, shape[1]) for v in (ctx.inv_std, self.params["gamma"],
                                                                    self.params["beta"]))

        def normalise(t, lo, hi):
            xhat[lo:hi] *= inv_std
            xp.multiply(xhat[lo:hi], gamma, out=y[lo:hi])
            y[lo:hi] += beta
        self.in_parallel(shape[0], normalise, floats=x.size)
        ctx.xhat = xhat
        return mean, var

    def backward(self, ctx, dy, need_dx):
        xp, c = self.xp, self.channels
        m = dy.size // c
        if self.compiled:
            return self._compiled_backward(ctx, dy, need_dx)
        xhat = ctx.xhat
        shape = xhat.shape
        dyw = dy.reshape(shape)
        g_gamma, g_beta = self.grads["gamma"], self.grads["beta"]
        g_beta[...] = self._column_sums(dy.reshape(m, c))
        prod = ctx.buffer("prod", shape, dy.dtype)
        self.in_parallel(shape[0], lambda t, lo, hi: xp.multiply(dyw[lo:hi], xhat[lo:hi], out=prod[lo:hi]),
                         floats=dy.size)
        g_gamma[...] = self._column_sums(prod.reshape(m, c))
        if not need_dx:
            return None
        # dx = gamma/std * (dy - mean(dy) - xhat * mean(dy * xhat))
        dx = ctx.buffer("dx", shape, dy.dtype)
        a, b, scale = (self._tiled(v, shape[1]) for v in (g_gamma / m, g_beta / m,
                                                           self.params["gamma"] * ctx.inv_std))

        def rows(t, lo, hi):
            xp.multiply(xhat[lo:hi], a, out=dx[lo:hi])
            dx[lo:hi] += b
            xp.subtract(dyw[lo:hi], dx[lo:hi], out=dx[lo:hi])
            dx[lo:hi] *= scale
        self.in_parallel(shape[0], rows, floats=dy.size)
        return dx.reshape(dy.shape)

    def _compiled_backward(self, ctx, dy, need_dx):
        """nn/passes.py's sums (float64, on this thread) and one pass for
        dx over row ranges, the NumPy path's formula."""
        x2, mean, inv_std = ctx.x2, ctx.mean, ctx.inv_std
        m, c = x2.shape
        dy2 = np.ascontiguousarray(dy.reshape(m, c))
        sums = passes.bn_gradient_sums(dy2, x2, mean, inv_std)
        g_gamma, g_beta = self.grads["gamma"], self.grads["beta"]
        g_beta[...] = sums[0]
        g_gamma[...] = sums[1]
        if not need_dx:
            return None
        dx = ctx.buffer("dx", (m, c), dy.dtype)
        a, b, scale = g_gamma / m, g_beta / m, self.params["gamma"] * inv_std
        self.in_parallel(m, lambda t, lo, hi: passes.bn_input_gradient(dy2[lo:hi], x2[lo:hi], mean, inv_std, a, b,
                                                                         scale, dx[lo:hi]),
                         floats=dy.size)
        return dx.reshape(dy.shape)

    def train_floats(self):
        # NumPy's: output, normalised input, scratch, input gradient (compiled
        # layers hold fewer: output and input gradient; the check counts the most)
        return 4 * math.prod(self.in_shape)

    def flops(self):
        return 2 * math.prod(self.in_shape)

    def describe(self):
        return type(self).__name__


class BatchNorm2d(_BatchNorm):
    """Batch norm per channel of an NHWC image."""
    rank = 3


class BatchNorm1d(_BatchNorm):
    """Batch norm per feature of a flat (batch, features) input. A batch of
    one sample would normalise every feature to 0 (a constant: PyTorch
    refuses it too), so it needs two samples per rank."""
    rank = 1
    min_batch = 2
