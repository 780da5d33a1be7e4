"""The parameter store behind the layer runner (nn/store.py, issue 42 §4):
the runner reads parameters only between a store's before-hooks and
`after_forward` / `grads_done`, so a store that keeps them elsewhere and
wipes the layers' views outside those hooks trains to the plain store's bits.

    .venv/bin/python -m pytest -q tests/test_store.py
"""
import numpy as np
import pytest

from hpctrain.nn import ModelSpec, mlp
from hpctrain.nn.sequential import Sequential
from hpctrain.nn.store import PlainStore
from hpctrain.pipeline.stage import StageModel
from hpctrain.pipeline.stages import ranges


class ElsewhereStore(PlainStore):
    """The share's buffers (params, grads: what the optimizer updates) stay
    where the plain store has them, but the layers are bound to views of
    working buffers of this store's own, NaN except between the hooks: a
    range's parameters are copied in before its forward and its backward and
    wiped after its forward; a layer's gradient is copied out to the share
    when it is done, and its working parameters and gradient wiped. `calls`
    logs the hooks in order."""

    def __init__(self, spec, params, grads, state, base=(0, 0)):
        super().__init__(spec, params, grads, state, base)
        self.work, self.work_grads = np.full_like(params, np.nan), np.full_like(grads, np.nan)
        self.calls = []

    def views(self, i):
        _, _, state = super().views(i)
        return (self.spec.views(self.work, i, base=self.base[0]),
                self.spec.views(self.work_grads, i, base=self.base[0]), state)

    def _span(self, a, b):
        """(lo, hi) of layers [a, b)'s parameters in the share."""
        lo, hi = ranges(self.spec, a, b)
        return lo - self.base[0], hi - self.base[0]

    def before_forward(self, a, b):
        self.calls.append(("before_forward", a, b))
        lo, hi = self._span(a, b)
        self.work[lo:hi] = self.params[lo:hi]

    def after_forward(self, a, b):
        self.calls.append(("after_forward", a, b))
        lo, hi = self._span(a, b)
        self.work[lo:hi] = np.nan

    def before_backward(self, a, b):
        self.calls.append(("before_backward", a, b))
        lo, hi = self._span(a, b)
        self.work[lo:hi] = self.params[lo:hi]

    def grads_done(self, a, b):
        self.calls.append(("grads_done", a, b))
        lo, hi = self._span(a, b)
        self.grads[lo:hi] = self.work_grads[lo:hi]
        self.work[lo:hi] = self.work_grads[lo:hi] = np.nan


class SkipsBeforeBackward(ElsewhereStore):
    """A store whose views are empty during backward: the comparison must see it."""

    def before_backward(self, a, b):
        self.calls.append(("before_backward", a, b))


def _tiny_cnn():
    """Convolutions, batch norm (running statistics), dropout, max pooling (tests/models/tiny_cnn.py)."""
    from models.tiny_cnn import build
    return ModelSpec(build((8, 8, 3), 5), (8, 8, 3), 5)


def _mlp():
    return mlp((6, 6), 4, (12, 8))


def _batches(spec, steps, batch=6):
    rng = np.random.default_rng(4)
    return [(rng.random((batch, *spec.input_shape), dtype=np.float32), rng.integers(0, spec.classes, batch),
             (9, k, np.arange(k * batch, (k + 1) * batch))) for k in range(steps)]


def _model(spec, store):
    n, s = spec.num_params, spec.num_state
    model = Sequential(spec, np, store(spec, np.zeros(n, np.float32), np.zeros(n, np.float32),
                                       np.zeros(s, np.float32)), np.float32)
    model.init(3)
    return model


def _train(spec, store, steps=4, lr=np.float32(0.05)):
    """SGD steps on the model's share; each layer's gradient as on_layer_done saw it
    (fusion's view); the evaluation sums after training."""
    model = _model(spec, store)
    seen = []

    def layer_done(k):
        lo, hi = model.layer_ranges[k]
        seen.append((k, model.grads[lo:hi].tobytes()))
    for x, y, noise in _batches(spec, steps):
        loss = model.forward_backward(x, y, on_layer_done=layer_done, noise=noise)
        seen.append(float(loss))
        model.params -= lr * model.grads
    x, y, _ = _batches(spec, 1, batch=10)[0]
    return model, seen, model.evaluate(x, y)


