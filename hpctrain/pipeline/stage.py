"""One pipeline stage's model: layers [a, b) of the spec's list over the
stage's slice of the flat buffers, running the same calls, in the same order,
as nn/sequential.py's `forward_backward` does for those layers, so that the
pipeline's arithmetic is that of the whole model. Never imports MPI.

A stage keeps `copies` StageModels, the schedule's peak of micro-batches in
flight (schedule.peak_activations: GPipe M, 1F1B min(P - s, M)): layers keep
their forward's inputs and buffers for their backward, so a copy holds one
micro-batch's activations from `forward(m)` to `backward(m)` and then serves
the next forward. That bound is the stage's activation memory. The copies
share the stage's parameter, state and gradient buffers: a copy's backward
writes micro-batch m's gradient, which is added to the step's sum right away
(every schedule backprops in micro-batch order 0..M-1) in --accumulate-steps'
order and operations (ring_step.py): acc = g0, acc += g1 ... g_{M-1} (its
last addition g_{M-1} + acc, the same bits: IEEE addition commutes).

    python -m pytest -q tests/test_pipeline.py
"""
import copy

from ..comm.wire import GRADS
from ..nn.chain import Chain
from ..nn.layers import Noise
from ..nn.sequential import SoftmaxCrossEntropy
from .stages import ranges


def _views(spec, buffer, i, base, of="params"):
    per_layer = spec.layer_tensors if of == "params" else spec.layer_state
    return {name.split("/", 1)[1]: buffer[lo - base:hi - base].reshape(shape) for name, shape, lo, hi in per_layer[i]}


class StageModel:
    """Layers [a, b) bound to params/grads/state, slices starting at the
    buffers' offsets `base` (params, state) of the full model's."""

    def __init__(self, spec, a, b, xp, params, grads, state, base):
        self.spec, self.a, self.b, self.xp = spec, a, b, xp
        self.layers = copy.deepcopy(spec.layers[a:b])
        for i, layer in zip(range(a, b), self.layers):
            layer.bind(xp, _views(spec, params, i, base[0]), _views(spec, grads, i, base[0]),
                       _views(spec, state, i, base[1], of="state"))
        self.grads = grads
        self.chain = Chain(self.layers, xp)   # the stage's input is its own: a received or batch buffer
        self.in_shape = spec.input_shape if a == 0 else spec.shapes[a - 1]
        self.head = SoftmaxCrossEntropy(xp) if b == len(spec.layers) else None
        # backprop stops at the model's first layer with parameters
        self._first = spec.param_layers[0]
        self._d = None

    def forward(self, x, y=None, noise=None):
        """The stage's output for x; on the last stage the loss (its gradient kept for backward)."""
        for i, layer in zip(range(self.a, self.b), self.layers):
            layer.set_noise(None if noise is None else Noise(*noise[:3], stream=i))
        out = self.chain.forward(x.reshape(x.shape[0], *self.in_shape), True)
        if self.head is None:
            return out
        loss, d = self.head.forward_backward(out, y)
        self._d = self.head.gradient(d, y)
        return loss

    def backward(self, dy=None):
        """Writes this micro-batch's gradient into self.grads; returns the
        gradient with respect to the stage's input (None on the first stage)."""
        d = self._d if dy is None else dy
        for i in range(self.b - 1, max(self.a, self._first) - 1, -1):
            d = self.layers[i - self.a].backward(d, need_dx=i > self._first)
        return d if self.a > self._first else None


class Stage:
    """Stage `s` of `cuts`: its parameter slice [lo, hi), its state slice,
    and `copies` StageModels over them for the micro-batches in flight."""

    def __init__(self, spec, cuts, s, micro_batches, xp, dtype, copies=None):
        self.a, self.b = cuts[s], cuts[s + 1]
        (self.lo, self.hi), (self.state_lo, self.state_hi) = ranges(spec, self.a, self.b), \
            ranges(spec, self.a, self.b, of="state")
        n = self.hi - self.lo
        # The parameters and the step's gradient sum, each as this stage's part
        # [wire_lo, GRADS + hi) of ring mode's wire [loss, stop, body...]
        # (comm/wire.py; the first stage's part holds the two head slots, zeros
        # here): the replicas average (or reduce-scatter, then allgather) ring
        # mode's buckets of them (stages.pieces), so their sums run in its order.
        self.wire_lo = 0 if s == 0 else GRADS + self.lo
        self.body_at = GRADS + self.lo - self.wire_lo   # where the slice starts in the part
        self.param_wire = xp.zeros(GRADS + self.hi - self.wire_lo, dtype)
        self.params = self.param_wire[self.body_at:]
        self.state = xp.zeros(self.state_hi - self.state_lo, dtype)
        self.grad = xp.zeros(n, dtype)   # one micro-batch's, written by every copy's backward
        self.wire = xp.zeros_like(self.param_wire)
        self.grads = self.wire[self.body_at:]   # the step's sum
        self.micro = micro_batches
        self.models = [StageModel(spec, self.a, self.b, xp, self.params, self.grad, self.state,
                                  (self.lo, self.state_lo)) for _ in range(copies or micro_batches)]
        self._free, self._holding = list(range(len(self.models))), {}

    def forward(self, m, x, y=None, noise=None):
        """Micro-batch m's forward on a free copy, which holds it until backward(m)."""
        copy = self._free.pop(0)   # never empty: there are as many copies as the schedule holds at once
        self._holding[m] = copy
        return self.models[copy].forward(x, y, noise)

    def backward(self, m, dy=None):
        """Micro-batch m's backward: its gradient into the step's sum; the copy freed.
        Returns the gradient with respect to the stage's input (None on the first stage)."""
        copy = self._holding.pop(m)
        dx = self.models[copy].backward(dy)
        if m == 0:
            self.grads[...] = self.grad
        else:
            self.grads += self.grad
        self._free.append(copy)
        return dx
