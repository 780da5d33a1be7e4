"""Image layers on the layer contract (nn/layers.py): Channels (the data
boundary) and Conv2d; the pooling layers are in nn/pool.py.

Activations are NHWC: (batch, height, width, channels). Why, for an im2col
design: the columns are (batch*oh*ow, kh*kw*c), one row per output pixel, so
`columns @ W` (W as (kh*kw*c, out)) is already the next layer's NHWC output,
and `dy @ W.T` is already the columns' gradient; NCHW would need a transpose
of the output in forward and of dy in backward around each GEMM (or one
small GEMM per image). Measured here (batch 32, 3x3 kernels, one thread,
CPU time), im2col's copy: 2.5 ms NHWC against 2.4 NCHW for 32x32x3 ->32, and
2.2 against 8.9 ms for 16x16x32 ->64 (NCHW's windows copy runs of 3 floats,
NHWC's of 3 x channels); NCHW's transposes on top: the output 1.3 and 0.45 ms,
dy 4.0 and 0.8 ms, per layer and step. The data need nothing either: CIFAR shards are stored HWC, and MNIST-family
images (no channel axis) gain one of size 1, a view (`Channels`).

Each convolution is one GEMM per batch for the forward pass, one for the
weight gradient and one for the input gradient; the columns come from a
strided window view of the (padded) input in one copy, and col2im adds the
columns' gradient back one kernel offset at a time (kh*kw strided adds,
never np.add.at). Buffers are kept between calls: a warm step allocates
only the small temporaries of reductions. Where a rank has several cores
(nn/threads.py, --threads), the blocks of images are shared out over its
compute threads, each block the GEMM one thread would do, the weight
gradient's blocks summed in block order: the same bits on any number.
With compiled layers on (--compiled-layers, nn/compiled.py) layers with 16,
32 or 64 output channels run direct kernels instead: no columns, the
input read in place; the rest of this module stays as it is.

    python -m hpctrain.nn --model small_cnn --shape 32,32,3
"""
import math

import numpy as np

from ..base import tuning
from . import blas, compiled, threads
from .layers import Layer, LayerError, he_normal


# im2col's blocks of images (BLOCK_FLOATS) and when the weight gradient
# writes its columns again (AGAIN_FROM): measured in hpctrain/base/tuning.py, one
# value on every CPU (they decide the order the weight gradient sums in).
BLOCK_FLOATS, AGAIN_FROM = tuning.BLOCK_FLOATS, tuning.AGAIN_FROM


def _shape(shape):
    return "x".join(map(str, shape))


def _image(layer, in_shape):
    if len(in_shape) != 3:
        raise LayerError(f"{layer.describe()} takes an image (height x width x channels), not {_shape(in_shape)}: "
                         f"put Channels() first, and nothing that flattens before it")
    return in_shape


def _out_size(layer, size, k, stride, pad):
    out = (size + 2 * pad - k) // stride + 1
    if out < 1:
        raise LayerError(f"{layer.describe()} on {size} pixels gives less than 1x1 (kernel {k}, padding {pad})")
    return out


def _window(xp, x, oh, ow, k, s):
    """The (n, oh, ow, k, k, c) view of x's k x k windows, stride s."""
    sn, sh, sw, sc = x.strides
    return xp.lib.stride_tricks.as_strided(x, (x.shape[0], oh, ow, k, k, x.shape[3]),
                                           (sn, s * sh, s * sw, sh, sw, sc))


class Channels(Layer):
    """The data boundary of an image model: (h, w) images gain a channel
    axis of 1, (h, w, c) images (CIFAR, stored HWC) are already NHWC. A view:
    the conversion is free and happens once per batch, not per layer."""
    view = True

    def configure(self, in_shape):
        super().configure(in_shape)
        if len(self.in_shape) == 2:
            self.out_shape = (*self.in_shape, 1)
        elif len(self.in_shape) != 3:
            raise LayerError(f"Channels() takes images (height x width [x channels]), not {_shape(self.in_shape)}")
        return self.out_shape

    def forward(self, ctx, x, train):
        return x.reshape(x.shape[0], *self.out_shape)

    def backward(self, ctx, dy, need_dx):
        return dy.reshape(dy.shape[0], *self.in_shape) if need_dx else None


