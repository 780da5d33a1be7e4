"""The layers beyond the MLP (nn/conv.py, nn/pool.py, nn/batchnorm.py, nn/residual.py,
Dropout in nn/layers.py) and the zoo (nn/zoo.py): finite differences in
float64 for every layer kind and for the residual container, Conv2d and
pooling against direct loops, dropout's masks against the batch split, batch
norm's running statistics, every zoo model end to end, and the CuPy path
through a NumPy stand-in that refuses what CuPy refuses.

    python -m pytest -q tests/test_layers.py
"""
import threading

import numpy as np
import pytest

from hpctrain.nn import (MODELS, AvgPool2d, BatchNorm1d, BatchNorm2d, Channels, Conv2d, Dense, Dropout, Flatten,
                         GlobalAvgPool, LayerError, MaxPool2d, ModelSpec, Noise, ReLU, Residual)

NOISE = Noise(seed=7, step=3, sample_ids=np.arange(100, 104))


class Slot:
    """A bound layer with one context, as a runner holds it: forward(x,
    train), backward(dy, need_dx) and set_noise(noise) pass the context
    (`ctx`); anything else is the layer's."""

    def __init__(self, layer):
        self.layer, self.ctx = layer, layer.context()

    def forward(self, x, train):
        return self.layer.forward(self.ctx, x, train)

    def backward(self, dy, need_dx):
        return self.layer.backward(self.ctx, dy, need_dx)

    def set_noise(self, noise):
        self.layer.set_noise(self.ctx, noise)

    def __getattr__(self, name):
        return getattr(self.layer, name)


def bound(layer, in_shape, xp=np, dtype=np.float64, seed=0):
    """The layer configured for in_shape and bound to fresh flat buffers, as
    ModelSpec does it: returns (a Slot of the layer, params, grads) (the flat buffers)."""
    layer.configure(in_shape)
    shapes, states = layer.param_shapes(), layer.state_shapes()
    n = sum(int(np.prod(s)) for _, s in shapes)
    m = sum(int(np.prod(s)) for _, s in states)
    params, grads, state = xp.zeros(n, dtype), xp.zeros(n, dtype), xp.zeros(m, dtype)

    def views(buf, named):
        out, lo = {}, 0
        for name, shape in named:
            size = int(np.prod(shape))
            out[name] = buf[lo:lo + size].reshape(shape)
            lo += size
        return out
    host = np.zeros(n, dtype)
    layer.init(np.random.default_rng(seed), views(host, shapes), dtype)
    params[...] = xp.asarray(host)
    layer.bind(xp, views(params, shapes), views(grads, shapes), views(state, states))
    layer.init_state(views(state, states))
    slot = Slot(layer)
    slot.set_noise(NOISE)
    return slot, params, grads


def rel_error(a, b):
    return np.linalg.norm(a - b) / max(np.linalg.norm(a) + np.linalg.norm(b), 1e-300)


def check_gradients(layer, in_shape, batch=4, picks=25, seed=1):
    """Loss = sum(y * R): analytic parameter and input gradients against
    central differences, relative error below 1e-6."""
    layer, params, grads = bound(layer, in_shape)
    layer.set_noise(Noise(7, 3, np.arange(100, 100 + batch)))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, *in_shape))
    r = rng.standard_normal((batch, *layer.out_shape))

    def loss():
        return float((layer.forward(x.copy(), True) * r).sum())
    loss()
    dx = layer.backward(r.copy(), True).copy()
    analytic = grads.copy()
    eps = 1e-6
    for buf, flat, exact in ((params, params, analytic), (x, x.reshape(-1), dx.reshape(-1))):
        if flat.size == 0:
            continue
        ks = rng.choice(flat.size, min(picks, flat.size), replace=False)
        numeric = np.empty(len(ks))
        for i, k in enumerate(ks):
            old = flat[k]
            flat[k] = old + eps
            up = loss()
            flat[k] = old - eps
            down = loss()
            flat[k] = old
            numeric[i] = (up - down) / (2 * eps)
        assert rel_error(numeric, exact[ks]) < 1e-6, (layer.describe(), rel_error(numeric, exact[ks]))


# --- finite differences, every layer kind ---------------------------------------

