"""Optimizers on flat arrays against textbook formulas; slices equal the whole."""
import math

import numpy as np
import pytest

from hpctrain.optim import base
from hpctrain.optim.adam import FLUSH_EVERY, Adam
from hpctrain.optim.base import BLOCK, FUSE_FROM, FUSE_WORK
from hpctrain.optim.momentum import Momentum
from hpctrain.optim.on_device import OnDevice
from hpctrain.optim.optimizers import OPTIMIZERS, make_optimizer
from hpctrain.optim.sgd import SGD
from hpctrain.optim.sharded import Sharded
from hpctrain.optim.lr_schedule import learning_rate


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
    n = BLOCK * 2 + 123  # several blocks and a ragged end
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
    for _ in range(FLUSH_EVERY * 20):
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
                    Sharded(lambda n, _: make_optimizer("adam", n), [(2, 6)], 8)):
        wrapped.t = 7
        assert wrapped.inner.t == 7 and wrapped.t == 7


# --- the single pass (numba on NumPy, one CuPy kernel per range) against the NumPy blocks ---

def _bits(a):
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


def _same_steps(fast, slow, n, dtype, rng, pieces):
    """Step both optimizers alike, past Adam's flush, over ranges cut at
    `pieces`, with a clip-style grad_scale change after begin(); the moments
    get tiny values of both signs planted before the flushing step. The
    parameters and state must have the same bits after every step (a
    checkpoint may be written after any; a flushed -0.0 is +0.0 a step later)."""
    p0 = rng.standard_normal(n).astype(dtype)
    pf, ps = p0.copy(), p0.copy()
    cuts = [0, *pieces, n]
    for step in range(1, FLUSH_EVERY + 3):
        g = (rng.standard_normal(n) * (1e-3 if step % 7 else 1e-32)).astype(dtype)
        g[: n // 10] = 0                      # parameters that never see a gradient
        if step == FLUSH_EVERY:
            tiny = np.array([3e-31, -3e-31, 5e-40, -5e-40, 1e-29], dtype)[np.arange(n // 20) % 5]
            for opt in (fast, slow):
                for key, state in opt.state().items():
                    state[: n // 20] = np.abs(tiny) if key == "v" else tiny   # v, a variance, is >= 0
        for opt, p in ((fast, pf), (slow, ps)):
            opt.begin(1e-2 / step, 0.5)
            if step % 3 == 0:
                opt.set_grad_scale(0.5 * 0.37)
            for lo, hi in zip(cuts, cuts[1:]):
                opt.update(p, g, lo, hi)
        assert np.array_equal(_bits(pf), _bits(ps)), step
        for k, v in slow.state().items():
            assert np.array_equal(_bits(fast.state()[k]), _bits(v)), (step, k)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_single_pass_gives_the_numpy_blocks_bits(name, weight_decay, dtype):
    pytest.importorskip("numba")
    n = BLOCK + 4_321
    fast = make_optimizer(name, n, dtype=dtype, weight_decay=weight_decay, fused=True)
    slow = make_optimizer(name, n, dtype=dtype, weight_decay=weight_decay, fused=False)
    assert fast._kernel is not None and slow._kernel is None
    _same_steps(fast, slow, n, dtype, np.random.default_rng(7), [1, 999, BLOCK + 5])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_single_pass_gives_the_numpy_blocks_bits_with_decay_on_part_of_the_buffer(name, dtype):
    # decay ranges that cross a block's end and the update's ranges, start at 0, and touch
    pytest.importorskip("numba")
    n = BLOCK + 4_321
    decay = [(0, 500), (500, 700), (900, BLOCK + 10), (BLOCK + 2000, n - 1)]
    fast = make_optimizer(name, n, dtype=dtype, weight_decay=0.01, fused=True, decay_ranges=decay)
    slow = make_optimizer(name, n, dtype=dtype, weight_decay=0.01, fused=False, decay_ranges=decay)
    assert fast._kernel is not None and slow._kernel is None
    _same_steps(fast, slow, n, dtype, np.random.default_rng(7), [1, 999, BLOCK + 5])


def test_the_single_pass_runs_from_fuse_from_elements_where_numba_is():
    pytest.importorskip("numba")
    assert Adam(FUSE_FROM)._kernel is not None
    assert Adam(FUSE_FROM - 1)._kernel is None
    sharded = make_optimizer("sgd", 2 * FUSE_FROM, owned=[(0, FUSE_FROM)])
    assert sharded.inner._kernel is not None


def test_the_single_pass_runs_where_it_pays_back_numbas_start_up_within_the_run():
    pytest.importorskip("numba")
    size = 2 * FUSE_FROM
    pays = -(-FUSE_WORK // size)   # the fewest steps over which it does
    assert make_optimizer("adam", size, steps=pays)._kernel is not None
    assert make_optimizer("adam", size, steps=pays - 1)._kernel is None
    assert make_optimizer("adam", size, steps=pays - 1, fused=True)._kernel is not None   # --single-pass on
    assert make_optimizer("adam", FUSE_FROM - 1, steps=10**9)._kernel is None
    assert make_optimizer("adam", size)._kernel is not None   # steps not known: size alone
    sharded = make_optimizer("sgd", 2 * size, owned=[(0, size)], steps=pays)
    assert sharded.inner._kernel is not None


def test_the_single_pass_runs_from_the_first_step_with_compiled_layers():
    """With compiled layers numba is in the process already: --single-pass
    auto takes the pass however short the run (run/plan.py single_pass);
    off stays off."""
    from types import SimpleNamespace

    from hpctrain.nn import compiled
    from hpctrain.run.plan import Optimizer, single_pass
    pytest.importorskip("numba")
    size = 2 * FUSE_FROM
    for on, flag, want in ((False, "auto", "auto"), (True, "auto", "on"), (True, "off", "off"), (False, "on", "on")):
        compiled.use(on)
        try:
            chosen = single_pass(SimpleNamespace(single_pass=flag))
        finally:
            compiled.use(False)
        assert chosen == want, (on, flag)
        plan = Optimizer("adam", 0.9, (0.9, 0.999), 0.0, None, None, 10, chosen)
        fused = make_optimizer("adam", size, **plan.kwargs)._kernel is not None
        assert fused == (want == "on"), (on, flag)


class _FakeElementwiseKernel:
    """cupy.ElementwiseKernel on NumPy: the arguments bound to the declared
    names, then the optimizer's Python loop (its parameters bear the same
    names) runs on them: a wrong order of arguments shows as wrong bits."""
    launches = []
    options = []

    def __init__(self, in_params, out_params, operation, name, options=()):
        self.names = [p.split()[-1] for p in f"{in_params}, {out_params}".split(",")]
        self.name = name
        _FakeElementwiseKernel.options.append(options)

    def __call__(self, *args):
        assert len(args) == len(self.names)
        _FakeElementwiseKernel.launches.append((self.name, args[self.names.index("p")].size))
        bound = dict(zip(self.names, args))
        assert all(np.ndim(v) == 0 or v.shape == bound["p"].shape for v in args)
        OPTIMIZERS[self.name[len("hpctrain_"):]].loop(**bound)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_gpu_kernel_is_one_launch_per_range_with_the_numpy_blocks_bits(name, monkeypatch):
    import types
    fake = types.SimpleNamespace(__name__="cupy", ElementwiseKernel=_FakeElementwiseKernel,
                                 zeros=np.zeros, empty=np.empty)
    monkeypatch.setattr(base, "_compiled", {})
    monkeypatch.setattr(_FakeElementwiseKernel, "launches", [])
    monkeypatch.setattr(_FakeElementwiseKernel, "options", [])
    n = 2_000   # the loops run in Python here
    fast = make_optimizer(name, n, xp=fake, weight_decay=0.01)
    slow = make_optimizer(name, n, weight_decay=0.01, fused=False)
    assert _FakeElementwiseKernel.options == [("--fmad=false",)]   # no a * b + c in one rounding
    _same_steps(fast, slow, n, np.float32, np.random.default_rng(8), [700, 701])
    assert _FakeElementwiseKernel.launches == [(f"hpctrain_{name}", size) for _ in range(FLUSH_EVERY + 2)
                                               for size in (700, 1, n - 701)]


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_gpu_kernel_with_decay_on_part_of_the_buffer_is_one_launch_per_piece_with_the_numpy_blocks_bits(
        name, monkeypatch):
    # a range update cut where decay starts and stops: keep inside, 1.0 outside
    import types
    fake = types.SimpleNamespace(__name__="cupy", ElementwiseKernel=_FakeElementwiseKernel,
                                 zeros=np.zeros, empty=np.empty)
    monkeypatch.setattr(base, "_compiled", {})
    monkeypatch.setattr(_FakeElementwiseKernel, "launches", [])
    n, decay = 2_000, [(100, 600), (650, 1500)]
    fast = make_optimizer(name, n, xp=fake, weight_decay=0.01, decay_ranges=decay)
    slow = make_optimizer(name, n, weight_decay=0.01, fused=False, decay_ranges=decay)
    _same_steps(fast, slow, n, np.float32, np.random.default_rng(8), [700])
    # [0, 700): 0-100, 100-600, 600-650, 650-700; [700, 2000): 700-1500, 1500-2000
    assert [size for _, size in _FakeElementwiseKernel.launches[:6]] == [100, 500, 50, 50, 800, 500]
