"""Layers: what one layer of a model must provide, and the MLP's layers
(Dense, ReLU, Flatten). A model is a list of these (nn/sequential.py runs
it; nn/spec.py lays its parameters into the one flat buffer).

The contract, in the order a model uses it (`Layer` below is the base
class; a user's own layer subclasses it and overrides what it needs):

1. `configure(in_shape) -> out_shape`: shapes per sample (no batch axis),
   called once when the spec is made. Raise `LayerError` with one line when
   the input does not fit (a Dense on a spatial input, a pool below 1x1).
2. `param_shapes()`: the trainable tensors, `[(name, shape), ...]`, in the
   order they sit in the flat buffer (`[]` for a layer without parameters:
   ReLU, pooling). Any number, any shapes: not one W and one b.
   `state_shapes()`: non-trainable tensors (batch-norm running statistics),
   kept in a buffer of their own, outside the gradient.
3. `init(rng, params, dtype)`: fill this layer's parameters (host NumPy
   views, pre-zeroed) from the NumPy Generator `rng`, drawing in a fixed
   order: the seed alone decides the model. `init_state(state)` sets the
   non-trainable tensors' starting values (running variance 1, ...).
4. `bind(xp, params, grads, state)`: the layer's views into the flat
   buffers (dicts name -> array on the model's device). Keep them; write
   gradients into `grads[...]` in place, never rebind.
5. `forward(x, train) -> y`: x is (batch, *in_shape). Keep what backward
   needs. Reuse output buffers between calls (`self.buffer(...)`): a step
   allocates nothing once warm. A layer may work in place on x when nothing
   else reads x later (ReLU does; the layer before it keeps its own input).
6. `backward(dy, need_dx) -> dx`: write this layer's parameter gradients
   (the gradient of the batch-mean loss; the head divides by the batch);
   return the input gradient, or None when need_dx is False (no layer
   before it has parameters: the first Dense skips its largest matmul).
7. `train_floats()`: floats per sample this layer keeps for a training step
   (its outputs and its input gradient), and `flops()`: multiply-adds per
   sample of its forward pass; the memory check and the pipeline's stage
   balance read these. `describe()`: one short line for the model summary.

Everything runs on NumPy or CuPy (`xp`) with the same code.

    python -m hpctrain.nn               # the MLP's layers, shapes and buffer layout
"""
import math

import numpy as np


class LayerError(ValueError):
    """A layer that does not fit its input: one line saying why."""


class Layer:
    """The base of every layer: no parameters, no state, identity shapes."""

    def configure(self, in_shape):
        self.in_shape = tuple(in_shape)
        self.out_shape = self.in_shape
        return self.out_shape

    def param_shapes(self):
        return []

    def state_shapes(self):
        return []

    def init(self, rng, params, dtype):
        pass

    def init_state(self, state):
        """Fill the non-trainable tensors' starting values (views on the model's device)."""

    def bind(self, xp, params, grads, state):
        self.xp, self.params, self.grads, self.state = xp, params, grads, state
        self._buffers = {}

    def buffer(self, key, shape, dtype):
        """An array of `shape` kept under `key` for the next call of the same shape."""
        buf = self._buffers.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = self._buffers[key] = self.xp.empty(shape, dtype)
        return buf

    def forward(self, x, train):
        return x

    def backward(self, dy, need_dx):
        return dy if need_dx else None

    def train_floats(self):
        return 0

    def flops(self):
        return 0

    def describe(self):
        return type(self).__name__


class Flatten(Layer):
    """(batch, *shape) -> (batch, prod(shape)): a view, no copy."""

    def configure(self, in_shape):
        super().configure(in_shape)
        self.out_shape = (math.prod(self.in_shape),)
        return self.out_shape

    def forward(self, x, train):
        return x.reshape(x.shape[0], -1)

    def backward(self, dy, need_dx):
        return dy.reshape(dy.shape[0], *self.in_shape) if need_dx else None


class ReLU(Layer):
    """max(x, 0), in place on its input: the layer before keeps its own input,
    so nothing reads x after this (a container that does, copies first)."""

    def forward(self, x, train):
        self.xp.maximum(x, 0, out=x)
        self.y = x
        return x

    def backward(self, dy, need_dx):
        # pass the gradient where the unit was active
        self.xp.multiply(dy, self.y > 0, out=dy)
        return dy


class Dense(Layer):
    """y = x W + b on a flat input (batch, fan_in); W is (fan_in, units).
    He-normal weights (for ReLU nets: variance 2/fan_in), zero bias."""

    def __init__(self, units):
        self.units = int(units)

    def configure(self, in_shape):
        if len(in_shape) != 1:
            raise LayerError(f"Dense({self.units}) takes a flat input, not {'x'.join(map(str, in_shape))}: "
                             f"put Flatten() before it")
        super().configure(in_shape)
        self.fan_in = self.in_shape[0]
        self.out_shape = (self.units,)
        return self.out_shape

    def param_shapes(self):
        return [("W", (self.fan_in, self.units)), ("b", (self.units,))]

    def init(self, rng, params, dtype):
        # One layer at a time, in the buffer's dtype: no model-sized temporaries.
        w = rng.standard_normal(self.fan_in * self.units, dtype=np.float64 if dtype == np.float64 else np.float32)
        w *= np.sqrt(2.0 / self.fan_in)
        params["W"][...] = w.astype(dtype, copy=False).reshape(self.fan_in, self.units)

    def forward(self, x, train):
        h = self.buffer(("out", train), (x.shape[0], self.units), self.params["W"].dtype)
        self.xp.matmul(x, self.params["W"], out=h)
        h += self.params["b"]
        self.x = x
        return h

    def backward(self, dy, need_dx):
        xp = self.xp
        xp.matmul(self.x.T, dy, out=self.grads["W"])
        dy.sum(axis=0, out=self.grads["b"])
        if not need_dx:
            return None
        dx = self.buffer("dx", (dy.shape[0], self.fan_in), dy.dtype)
        xp.matmul(dy, self.params["W"].T, out=dx)
        return dx

    def train_floats(self):
        # its output, and the gradient the next layer hands back (the same size)
        return 2 * self.units

    def flops(self):
        return self.fan_in * self.units

    def describe(self):
        return f"Dense({self.units})"