@pytest.mark.parametrize("make, shape", [
    (lambda: Dense(5), (7,)),
    (lambda: ReLU(), (3, 4, 2)),
    (lambda: Flatten(), (3, 4, 2)),
    (lambda: Channels(), (5, 6)),
    (lambda: Conv2d(4, 3), (6, 7, 3)),
    (lambda: Conv2d(4, 3, stride=2, padding=1), (7, 6, 2)),
    (lambda: Conv2d(3, 1, bias=False), (4, 4, 5)),
    (lambda: Conv2d(2, 2, stride=3, padding=2), (7, 7, 2)),
    (lambda: MaxPool2d(2), (6, 6, 3)),
    (lambda: MaxPool2d(3, 2), (7, 7, 2)),
    (lambda: MaxPool2d(2, 1), (5, 4, 2)),
    (lambda: AvgPool2d(2), (5, 6, 3)),
    (lambda: AvgPool2d(3, 2), (7, 7, 2)),
    (lambda: GlobalAvgPool(), (3, 5, 4)),
    (lambda: Dropout(0.3), (5, 6)),
    (lambda: BatchNorm2d(), (4, 3, 5)),
    (lambda: BatchNorm1d(), (6,)),
    (lambda: Residual([Conv2d(3, 3, padding=1), BatchNorm2d(), ReLU(), Conv2d(3, 3, padding=1)]), (5, 5, 3)),
    (lambda: Residual([ReLU(), Conv2d(4, 3, stride=2, padding=1), Dropout(0.2), BatchNorm2d()],
                      projection=[Conv2d(4, 1, stride=2, bias=False), BatchNorm2d()]), (6, 6, 2)),
    (lambda: Residual([Dense(6), ReLU(), Dense(6)]), (6,)),
    (lambda: Residual([Flatten(), ReLU(), Dense(12)], projection=[Flatten()]), (2, 2, 3)),
], ids=lambda v: v().describe() if callable(v) else "x".join(map(str, v)))
def test_gradients_match_finite_differences(make, shape):
    check_gradients(make(), shape, batch=5 if "Batch" in make().describe() else 3)


def test_resnet_in_a_spec_matches_finite_differences():
    """The whole resnet (prefixed tensors in the spec's layout, batch norm in
    training, the softmax head) on small images."""
    m = MODELS["resnet"]((4, 4, 3), 4).build(dtype=np.float64)
    m.init(2)
    rng = np.random.default_rng(0)
    x, y = rng.random((6, 4, 4, 3)), rng.integers(0, 4, 6)
    m.forward_backward(x, y)
    analytic = m.grads.copy()
    picks = [k for _, lo, hi in m.tensor_ranges()
             for k in rng.choice(np.arange(lo, hi), min(2, hi - lo), replace=False)]
    numeric = []
    for k in picks:
        old = m.params[k]
        m.params[k] = old + 1e-6
        up = float(m.forward_backward(x, y))
        m.params[k] = old - 1e-6
        down = float(m.forward_backward(x, y))
        m.params[k] = old
        numeric.append((up - down) / 2e-6)
    assert rel_error(np.array(numeric), analytic[picks]) < 1e-6
    names = [n for n, _ in m.tensors()]
    assert "layer3/block0.W" in names and "layer4/proj1.gamma" in names
    assert [n for n, _ in m.state_tensors()][:2] == ["layer1/running_mean", "layer1/running_var"]


# --- against direct loops ---------------------------------------------------------

def direct_conv(x, W, b, s, p):
    n, h, w, c = x.shape
    k, o = W.shape[0], W.shape[3]
    xp_ = np.pad(x, ((0, 0), (p, p), (p, p), (0, 0)))
    oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    y = np.zeros((n, oh, ow, o))
    for i in range(oh):
        for j in range(ow):
            for kh in range(k):
                for kw in range(k):
                    y[:, i, j, :] += xp_[:, i * s + kh, j * s + kw, :] @ W[kh, kw]
    return y + b


def direct_conv_grads(x, W, dy, s, p):
    n, h, w, c = x.shape
    k = W.shape[0]
    xp_ = np.pad(x, ((0, 0), (p, p), (p, p), (0, 0)))
    dxp, dW = np.zeros_like(xp_), np.zeros_like(W)
    for i in range(dy.shape[1]):
        for j in range(dy.shape[2]):
            for kh in range(k):
                for kw in range(k):
                    dW[kh, kw] += xp_[:, i * s + kh, j * s + kw, :].T @ dy[:, i, j, :]
                    dxp[:, i * s + kh, j * s + kw, :] += dy[:, i, j, :] @ W[kh, kw].T
    return dxp[:, p:p + h, p:p + w, :], dW, dy.sum(axis=(0, 1, 2))