class Conv2d(Layer):
    """2-D convolution, NHWC, square kernel: W is (k, k, in_channels,
    out_channels), b (out_channels,). He/Kaiming normal weights (variance
    2/fan_in, fan_in = k*k*in_channels), drawn from the rng init is given
    (the layer's own stream, (seed, its index): nn/sequential.py); zero bias."""
    keeps_output = False   # its backward reads its input's columns
    needs_params_without_dx = False   # dW from its input's columns and dy, db from dy

    def __init__(self, out_channels, kernel, stride=1, padding=0, bias=True):
        self.out_channels, self.k, self.stride, self.pad = int(out_channels), int(kernel), int(stride), int(padding)
        self.bias = bool(bias)
        if min(self.out_channels, self.k, self.stride) < 1 or self.pad < 0:
            raise LayerError(f"{self.describe()}: channels, kernel and stride must be at least 1, padding at least 0")

    def configure(self, in_shape):
        h, w, c = _image(self, in_shape)
        super().configure(in_shape)
        self.oh = _out_size(self, h, self.k, self.stride, self.pad)
        self.ow = _out_size(self, w, self.k, self.stride, self.pad)
        self.fan_in = self.k * self.k * c
        self.out_shape = (self.oh, self.ow, self.out_channels)
        return self.out_shape

    decays = ("W",)

    def param_shapes(self):
        shapes = [("W", (self.k, self.k, self.in_shape[2], self.out_channels))]
        return shapes + [("b", (self.out_channels,))] if self.bias else shapes

    def init(self, rng, params, dtype):
        params["W"][...] = he_normal(rng, params["W"].shape, self.fan_in, dtype)

    def bind(self, xp, params, grads, state):
        super().bind(xp, params, grads, state)
        self.W2, self.dW2 = params["W"].reshape(self.fan_in, -1), grads["W"].reshape(self.fan_in, -1)
        self.direct = self.direct_fits(xp)
        if self.direct:   # compiled now (or loaded from numba's cache), not in the first step
            compiled.prepare_conv(self.k, self.stride, self.pad, self.in_shape[2], self.out_channels,
                                  params["W"].dtype, self._direct_dx(), self.in_shape[1], self.ow)

    @property
    def kernel(self):   # (nn/kernels_used.py) im2col's GEMM where the direct kernel does not fit
        return "direct conv" if self.direct_fits() else "conv"

    def direct_fits(self, xp=np):
        """Whether this layer runs nn/compiled.py's direct kernels: compiled
        layers on, NumPy, outputs the kernels have blocks for here
        (compiled.fits: 16, 32, 64), and not a 1x1 stride-1 layer unpadded
        (its columns are its input: one GEMM, nothing copied)."""
        return compiled.on() and xp is np and compiled.fits(self.out_channels) and \
            not (self.k == 1 and self.stride == 1 and self.pad == 0)

    def _direct_dx(self):
        """How the input gradient runs direct, where the input's width fits:
        "turned" (stride 1: dy padded and convolved with W turned round, the
        forward kernel), "gathered" (strided: compiled.input_gradient), or
        None (im2col's: dy @ W.T and col2im)."""
        if not compiled.fits(self.in_shape[2]):
            return None
        return "turned" if self.stride == 1 and self.pad < self.k else "gathered"

    def _per_block(self, n, floats_per_image):
        """Images per block of columns: about BLOCK_FLOATS floats, so a block's
        columns are still in cache when its GEMM reads them (NumPy; a GPU
        takes the whole batch in one GEMM)."""
        if self.xp is not np:
            return n
        return max(1, min(n, BLOCK_FLOATS // floats_per_image))

    def forward(self, ctx, x, train):
        xp, n, (h, w, c), p = self.xp, x.shape[0], self.in_shape, self.pad
        y = ctx.buffer(("out", train), (n * self.oh * self.ow, self.out_channels), x.dtype)
        if self.k == 1 and self.stride == 1 and p == 0:   # the columns are x itself
            ctx.cols = cols = x.reshape(n * h * w, c)

            def product(t, lo, hi):
                out = y[lo * h * w:hi * h * w]
                blas.matmul(xp, cols[lo * h * w:hi * h * w], self.W2, out)
                if self.bias:
                    out += self.params["b"]
            self.in_parallel(n, product, unit=threads.row_unit(h * w),
                             macs=n * h * w * c * self.out_channels)
            return y.reshape(n, *self.out_shape)
        source = x
        if p:
            x = ctx.zeroed("padded", (n, h + 2 * p, w + 2 * p, c), x.dtype)
        if self.direct:
            return self._direct_forward(ctx, source, x, y)
        # The columns, one row per output pixel, written and multiplied a
        # block of images at a time; kept whole for the weight gradient, or
        # (wide layers, more than one block) written again there block by
        # block: no batch-sized column buffer.
        windows = _window(xp, x, self.oh, self.ow, self.k, self.stride)
        rows, per = self.oh * self.ow, self._per_block(n, self.oh * self.ow * self.fan_in)
        again = per < n and self.fan_in >= AGAIN_FROM
        shape = (self.oh, self.ow, self.k, self.k, c)
        kept = None if again else ctx.buffer("cols", (n, *shape), x.dtype)

        def blocks(t, lo0, hi0):
            if p:
                x[lo0:hi0, p:p + h, p:p + w, :] = source[lo0:hi0]
            cols = ctx.buffer(("cols", t), (per, *shape), x.dtype) if again else None
            for lo in range(lo0, hi0, per):
                hi = min(lo + per, hi0)
                block = cols[:hi - lo] if again else kept[lo:hi]
                xp.copyto(block, windows[lo:hi])
                out = y[lo * rows:hi * rows]
                blas.matmul(xp, block.reshape((hi - lo) * rows, self.fan_in), self.W2, out)
                if self.bias:
                    out += self.params["b"]
        self.in_parallel(n, blocks, unit=per)
        ctx.cols = None if again else kept.reshape(n * rows, self.fan_in)
        ctx.windows, ctx.per = windows, per
        return y.reshape(n, *self.out_shape)

    def _direct_forward(self, ctx, source, x, y):
        """nn/compiled.py's direct forward, images shared over the compute threads
        (each output pixel's sum is the same whoever computes it); x is the
        padded buffer where the layer pads, else the input itself."""
        (h, w, _), p, n = self.in_shape, self.pad, source.shape[0]
        x = x if p else np.ascontiguousarray(source)
        y4 = y.reshape(n, *self.out_shape)

        def images(t, lo, hi):
            if p:
                x[lo:hi, p:p + h, p:p + w, :] = source[lo:hi]
            compiled.forward(x[lo:hi], self.params["W"], y4[lo:hi], self.stride)
            if self.bias:
                y4[lo:hi] += self.params["b"]
        self.in_parallel(n, images, macs=n * self.flops())
        ctx.cols, ctx.input = None, x
        return y4

    def columns(self, ctx):
        """The slot's last forward's whole im2col matrix (n*oh*ow, k*k*c), built
        anew where the forward did not keep it (bench layers times its GEMMs)."""
        if ctx.cols is not None:
            return ctx.cols
        windows = _window(self.xp, ctx.input, self.oh, self.ow, self.k, self.stride) if self.direct else \
            ctx.windows
        cols = self.xp.empty(windows.shape, windows.dtype)
        self.xp.copyto(cols, windows)
        return cols.reshape(-1, self.fan_in)

    def _weight_gradient(self, ctx, dy2):
        if self.direct:
            return self._direct_weight_gradient(ctx, dy2)
        if ctx.cols is not None:
            blas.matmul(self.xp, ctx.cols.T, dy2, self.dW2)
            return
        xp, windows, per, rows = self.xp, ctx.windows, ctx.per, self.oh * self.ow
        n = windows.shape[0]
        # Each block's product, then their sum in block order: what one
        # thread adds up, whichever thread computed which block.
        products = ctx.buffer("dW_blocks", (-(-n // per), *self.dW2.shape), dy2.dtype)

        def blocks(t, lo0, hi0):
            cols = ctx.buffer(("cols", t), (per, *windows.shape[1:]), dy2.dtype)
            for lo in range(lo0, hi0, per):
                hi = min(lo + per, hi0)
                block = cols[:hi - lo]
                xp.copyto(block, windows[lo:hi])
                blas.matmul(xp, block.reshape((hi - lo) * rows, self.fan_in).T, dy2[lo * rows:hi * rows],
                            products[lo // per])
        self.in_parallel(n, blocks, unit=per)
        xp.copyto(self.dW2, products[0])
        for part in products[1:]:
            self.dW2 += part

    def _direct_weight_gradient(self, ctx, dy2):
        """nn/compiled.py's weight gradient of each block of images (the
        im2col path's blocks, a fixed function of the shape), then their
        sum in block order: the same bits on any number of threads."""
        x, n = ctx.input, ctx.input.shape[0]
        dy = np.ascontiguousarray(dy2.reshape(n, *self.out_shape))
        per = self._per_block(n, self.oh * self.ow * self.fan_in)
        products = ctx.buffer("dW_blocks", (-(-n // per), *self.params["W"].shape), dy.dtype)

        def blocks(t, lo0, hi0):
            for lo in range(lo0, hi0, per):
                hi = min(lo + per, hi0)
                compiled.weight_gradient(x[lo:hi], dy[lo:hi], products[lo // per], self.stride)
        self.in_parallel(n, blocks, unit=per)
        dW = self.grads["W"]
        self.xp.copyto(dW, products[0])
        for part in products[1:]:
            dW += part

    def backward(self, ctx, dy, need_dx):
        xp = self.xp
        n = dy.shape[0]
        dy2 = dy.reshape(n * self.oh * self.ow, self.out_channels)
        self._weight_gradient(ctx, dy2)
        if self.bias:   # a GEMV: several times faster than dy2.sum(axis=0) here
            xp.matmul(self.ones(dy2.shape[0], dy.dtype), dy2, out=self.grads["b"])
        if not need_dx:
            return None
        h, w, c = self.in_shape
        if self.k == 1 and self.stride == 1 and self.pad == 0:
            dx = ctx.buffer("dx", (n * h * w, c), dy.dtype)
            self.in_parallel(n, lambda t, lo, hi: blas.matmul(xp, dy2[lo * h * w:hi * h * w], self.W2.T,
                                                                   dx[lo * h * w:hi * h * w]),
                             unit=threads.row_unit(h * w), macs=n * h * w * c * self.out_channels)
            return dx.reshape(n, h, w, c)
        how = self.direct and self._direct_dx()
        if how == "turned":
            return self._transposed(ctx, dy, direct_kernel=True)
        if how == "gathered":
            return self._gathered(ctx, dy)
        if self.stride == 1 and self.pad < self.k and self.out_channels <= 2 * c:
            return self._transposed(ctx, dy)
        rows = self.oh * self.ow
        dcols = ctx.buffer("dcols", (n * rows, self.fan_in), dy.dtype)
        dx = ctx.buffer("dx", (n, h, w, c), dy.dtype)

        def images(t, lo, hi):
            blas.matmul(xp, dy2[lo * rows:hi * rows], self.W2.T, dcols[lo * rows:hi * rows])
            self._col2im(dcols[lo * rows:hi * rows].reshape(hi - lo, self.oh, self.ow, self.k, self.k, c),
                         dx[lo:hi])
        self.in_parallel(n, images, unit=threads.row_unit(rows),
                         macs=n * rows * self.out_channels * self.fan_in)
        return dx

    def _transposed(self, ctx, dy, direct_kernel=False):
        """Stride 1: the input gradient is dy, padded by k-1-pad, convolved
        with W turned 180 degrees and its channel axes swapped: im2col of dy
        and one GEMM straight into dx, (n*h*w, k*k*out) @ (k*k*out, in).
        Faster than dy @ W.T then col2im unless the layer widens a lot (its
        columns hold k*k*out values per pixel, col2im's k*k*in): that GEMM's
        inner dimension is the output channels alone and it writes k*k times
        dx's size, which col2im reads back in k*k strided passes. Measured
        here (CPU time, batch 32): 32->32 channels on 32x32, 37 ms against
        57; 64->32 on 8x8, 3.9 against 4.7; 32->64 even; 3->32, 15 against
        11 (the rule: out <= 2 * in). With direct_kernel: the same
        convolution by nn/compiled.py's forward kernel, images shared over the
        compute threads, no columns."""
        xp, n, (h, w, c), k, q = self.xp, dy.shape[0], self.in_shape, self.k, self.k - 1 - self.pad
        o = self.out_channels
        source = dy
        if q:
            dy = ctx.zeroed("dy_padded", (n, self.oh + 2 * q, self.ow + 2 * q, o), dy.dtype)
        turned = ctx.buffer("turned", (k, k, o, c), dy.dtype)
        xp.copyto(turned, self.params["W"][::-1, ::-1].transpose(0, 1, 3, 2))
        dx = ctx.buffer("dx", (n * h * w, c), dy.dtype)
        if direct_kernel:
            dx4, padded = dx.reshape(n, h, w, c), dy if q else np.ascontiguousarray(source)

            def images(t, lo, hi):
                if q:
                    padded[lo:hi, q:q + self.oh, q:q + self.ow, :] = source[lo:hi]
                compiled.forward(padded[lo:hi], turned, dx4[lo:hi], 1)
            self.in_parallel(n, images, macs=n * h * w * k * k * o * c)
            return dx4
        turned = turned.reshape(k * k * o, c)
        # dy's columns a block of images at a time, each multiplied while in
        # cache (measured: 12.0 ms whole, 7.3 in blocks of one image, for
        # 16x16, 64 -> 32 channels, batch 32); no batch-sized column buffer.
        per = self._per_block(n, h * w * k * k * o)
        windows = _window(xp, dy, h, w, k, 1)

        def blocks(t, lo0, hi0):
            if q:
                dy[lo0:hi0, q:q + self.oh, q:q + self.ow, :] = source[lo0:hi0]
            cols = ctx.buffer(("dcols", t), (per, h, w, k, k, o), dy.dtype)
            for lo in range(lo0, hi0, per):
                hi = min(lo + per, hi0)
                block = cols[:hi - lo]
                xp.copyto(block, windows[lo:hi])
                blas.matmul(xp, block.reshape((hi - lo) * h * w, k * k * o), turned, dx[lo * h * w:hi * h * w])
        self.in_parallel(n, blocks, unit=per)
        return dx.reshape(n, h, w, c)

    def _gathered(self, ctx, dy):
        """A strided layer's input gradient by nn/compiled.py's gathering
        kernel (each input pixel sums what reached it), images shared over
        the compute threads; no columns."""
        n, (h, w, c), o = dy.shape[0], self.in_shape, self.out_channels
        swapped = ctx.buffer("swapped", (self.k, self.k, o, c), dy.dtype)
        self.xp.copyto(swapped, self.params["W"].transpose(0, 1, 3, 2))
        dy4 = np.ascontiguousarray(dy.reshape(n, self.oh, self.ow, o))
        dx = ctx.buffer("dx", (n, h, w, c), dy.dtype)
        self.in_parallel(n, lambda t, lo, hi: compiled.input_gradient(dy4[lo:hi], swapped, dx[lo:hi], self.stride,
                                                                      self.pad),
                         macs=n * self.flops())
        return dx

    def _col2im(self, dcols, dx):
        """Add each kernel offset's column gradient back onto the input pixels
        it came from (the padding's share is dropped), into dx (these images)."""
        (h, w, _), s = self.in_shape, self.stride
        dx.fill(0)
        for kh in range(self.k):
            rows = self._valid(kh, self.oh, h)
            for kw in range(self.k):
                cols = self._valid(kw, self.ow, w)
                if rows and cols:
                    (o0, o1, i0, i1), (q0, q1, j0, j1) = rows, cols
                    dx[:, i0:i1:s, j0:j1:s, :] += dcols[:, o0:o1, q0:q1, kh, kw, :]
        return dx

    def _valid(self, kk, out, size):
        """For kernel offset kk: the output range (o0, o1) whose input pixel
        o*stride + kk - pad lies inside the image, and that pixel range (i0, i1)."""
        s, p = self.stride, self.pad
        o0 = max(0, -((kk - p) // s))
        o1 = min(out, (size - 1 + p - kk) // s + 1)
        if o1 <= o0:
            return None
        return o0, o1, o0 * s + kk - p, (o1 - 1) * s + kk - p + 1

    def _weight_blocks(self):
        """(floats per sample, floats whatever the batch) of the weight
        gradient's per-block products, where it keeps them (direct kernels,
        or im2col's columns written again): ceil(n / per) blocks of W's size."""
        one_by_one = self.k == 1 and self.stride == 1 and self.pad == 0
        if not self.direct_fits() and (one_by_one or self.fan_in < AGAIN_FROM):
            return 0, 0
        size = self.fan_in * self.out_channels
        per = max(1, BLOCK_FLOATS // (self.oh * self.ow * self.fan_in))
        return math.ceil(size / per), size

    def train_floats(self):
        h, w, c = self.in_shape
        padded = (h + 2 * self.pad) * (w + 2 * self.pad) * c if self.pad else 0
        kept = 2 * math.prod(self.out_shape) + h * w * c + padded + self._weight_blocks()[0]
        if self.direct_fits():
            # No columns: dy padded for the turned kernel, nothing for the
            # gathering one, else the col2im path's batch-sized dcols.
            q, how = self.k - 1 - self.pad, self._direct_dx()
            dx_scratch = {"turned": (self.oh + 2 * q) * (self.ow + 2 * q) * self.out_channels if q else 0,
                          "gathered": 0}.get(how, self.oh * self.ow * self.fan_in)
            return kept + dx_scratch
        # Batch-sized columns: the forward's where kept, col2im's dcols where the
        # layer takes that path (a block's buffers are per step, not per sample).
        one_by_one = self.k == 1 and self.stride == 1 and self.pad == 0
        transposed = self.stride == 1 and self.pad < self.k and self.out_channels <= 2 * c
        per_col = self.oh * self.ow * self.fan_in
        cols = (per_col if not one_by_one and self.fan_in < AGAIN_FROM else 0) + \
            (per_col if not (one_by_one or transposed) else 0)
        q = self.k - 1 - self.pad   # the transposed input gradient pads dy by q
        dy_padded = (self.oh + 2 * q) * (self.ow + 2 * q) * self.out_channels if transposed and q else 0
        return kept + cols + (0 if one_by_one else dy_padded)

    def scratch_floats(self):
        # A thread's block of columns (forward, and dW where rewritten) and
        # of dy's columns (the transposed input gradient); the kept whole
        # columns are train_floats'. A bound: blocks are about BLOCK_FLOATS,
        # or one image where that is larger. The direct kernels keep none.
        # Plus one block of the weight gradient's products (the last,
        # whatever the batch: train_floats counts the rest per sample).
        # W turned round (or its channel axes swapped) for the input gradient.
        turned = self.k * self.k * self.out_channels * self.in_shape[2]
        if self.direct_fits():
            return self._weight_blocks()[1] + (turned if self._direct_dx() else 0)
        h, w, c = self.in_shape
        k, o = self.k, self.out_channels
        one_by_one = k == 1 and self.stride == 1 and self.pad == 0
        transposed = self.stride == 1 and self.pad < k and o <= 2 * c
        per_image = self.oh * self.ow * self.fan_in
        cols = 0 if one_by_one or self.fan_in < AGAIN_FROM else max(1, BLOCK_FLOATS // per_image) * per_image
        dy_cols = h * w * k * k * o
        return cols + (max(1, BLOCK_FLOATS // dy_cols) * dy_cols + turned if transposed and not one_by_one else 0) + \
            self._weight_blocks()[1]

    def flops(self):
        return self.oh * self.ow * self.out_channels * self.fan_in

    def describe(self):
        extra = (f",s{self.stride}" if self.stride != 1 else "") + (f",p{self.pad}" if self.pad else "")
        return f"Conv2d({self.out_channels},{self.k}x{self.k}{extra}{'' if self.bias else ',nobias'})"
