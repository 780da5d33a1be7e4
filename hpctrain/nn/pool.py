"""Pooling layers on the layer contract (nn/layers.py), NHWC like the
convolutions (nn/conv.py): MaxPool2d, AvgPool2d, GlobalAvgPool.

Each window pass is done one kernel offset at a time, k*k strided passes
over the output, never a gathered copy of the windows; with compiled layers
on (--compiled-layers), max pooling whose windows lie k apart (the zoo's)
runs one compiled pass each way (nn/passes.py), the same bits.

    python -m hpctrain.nn --model small_cnn --shape 32,32,3
"""
import math

import numpy as np

from . import compiled, passes
from .conv import _image, _out_size
from .layers import Layer, LayerError


def _offset_slices(oh, ow, k, s):
    """(kh, kw, the slice of x's rows, of its columns) for each kernel offset of a pool."""
    for kh in range(k):
        for kw in range(k):
            yield kh, kw, slice(kh, kh + s * (oh - 1) + 1, s), slice(kw, kw + s * (ow - 1) + 1, s)


class _Pool(Layer):
    keeps_output = False   # the backward reads the winners (max) or nothing (mean)

    def __init__(self, k, stride=None):
        self.k = int(k)
        self.stride = self.k if stride is None else int(stride)
        if min(self.k, self.stride) < 1:
            raise LayerError(f"{self.describe()}: kernel and stride must be at least 1")

    def configure(self, in_shape):
        h, w, c = _image(self, in_shape)
        super().configure(in_shape)
        self.oh, self.ow = _out_size(self, h, self.k, self.stride, 0), _out_size(self, w, self.k, self.stride, 0)
        self.out_shape = (self.oh, self.ow, c)
        return self.out_shape

    def _dx(self, ctx, dy):
        """The input gradient's buffer, zeroed where no window writes (or
        everywhere, when windows overlap and offsets add up)."""
        dx = ctx.buffer("dx", (dy.shape[0], *self.in_shape), dy.dtype)
        if self.stride != self.k or self.oh * self.k != self.in_shape[0] or self.ow * self.k != self.in_shape[1]:
            dx.fill(0)
        return dx

    def train_floats(self):
        return 2 * math.prod(self.out_shape) + math.prod(self.in_shape)

    def flops(self):
        return math.prod(self.out_shape) * self.k * self.k

    def describe(self):
        return f"{type(self).__name__}({self.k}{'' if self.stride == self.k else f',s{self.stride}'})"