@pytest.mark.parametrize("k, s, p, shape", [(3, 1, 0, (6, 5, 2)), (3, 2, 1, (7, 8, 3)), (5, 2, 2, (9, 9, 1)),
                                            (2, 3, 1, (8, 7, 2)), (1, 2, 0, (5, 5, 4)),
                                            # k*k*in >= conv.AGAIN_FROM: columns written again for dW
                                            (3, 1, 1, (5, 6, 8)), (3, 2, 1, (7, 7, 8))])
@pytest.mark.parametrize("blocks", ["one", "of 1 image", "of 2 images, the last 1"])
def test_conv2d_forward_and_gradients_equal_a_direct_loop(k, s, p, shape, blocks, monkeypatch):
    from hpctrain.nn import conv as conv_module
    conv, params, grads = bound(Conv2d(3, k, stride=s, padding=p), shape)
    per_image = max(conv.oh * conv.ow * conv.fan_in, shape[0] * shape[1] * k * k * 3)   # forward's, dx's columns
    monkeypatch.setattr(conv_module, "BLOCK_FLOATS", {"one": 1 << 62, "of 1 image": 1}.get(blocks, 2 * per_image))
    conv.params["b"][...] = np.arange(3) * 0.5
    check_against_loops(conv, shape, s, p)


