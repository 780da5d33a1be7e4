"""Optimizers on flat arrays against textbook formulas; slices equal the whole."""
import math

import numpy as np
import pytest

from hpctrain.optim import optimizers as optim
from hpctrain.optim.optimizers import Adam, Momentum, OnDevice, SGD, Sharded, learning_rate, make_optimizer


def reference(name, p, grads, lr, scale):
    p = p.astype(np.float64).copy()
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(grads, 1):
        g = g.astype(np.float64) * scale
        if name == "sgd":
            p -= lr * g
        elif name == "momentum":
            m = 0.9 * m + g
            p -= lr * m
        else:
            m = 0.9 * m + 0.1 * g
            v = 0.999 * v + 0.001 * g * g
            p -= lr / (1 - 0.9 ** t) * m / (np.sqrt(v) / math.sqrt(1 - 0.999 ** t) + 1e-8)
    return p


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_matches_reference(name):
    rng = np.random.default_rng(0)
    n = optim.BLOCK * 2 + 123  # several blocks and a ragged end
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(5)]
    p = p0.copy()
    opt = make_optimizer(name, n)
    for g in grads:
        opt.step(p, g, 1e-2, grad_scale=0.5)
    np.testing.assert_allclose(p, reference(name, p0, grads, 1e-2, 0.5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [SGD, Momentum, Adam])
def test_slice_updates_equal_whole_buffer_bit_for_bit(cls):
    """What a parameter server does with its slice is what ring mode does with those elements."""
    rng = np.random.default_rng(1)
    n, cut = 100_000, 37_001
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
    whole, parts = p0.copy(), p0.copy()
    a, b1, b2 = cls(n), cls(cut), cls(n - cut)
    for g in grads:
        a.step(whole, g, 1e-3)
        b1.step(parts[:cut], g[:cut], 1e-3)
        b2.step(parts[cut:], g[cut:], 1e-3)
    assert np.array_equal(whole, parts)


def test_adam_flushes_subnormal_moments():
    n = 1000
    opt = Adam(n)
    p = np.zeros(n, np.float32)
    g = np.zeros(n, np.float32)
    g[:10] = 1e-3
    opt.step(p, g, 1e-3)
    g[:] = 0
    for _ in range(optim.FLUSH_EVERY * 20):
        opt.step(p, g, 1e-3)
    tiny = np.finfo(np.float32).tiny
    for state in (opt.m, opt.v):
        nz = state[state != 0]
        assert np.all(np.abs(nz) >= tiny), "subnormal values left in Adam state"


def test_learning_rate_schedule():
    assert learning_rate(0, 0.1) == 0.1
    assert learning_rate(5, 0.1, workers=4, scale_lr=True) == pytest.approx(0.4)
    assert learning_rate(0, 0.1, warmup_steps=10) == pytest.approx(0.01)
    assert learning_rate(4, 0.1, workers=2, scale_lr=True, warmup_steps=10) == pytest.approx(0.1)
    assert learning_rate(10, 0.1, warmup_steps=10) == pytest.approx(0.1)


def test_state_names():
    assert set(Adam(4).state()) == {"m", "v"}
    assert set(Momentum(4).state()) == {"velocity"}
    assert SGD(4).state() == {}


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_on_device_equals_the_inner_optimizer_through_restores(name):
    """optim.OnDevice (a server's --ps-device gpu optimizer; NumPy stands in for
    CuPy here) keeps host parameters and state authoritative across restores."""
    from hpctrain.optim.optimizers import OnDevice
    rng = np.random.default_rng(3)
    n = 5000
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(8)]
    plain, wrapped = make_optimizer(name, n), OnDevice(make_optimizer(name, n), n)
    p_plain = rng.standard_normal(n).astype(np.float32)
    p_wrapped = np.zeros(n, np.float32)
    wrapped.state()           # a restore: the caller writes parameters into its host buffer
    p_wrapped[...] = p_plain
    for g in grads[:4]:
        plain.step(p_plain, g, 1e-2, 0.5)
        wrapped.step(p_wrapped, g, 1e-2, 0.5)
    assert np.array_equal(p_plain, p_wrapped)
    for k, v in plain.state().items():   # a snapshot reads the device state
        assert np.array_equal(wrapped.state()[k], v)
    # a restore from other values: host params and state are written, t set
    for k, v in wrapped.state().items():
        v[...] = plain.state()[k] * 0.5
        plain.state()[k][...] *= 0.5
    p_wrapped[...] = p_plain = p_plain * 2
    wrapped.t = plain.t = 10
    for g in grads[4:]:
        plain.step(p_plain, g, 1e-2)
        wrapped.step(p_wrapped, g, 1e-2)
    assert np.array_equal(p_plain, p_wrapped) and wrapped.t == plain.t == 14


def test_wrapped_optimizers_read_and_set_the_inner_step_count():
    for wrapped in (OnDevice(make_optimizer("adam", 8), 8),
                    Sharded(lambda n: make_optimizer("adam", n), [(2, 6)], 8)):
        wrapped.t = 7
        assert wrapped.inner.t == 7 and wrapped.t == 7