class MaxPool2d(_Pool):
    """The largest value of each k x k window (stride defaults to k, no
    padding); its gradient goes to the first maximum of the window, as in
    PyTorch. Done one kernel offset at a time: k*k strided passes over the
    output, and which offset won kept as one byte per output (updated by
    arithmetic, not a masked copy, which is branchy and slow): a byte up to
    16 x 16 windows, two bytes above."""

    def configure(self, in_shape):
        out = super().configure(in_shape)
        self.offsets = np.uint8 if self.k * self.k <= 256 else np.uint16 if self.k * self.k <= 65536 else np.uint32
        return out

    @property
    def kernel(self):
        return "max pool" if self.compiled_fits() else None   # (nn/kernels_used.py)

    def compiled_fits(self, xp=np):
        """Whether this layer runs nn/passes.py's compiled passes (configured)."""
        return compiled.on() and xp is np and self.stride == self.k and self.offsets is np.uint8

    def bind(self, xp, params, grads, state):
        super().bind(xp, params, grads, state)
        # Compiled layers on: windows k apart (the zoo's) in one pass each
        # way, the same bits (nn/passes.py); the rest as below.
        self.compiled = self.compiled_fits(xp)
        if self.compiled:
            passes.prepare(("max_pool_forward", "max_pool_backward"))

    def forward(self, ctx, x, train):
        xp = self.xp
        y = ctx.buffer(("out", train), (x.shape[0], *self.out_shape), x.dtype)
        won = ctx.won = ctx.buffer("won", y.shape, self.offsets)
        if self.compiled:
            x = np.ascontiguousarray(x)
            self.in_parallel(x.shape[0], lambda t, lo, hi: passes.max_pool_forward(x[lo:hi], y[lo:hi], won[lo:hi],
                                                                                     self.k),
                             floats=x.size)
            return y
        gt = ctx.buffer("gt", y.shape, bool)
        offset = ctx.buffer("offset", y.shape, self.offsets)
        for kh, kw, rows, cols in _offset_slices(self.oh, self.ow, self.k, self.stride):
            window = x[:, rows, cols, :]
            if kh == kw == 0:
                xp.copyto(y, window)
                won.fill(0)
                continue
            xp.greater(window, y, out=gt)
            # won = this offset where gt, else won; offsets only grow, so that is a maximum
            xp.multiply(gt, self.offsets(kh * self.k + kw), out=offset)
            xp.maximum(won, offset, out=won)
            xp.maximum(y, window, out=y)
        return y

    def backward(self, ctx, dy, need_dx):
        if not need_dx:
            return None
        xp = self.xp
        dx, won = self._dx(ctx, dy), ctx.won
        if self.compiled:
            dy = np.ascontiguousarray(dy)
            self.in_parallel(dy.shape[0], lambda t, lo, hi: passes.max_pool_backward(dy[lo:hi], won[lo:hi], dx[lo:hi],
                                                                                       self.k),
                             floats=dx.size)
            return dx
        hit = ctx.buffer("gt", dy.shape, bool)
        part = ctx.buffer("part", dy.shape, dy.dtype)
        overlap = self.stride < self.k
        for kh, kw, rows, cols in _offset_slices(self.oh, self.ow, self.k, self.stride):
            xp.equal(won, self.offsets(kh * self.k + kw), out=hit)
            if overlap:
                xp.multiply(dy, hit, out=part)
                dx[:, rows, cols, :] += part
            else:
                xp.multiply(dy, hit, out=dx[:, rows, cols, :])
        return dx


class AvgPool2d(_Pool):
    """The mean of each k x k window (stride defaults to k, no padding)."""

    def forward(self, ctx, x, train):
        y = ctx.buffer(("out", train), (x.shape[0], *self.out_shape), x.dtype)
        for kh, kw, rows, cols in _offset_slices(self.oh, self.ow, self.k, self.stride):
            if kh == kw == 0:
                self.xp.copyto(y, x[:, rows, cols, :])
            else:
                y += x[:, rows, cols, :]
        y *= 1.0 / (self.k * self.k)
        return y

    def backward(self, ctx, dy, need_dx):
        if not need_dx:
            return None
        dx = self._dx(ctx, dy)
        share = ctx.buffer("share", dy.shape, dy.dtype)
        self.xp.multiply(dy, 1.0 / (self.k * self.k), out=share)
        for _, _, rows, cols in _offset_slices(self.oh, self.ow, self.k, self.stride):
            if self.stride < self.k:
                dx[:, rows, cols, :] += share
            else:
                dx[:, rows, cols, :] = share
        return dx


class GlobalAvgPool(Layer):
    """(batch, h, w, c) -> (batch, c): each channel's mean over the image."""
    keeps_output = False

    def configure(self, in_shape):
        h, w, c = _image(self, in_shape)
        super().configure(in_shape)
        self.out_shape = (c,)
        return self.out_shape

    def forward(self, ctx, x, train):
        y = ctx.buffer(("out", train), (x.shape[0], x.shape[3]), x.dtype)
        x.sum(axis=(1, 2), out=y)
        y *= 1.0 / (x.shape[1] * x.shape[2])
        return y

    def backward(self, ctx, dy, need_dx):
        if not need_dx:
            return None
        h, w, c = self.in_shape
        dx = ctx.buffer("dx", (dy.shape[0], h, w, c), dy.dtype)
        self.xp.multiply(dy.reshape(dy.shape[0], 1, 1, c), 1.0 / (h * w), out=dx)
        return dx

    def train_floats(self):
        return 2 * self.out_shape[0] + math.prod(self.in_shape)

    def flops(self):
        return math.prod(self.in_shape)
