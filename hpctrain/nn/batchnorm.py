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

    python -m hpctrain.nn --model resnet --shape 32,32,3
"""
import math

from .layers import Layer, LayerError

MOMENTUM = 0.1
EPS = 1e-5


class _BatchNorm(Layer):
    rank = None   # the input's rank per sample: 3 (h, w, c) or 1 (features)
    keeps_output = False   # its backward reads its normalised input, a buffer of its own

    def configure(self, in_shape):
        if len(in_shape) != self.rank:
            want = "an image (height x width x channels)" if self.rank == 3 else "a flat input"
            raise LayerError(f"{self.describe()} takes {want}, not {'x'.join(map(str, in_shape))}")
        super().configure(in_shape)
        self.channels = self.in_shape[-1]
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

    def forward(self, x, train):
        xp, c = self.xp, self.channels
        x2 = x.reshape(-1, c)
        y = self.buffer(("out", train), x2.shape, x.dtype)
        if not train:
            scale = self.params["gamma"] / xp.sqrt(self.state["running_var"] + EPS)
            xp.multiply(x2 - self.state["running_mean"], scale, out=y)
            y += self.params["beta"]
            return y.reshape(x.shape)
        m = x2.shape[0]
        mean = x2.mean(axis=0)
        xhat = self.buffer("xhat", x2.shape, x.dtype)
        xp.subtract(x2, mean, out=xhat)
        prod = self.buffer("prod", x2.shape, x.dtype)
        xp.multiply(xhat, xhat, out=prod)
        var = prod.mean(axis=0)
        self.inv_std = 1 / xp.sqrt(var + EPS)
        xhat *= self.inv_std
        self.xhat = xhat
        xp.multiply(xhat, self.params["gamma"], out=y)
        y += self.params["beta"]
        run_mean, run_var = self.state["running_mean"], self.state["running_var"]
        run_mean *= 1 - MOMENTUM
        run_mean += MOMENTUM * mean
        run_var *= 1 - MOMENTUM
        run_var += (MOMENTUM * m / max(m - 1, 1)) * var
        return y.reshape(x.shape)

    def backward(self, dy, need_dx):
        xp = self.xp
        dy2 = dy.reshape(-1, self.channels)
        m = dy2.shape[0]
        g_gamma, g_beta = self.grads["gamma"], self.grads["beta"]
        dy2.sum(axis=0, out=g_beta)
        prod = self.buffer("prod", dy2.shape, dy.dtype)
        xp.multiply(dy2, self.xhat, out=prod)
        prod.sum(axis=0, out=g_gamma)
        if not need_dx:
            return None
        # dx = gamma/std * (dy - mean(dy) - xhat * mean(dy * xhat))
        dx = self.buffer("dx", dy2.shape, dy.dtype)
        xp.multiply(self.xhat, g_gamma / m, out=dx)
        dx += g_beta / m
        xp.subtract(dy2, dx, out=dx)
        dx *= self.params["gamma"] * self.inv_std
        return dx.reshape(dy.shape)

    def train_floats(self):
        # output, normalised input, scratch, input gradient
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