def check_against_loops(conv, shape, s, p):
    """A bound Conv2d's forward and gradients on 5 images against direct_conv's loops, float64."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, *shape))
    y = conv.forward(x, True)
    W, b = conv.params["W"], conv.params["b"]
    assert np.allclose(y, direct_conv(x, W, b, s, p), rtol=1e-12, atol=1e-12)
    dy = rng.standard_normal(y.shape)
    dx = conv.backward(dy, True)
    want_dx, want_dW, want_db = direct_conv_grads(x, W, dy, s, p)
    assert np.allclose(dx, want_dx, atol=1e-12)
    assert np.allclose(conv.grads["W"], want_dW, atol=1e-12)
    assert np.allclose(conv.grads["b"], want_db, atol=1e-12)


@pytest.mark.parametrize("kind, k, s, shape", [("max", 2, 2, (6, 6, 3)), ("max", 3, 2, (7, 8, 2)),
                                               ("max", 2, 1, (4, 5, 2)), ("max", 2, 3, (8, 8, 1)),
                                               ("avg", 2, 2, (5, 7, 3)), ("avg", 3, 1, (5, 5, 2))])
def test_pooling_equals_a_direct_loop(kind, k, s, shape):
    pool, _, _ = bound((MaxPool2d if kind == "max" else AvgPool2d)(k, s), shape)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, *shape))
    x[0, :2, :2, 0] = 1.5   # a tie: the first maximum takes the gradient
    y = pool.forward(x, True)
    dy = rng.standard_normal(y.shape)
    dx = pool.backward(dy, True)
    want, want_dx = np.zeros(y.shape), np.zeros(x.shape)
    for i in range(y.shape[1]):
        for j in range(y.shape[2]):
            win = x[:, i * s:i * s + k, j * s:j * s + k, :]
            if kind == "avg":
                want[:, i, j] = win.mean(axis=(1, 2))
                want_dx[:, i * s:i * s + k, j * s:j * s + k, :] += dy[:, i, None, j, None, :] / (k * k)
                continue
            want[:, i, j] = win.max(axis=(1, 2))
            for n in range(x.shape[0]):
                for c in range(x.shape[3]):
                    a, bb = np.unravel_index(np.argmax(win[n, :, :, c]), (k, k))
                    want_dx[n, i * s + a, j * s + bb, c] += dy[n, i, j, c]
    assert np.allclose(y, want, atol=1e-12) and np.allclose(dx, want_dx, atol=1e-12)


def test_a_warm_relu_backward_allocates_nothing():
    import tracemalloc
    relu, _, _ = bound(ReLU(), (50, 40), dtype=np.float32)
    x = np.random.default_rng(2).standard_normal((64, 50, 40)).astype(np.float32)
    dy = np.ones_like(x)
    relu.backward(relu.forward(x.copy(), True), True)   # warm
    y = relu.forward(x.copy(), True)
    tracemalloc.start()
    try:
        relu.backward(dy, True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the mask alone would be 128 kB; NumPy's cast buffer for bool * float32 is 32 kB whatever the size
    assert peak < 64 * 1024, peak
    assert np.array_equal(dy, (y > 0).astype(np.float32))


# --- dropout ------------------------------------------------------------------------

def test_dropout_masks_are_per_sample_whatever_the_batch_split():
    drop, _, _ = bound(Dropout(0.4), (30,), dtype=np.float32)
    ids = np.arange(1000, 1010)
    x = np.ones((10, 30), np.float32)
    drop.set_noise(Noise(1, 5, ids))
    whole = drop.forward(x, True).copy()
    halves = []
    for part in (slice(0, 4), slice(4, 10)):
        drop.set_noise(Noise(1, 5, ids[part]))
        halves.append(drop.forward(x[part], True).copy())
    assert np.array_equal(whole, np.concatenate(halves))
    assert set(np.unique(whole)) == {0, np.float32(1 / 0.6)}
    assert 0.3 < (whole == 0).mean() < 0.5
    for other in (Noise(1, 6, ids), Noise(2, 5, ids), Noise(1, 5, ids + 1), Noise(1, 5, ids, stream=1)):
        drop.set_noise(other)
        assert not np.array_equal(drop.forward(x, True), whole)
    assert drop.forward(x, False) is x
    drop.set_noise(None)
    with pytest.raises(LayerError, match="noise"):
        drop.forward(x, True)


def test_dropout_in_a_model_equals_across_batch_splits_and_layers_draw_apart():
    spec = ModelSpec([Flatten(), Dropout(0.5), Dense(8), Dropout(0.5), Dense(3)], (4, 4), 3)
    m = spec.build(dtype=np.float64)
    m.init(0)
    rng = np.random.default_rng(1)
    x, y, ids = rng.random((6, 4, 4)), rng.integers(0, 3, 6), np.arange(20, 26)
    m.forward_backward(x, y, noise=(9, 2, ids))
    whole = m.grads.copy()
    m.forward_backward(x[:2], y[:2], noise=(9, 2, ids[:2]))
    first = m.grads.copy()
    m.forward_backward(x[2:], y[2:], noise=(9, 2, ids[2:]))
    assert np.allclose((2 * first + 4 * m.grads) / 6, whole, rtol=1e-12, atol=1e-15)
    # two dropout layers of one model draw apart (the model gives each its stream)
    m.forward_backward(x, y, noise=(9, 2, ids))
    assert not np.array_equal(m.ctx.inner[1].mask.reshape(6, -1)[:, :8], m.ctx.inner[3].mask)


# --- batch norm -----------------------------------------------------------------------

def test_batchnorm_running_statistics_update_in_training_and_serve_evaluation():
    spec = ModelSpec([Channels(), Conv2d(3, 1), BatchNorm2d(), GlobalAvgPool(), Dense(2)], (4, 4, 2), 2)
    m = spec.build(dtype=np.float64)
    m.init(0)
    bn = m.layers[2]
    state = dict(m.state_tensors())
    assert np.array_equal(state["layer1/running_mean"], np.zeros(3))
    assert np.array_equal(state["layer1/running_var"], np.ones(3))
    assert np.shares_memory(state["layer1/running_var"], m.state) and m.state.size == 6
    rng = np.random.default_rng(2)
    x, y = rng.random((5, 4, 4, 2)) * 3 + 1, np.array([0, 1, 0, 1, 1])
    m.forward_backward(x, y)
    conv_out = (x.reshape(-1, 2) @ m.layers[1].W2 + m.layers[1].params["b"])
    mean, var = conv_out.mean(axis=0), conv_out.var(axis=0, ddof=1)
    assert np.allclose(state["layer1/running_mean"], 0.1 * mean)
    assert np.allclose(state["layer1/running_var"], 0.9 + 0.1 * var)
    m.forward_backward(x, y)
    assert np.allclose(state["layer1/running_mean"], 0.19 * mean)
    # evaluation normalises with the running statistics, not the batch's
    out = bn.forward(m.ctx.inner[2], conv_out.reshape(5, 4, 4, 3).copy(), False).reshape(-1, 3)
    want = (conv_out - state["layer1/running_mean"]) / np.sqrt(state["layer1/running_var"] + 1e-5)
    assert np.allclose(out, want * bn.params["gamma"] + bn.params["beta"])
    before = m.state.copy()
    m.evaluate(x, y)
    assert np.array_equal(m.state, before)


# --- the zoo ------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("shape", [(28, 28), (32, 32, 3)], ids=["28x28", "32x32x3"])
def test_every_zoo_model_builds_trains_a_step_and_prints_its_summary(name, shape):
    spec = MODELS[name](shape, 10)
    lines = spec.summary()
    assert len(lines) == len(spec.layers) + 2 and f"{spec.num_params:,} parameters" in lines[-1]
    m = spec.build()
    m.init(0)
    rng = np.random.default_rng(0)
    x, y = rng.random((4, *shape)).astype(np.float32), np.arange(4)
    loss = float(m.forward_backward(x, y, noise=(0, 0, np.arange(4))))
    assert np.isfinite(loss) and np.isfinite(m.grads).all() and np.abs(m.grads).max() > 0
    sums = m.evaluate(x, y)
    assert np.isfinite(sums["loss"]) and 0 <= sums["correct"] <= 4 and sums["count"] == 4
    assert spec.flops() and all(f >= 0 for f in spec.flops()) and spec.memory_bytes(32, 0) > 0


@pytest.mark.parametrize("layers, shape, message", [
    ([Conv2d(4, 3), Flatten(), Dense(2)], (28, 28), "Channels"),
    ([Channels(), MaxPool2d(2), MaxPool2d(2), Flatten(), Dense(2)], (3, 3), "less than 1x1"),
    ([Channels(), Conv2d(2, 5), Flatten(), Dense(2)], (4, 4), "less than 1x1"),
    ([Channels(), Residual([Conv2d(4, 3, padding=1)]), Flatten(), Dense(2)], (4, 4), "projection"),
    ([Flatten(), BatchNorm2d(), Dense(2)], (4, 4), "image"),
])
def test_models_that_do_not_fit_the_data_say_which_layer(layers, shape, message):
    with pytest.raises(LayerError, match=message):
        ModelSpec(layers, shape, 2)


# --- the CuPy path, on a NumPy stand-in -------------------------------------------------

class _Through(threading.local):
    on = False


THROUGH = _Through()


class Dev(np.ndarray):
    """NumPy memory posing as CuPy's: NumPy functions (np.copyto, np.pad, ...)
    may not touch it except through the stand-in xp, and a ufunc may not mix
    it with a host array, which CuPy refuses too."""

    def __array_function__(self, func, types, args, kwargs):
        assert THROUGH.on, f"numpy.{func.__name__} on a device array, not through xp"
        return super().__array_function__(func, types, args, kwargs)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        out = kwargs.get("out", ())
        for a in (*inputs, *out):
            assert not (isinstance(a, np.ndarray) and not isinstance(a, Dev) and a.ndim), \
                f"{ufunc.__name__}: a host array meets a device array"
        plain = [a.view(np.ndarray) if isinstance(a, Dev) else a for a in inputs]
        if out:
            kwargs["out"] = tuple(o.view(np.ndarray) for o in out)
        result = getattr(ufunc, method)(*plain, **kwargs)
        if out:
            return out[0] if len(out) == 1 else out
        return result.view(Dev) if isinstance(result, np.ndarray) else result


def _wrap(fn):
    def call(*args, **kwargs):
        THROUGH.on = True
        try:
            result = fn(*args, **kwargs)
        finally:
            THROUGH.on = False
        return result.view(Dev) if isinstance(result, np.ndarray) and not isinstance(result, Dev) else result
    return call


class StandInCupy:
    """xp = numpy's namespace, every function returning Dev arrays; fresh
    buffers (empty) full of NaN (or junk) so a read before a write shows."""

    def __init__(self, module=np):
        self.module = module

    def __getattr__(self, name):
        obj = getattr(self.module, name)
        if name in ("empty", "empty_like"):
            def empty(*args, **kwargs):
                a = _wrap(getattr(np, name))(*args, **kwargs)
                a.fill(np.nan if a.dtype.kind == "f" else True if a.dtype.kind == "b" else 123)
                return a
            return empty
        if name == "asarray":
            return _wrap(lambda a, dtype=None: np.array(a, dtype=dtype, copy=True))
        if isinstance(obj, type):
            return obj
        if hasattr(obj, "__path__") or type(obj).__name__ == "module":
            return StandInCupy(obj)
        return _wrap(obj) if callable(obj) else obj


def _all_kinds(shape, classes):
    """One model holding every layer kind."""
    return ModelSpec([Channels(), Conv2d(6, 3, padding=1), BatchNorm2d(), ReLU(), MaxPool2d(2),
                      Residual([ReLU(), Conv2d(6, 3, padding=1, bias=False), Dropout(0.3)]),
                      Residual([Conv2d(8, 3, stride=2, padding=1)], projection=[Conv2d(8, 1, stride=2), BatchNorm2d()]),
                      AvgPool2d(2, 1), Dropout(0.2), Flatten(), Dense(12), BatchNorm1d(), ReLU(), Dense(classes)],
                     shape, classes, name="kinds")


@pytest.mark.parametrize("make, shape", [(_all_kinds, (12, 12)), (MODELS["resnet"], (16, 16, 3)),
                                         (MODELS["cnn"], (20, 20, 3)), (MODELS["lenet"], (28, 28))],
                         ids=["every-kind", "resnet", "cnn", "lenet"])
def test_cupy_path_on_a_stand_in_equals_numpy(make, shape, monkeypatch):
    # NumPy multiplies im2col columns a block of images at a time, a GPU the
    # whole batch at once; BLAS may round a block's rows differently, so here
    # NumPy takes the whole batch too (the blocks: test_conv2d_..._direct_loop).
    from hpctrain.nn import conv
    monkeypatch.setattr(conv, "BLOCK_FLOATS", 1 << 62)
    spec = make(shape, 5)
    xp = StandInCupy()
    host, dev = spec.build(dtype=np.float64), spec.build(xp, dtype=np.float64)
    host.init(3)
    dev.init(3)
    rng = np.random.default_rng(0)
    x, y, ids = rng.random((6, *shape)), rng.integers(0, 5, 6), np.arange(40, 46)
    for _ in range(2):   # the second step runs on warm buffers
        lh = host.forward_backward(x, y, noise=(1, 2, ids))
        ld = dev.forward_backward(xp.asarray(x), xp.asarray(y), noise=(1, 2, ids))
        assert isinstance(dev.grads, Dev)
        assert isinstance(dev.ctx.inner[-1].buffer(("out", True), (6, 5), np.float64), Dev)
        assert float(lh) == float(ld)
        assert np.array_equal(host.grads, dev.grads.view(np.ndarray)), "the stand-in's gradients differ"
        assert np.array_equal(host.state, dev.state.view(np.ndarray))
    assert dev.evaluate(xp.asarray(x), xp.asarray(y), batch=4) == host.evaluate(x, y, batch=4)


def test_the_custom_layer_in_docs_models_md_passes_the_gradient_check():
    import pathlib
    text = (pathlib.Path(__file__).parents[1] / "docs" / "models.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    namespace = {}
    exec(compile(code, "docs/models.md", "exec"), namespace)
    affine = namespace["ChannelAffine"]
    check_gradients(affine(), (3, 4, 5))
    spec = ModelSpec([Channels(), Conv2d(8, 3), affine(), ReLU(), Flatten(), Dense(10)], (28, 28), 10)
    m = spec.build()
    m.init(0)
    assert np.isfinite(float(m.forward_backward(np.random.default_rng(0).random((4, 28, 28), np.float32),
                                                np.arange(4))))


# --- the per-layer bench (figures not checked: speed is shown, never asserted) ---------

def test_bench_layers_reports_every_layer_and_refuses_an_unknown_model(capsys):
    import json
    import subprocess
    import sys
    run = [sys.executable, "-m", "hpctrain.bench", "layers", "--model", "lenet", "--shape", "28,28", "--batch", "4"]
    r = subprocess.run([*run, "--seconds", "0.01", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [row["layer"] for row in out["layers"]] == [layer.describe() for layer in MODELS["lenet"]().layers]
    assert out["threads"] == 1 and out["clock"] == "cpu" and out["sgemm_gflops"] > 0 and out["images_per_s"] > 0
    assert all(row["gflops"] > 0 for row in out["layers"] if row["layer"].startswith(("Conv2d", "Dense")))
    # as a rank with 2 cores trains: 2 compute threads, wall time
    r = subprocess.run([*run, "--seconds", "0.01", "--json", "--threads", "2"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    two = json.loads(r.stdout)
    assert two["threads"] == 2 and two["clock"] == "wall" and len(two["layers"]) == len(out["layers"])
    assert two["images_per_s"] > 0
    # the refusals in this process: bench's main prints the one line and returns 2, as the command exits
    from hpctrain.bench.__main__ import main
    for bad, says in ((["--model", "vgg"], "--model vgg: not one of mlp"),
                      (["--model", "cnn", "--shape", "4,4"], "--model cnn on 4x4: layer")):
        code = main([*run[3:], *bad])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith(f"hpctrain: error: {says}") and len(err.splitlines()) == 1, err