@pytest.mark.parametrize("spec", [_mlp, _tiny_cnn], ids=["mlp", "cnn-batchnorm"])
def test_a_store_that_keeps_parameters_elsewhere_trains_to_the_plain_stores_bits(spec):
    spec = spec()
    plain, plain_seen, plain_sums = _train(spec, PlainStore)
    other, other_seen, other_sums = _train(spec, ElsewhereStore)
    assert other.params.tobytes() == plain.params.tobytes()
    assert other.grads.tobytes() == plain.grads.tobytes()
    assert other.state.tobytes() == plain.state.tobytes()
    # on_layer_done comes after the store's grads_done: fusion reads what the store left
    assert other_seen == plain_seen
    assert other_sums == plain_sums
    assert not np.isnan(plain.params).any()


def test_the_runner_tells_the_store_before_and_after_each_call_and_each_layers_gradient():
    spec = _mlp()   # Flatten, Dense, ReLU, Dense, ReLU, Dense
    model = _model(spec, ElsewhereStore)
    (x, y, _), = _batches(spec, 1)
    model.forward_backward(x, y)
    n = len(spec.layers)
    assert model.run.store.calls == [("before_forward", 0, n), ("after_forward", 0, n), ("before_backward", 0, n),
                                     ("grads_done", 5, 6), ("grads_done", 3, 4), ("grads_done", 1, 2)]


def test_a_store_that_leaves_the_views_empty_for_backward_is_caught():
    # what the comparison above would see of a runner that reads parameters
    # outside the hooks: NaN where the plain store has numbers
    spec = _mlp()
    plain, _, _ = _train(spec, PlainStore, steps=1)
    broken, _, _ = _train(spec, SkipsBeforeBackward, steps=1)
    assert np.isnan(broken.params).any() and not np.isnan(plain.params).any()


def _stage_run(spec, a, b, store, batches, slots):
    """A pipeline stage's range [a, b) over its slices, micro-batches in
    1F1B's order for `slots` in flight: forward 0..slots-1, then each
    backward followed by the next forward. The stage's micro-batch
    outputs (the last stage: losses), its micro-batch gradients and input
    gradients, each as its backward left them, and its state after."""
    (lo, hi), (slo, shi) = ranges(spec, a, b), ranges(spec, a, b, of="state")
    whole = spec.build()
    whole.init(3)
    params, grads, state = whole.params[lo:hi].copy(), np.zeros(hi - lo, np.float32), whole.state[slo:shi].copy()
    stage = StageModel(spec, a, b, np, store(spec, params, grads, state, (lo, slo)), slots)
    inputs = [np.random.default_rng(m).random((len(y), *(spec.input_shape if a == 0 else spec.shapes[a - 1])),
                                               dtype=np.float32) for m, (_, y, _) in enumerate(batches)]
    outs, grads_seen = [], []
    order = [("f", m) for m in range(slots)]
    for m in range(len(batches)):
        order += [("b", m)] + ([("f", m + slots)] if m + slots < len(batches) else [])
    for what, m in order:
        x, y, noise = batches[m]
        if what == "f":
            outs.append(stage.forward(m % slots, inputs[m] if a else x, y, noise))
            continue
        dy = None if b == len(spec.layers) else np.full_like(outs[m], 0.01)
        dx = stage.backward(m % slots, dy)
        grads_seen.append((grads.tobytes(), None if dx is None else dx.tobytes()))
    return [np.asarray(out).tobytes() for out in outs], grads_seen, state.tobytes()


@pytest.mark.parametrize("stage", [0, 1])
def test_a_pipeline_stages_range_over_a_store_elsewhere_gives_the_plain_stores_bits(stage):
    spec = _tiny_cnn()
    # each stage with a layer whose backward reads its parameters (the second
    # convolution's input gradient; the Dense layers'); balanced's cut, 2,
    # leaves stage 0 only the first convolution, which needs no input gradient
    cuts = [0, 7, len(spec.layers)]
    batches = _batches(spec, 4)
    args = spec, cuts[stage], cuts[stage + 1]
    assert _stage_run(*args, ElsewhereStore, batches, 2) == _stage_run(*args, PlainStore, batches, 2)
