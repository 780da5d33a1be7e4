"""A rank's compute threads (hpctrain/nn/threads.py): every layer that
splits its work over them gives the same bits on 1, 2 or 3 threads, on
every path it takes (Conv2d's kept and rewritten columns, its transposed and
col2im input gradients, 1x1; batch norm in training and evaluation; ReLU;
Dense by columns; the GPT's GELU and Linear), and so do whole models and a
training job.

The thresholds below which work stays in the calling thread are lowered
here, so that small shapes split too.

    .venv/bin/python -m pytest -q tests/test_threads.py
"""
import numpy as np
import pytest

from conftest import same_bytes
from hpctrain.nn import (MODELS, BatchNorm2d, Channels, Conv2d, Dense, Flatten, ModelSpec, ReLU, Residual, gpt,
                         threads)
from hpctrain.nn import conv


@pytest.fixture
def split_everything(monkeypatch):
    """Every elementwise pass splits, and conv blocks of a few images (so
    a batch has several blocks to hand out); products keep their own bound
    (threads.MIN_MACS: below it OpenBLAS's small-matrix kernels sum in
    another order). Yields the number of runs that split into several parts.
    One thread again afterwards."""
    monkeypatch.setattr(threads, "MIN_FLOATS", 1)
    monkeypatch.setattr(conv, "BLOCK_FLOATS", 1 << 14)
    splits = []
    run = threads.run

    def spy(fn, parts):
        if len(parts) > 1:
            splits.append(len(parts))
        return run(fn, parts)
    monkeypatch.setattr(threads, "run", spy)
    yield splits
    threads.configure(1)


def _step(spec, count, x, y, train=True):
    """forward_backward on `count` threads, this thread's BLAS at one thread
    throughout (as the workers' are: OpenBLAS's own threads sum some shapes
    in another order, which is not ours to test): (loss, an evaluation of
    x, gradient buffer, state buffer), copied."""
    assert threads.configure(count) == count
    hold = threads._blas_local_threads()
    hold(1)
    try:
        return _run(spec, x, y)
    finally:
        hold(0)


def _run(spec, x, y):
    model = spec.build(np)
    model.init(3)
    noise = (0, 0, np.arange(len(x)))
    loss = model.forward_backward(x, y, noise=noise)
    evaluated = model.evaluate(x, y)
    return (np.float64(loss), np.asarray(list(evaluated.values()), dtype=np.float64), model.grads.copy(),
            model.state.copy() if model.state is not None else None)


def _same(a, b):
    return all((p is None and q is None) or np.asarray(p).tobytes() == np.asarray(q).tobytes()
               for p, q in zip(a, b))


# (layers, image shape, batch): the products that split by images or columns
# (conv 1x1, col2im, Dense) sized to be worth two parts or three.
LAYERS = {
    # im2col columns kept for dW (k*k*c < conv.AGAIN_FROM), transposed dx
    "conv kept columns": ([Channels(), Conv2d(5, 3, padding=1), Flatten(), Dense(10)], (9, 9, 3), 20),
    # columns written again for dW, per block (k*k*c >= AGAIN_FROM), several blocks
    "conv columns again": ([Channels(), Conv2d(8, 3, padding=1), Conv2d(6, 3, padding=1), Flatten(), Dense(10)],
                           (8, 8, 8), 7),
    # stride 2: dy @ W.T and col2im by images; widening more than 2x: the same
    "conv col2im": ([Channels(), Conv2d(16, 3, stride=2, padding=1), Conv2d(40, 3, padding=1), Flatten(),
                     Dense(10)], (16, 16, 2), 32),
    "conv 1x1": ([Channels(), Conv2d(32, 1), Conv2d(64, 1, bias=False), Flatten(), Dense(10)], (16, 16, 3), 24),
    "batch norm and ReLU": ([Channels(), Conv2d(6, 3, padding=1), BatchNorm2d(), ReLU(), Flatten(), Dense(10)],
                            (7, 7, 3), 7),
    "residual": ([Channels(), Conv2d(4, 3, padding=1), Residual([Conv2d(4, 3, padding=1), BatchNorm2d(), ReLU()]),
                  Flatten(), Dense(10)], (6, 6, 1), 7),
    "dense by columns": ([Flatten(), Dense(512), ReLU(), Dense(384), ReLU(), Dense(10)], (24, 24), 64),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layers_give_the_same_bits_on_any_number_of_threads(name, split_everything):
    layers, shape, batch = LAYERS[name]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    results = [_step(ModelSpec(list(layers), shape, 10), count, x, y) for count in (1, 2, 3)]
    assert split_everything, "nothing split: the test would prove nothing"
    assert _same(results[0], results[1]) and _same(results[0], results[2])


@pytest.mark.parametrize("compiled_layers", [False, True])
def test_the_gpt_gives_the_same_bits_on_any_number_of_threads(split_everything, compiled_layers):
    """GELU's chunks and the Linear projections split (nn/gelu.py, nn/linear.py), the
    attention by samples, dropout on; on two threads each backward's two products at
    once (threads.pair); with compiled layers (nn/passes.py) too."""
    from hpctrain.nn import compiled
    if compiled_layers and not compiled.available():
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 65, (24, 16)), rng.integers(0, 65, (24, 16))
    compiled.use(compiled_layers)
    try:
        results = [_step(gpt(65, 16, 2, 4, 64, dropout=0.1), count, x, y) for count in (1, 2, 3)]
    finally:
        compiled.use(False)
    assert split_everything, "nothing split: the test would prove nothing"
    assert _same(results[0], results[1]) and _same(results[0], results[2])


@pytest.mark.parametrize("name", ["gpt", "conv columns again", "conv col2im", "dense by columns"])
def test_mkl_products_give_the_same_bits_on_any_number_of_threads(name, split_everything):
    """--blas mkl (nn/blas.py): the products' rows cut as for OpenBLAS; the
    layers' products are MKL's (counted)."""
    from hpctrain.nn import blas
    if not blas.available():
        pytest.skip("--blas mkl needs MKL (pip install 'hpctrain[mkl]')")
    rng = np.random.default_rng(1)
    if name == "gpt":
        spec, x, y = gpt(65, 16, 2, 4, 64, dropout=0.1), rng.integers(0, 65, (24, 16)), rng.integers(0, 65, (24, 16))
    else:
        layers, shape, batch = LAYERS[name]
        spec = ModelSpec(list(layers), shape, 10)
        x, y = rng.standard_normal((batch, *shape)).astype(np.float32), rng.integers(0, 10, batch)
    blas.configure("mkl")
    taken, gemm = [], blas._gemm
    # the count set by hand, not by monkeypatch: its undo would put MKL back after configure("numpy")
    blas._gemm = lambda a, b, out: taken.append(gemm(a, b, out)) or taken[-1]
    try:
        results = [_step(spec, count, x, y) for count in (1, 2, 3)]
    finally:
        blas.configure("numpy")
    assert sum(taken) >= 3 * (2 if name == "gpt" else 3), taken   # MKL's: each layer's forward, dW and dx at least
    assert split_everything, "nothing split: the test would prove nothing"
    assert _same(results[0], results[1]) and _same(results[0], results[2])


def test_products_split_only_above_openblas_small_kernels():
    assert threads.most(macs=threads.MIN_MACS - 1) == 1
    assert threads.most(macs=3 * threads.MIN_MACS) == 3
    assert threads.MIN_MACS // 2 > 100 ** 3   # the half of a product split in two



def test_a_split_sizes_its_parts_only_where_it_can_split(monkeypatch):
    """The serial path (one thread, or a part's own split: every slice of
    --thread-split samples) does the work at once, never the parts'
    arithmetic; with two threads the work's size bounds the parts."""
    def parts_of(**size):
        seen = []
        threads.split(10, lambda t, lo, hi: seen.append((lo, hi)), **size)
        return seen
    sized = threads.most
    monkeypatch.setattr(threads, "most", lambda *a, **k: pytest.fail("a serial split sized its parts"))
    assert parts_of(floats=1 << 30) == [(0, 10)]
    try:
        assert threads.configure(2) == 2 or pytest.skip("BLAS cannot be held to one thread")
        inner = []
        threads.split(2, lambda t, lo, hi: inner.append(parts_of(floats=1 << 30)))
        assert inner == [[(0, 10)], [(0, 10)]]   # each part's split ran serially
        monkeypatch.setattr(threads, "most", sized)
        assert parts_of(floats=threads.MIN_FLOATS - 1) == [(0, 10)]
        assert sorted(parts_of(floats=2 * threads.MIN_FLOATS)) == [(0, 5), (5, 10)]
        assert sorted(parts_of(macs=2 * threads.MIN_MACS)) == [(0, 5), (5, 10)]
        assert sorted(parts_of()) == [(0, 5), (5, 10)]   # no size: every thread
    finally:
        threads.configure(1)


@pytest.mark.parametrize("name", ["small_cnn", "cnn", "resnet"])
def test_zoo_models_give_the_same_bits_on_two_threads(name):
    """At their own thresholds and blocks: what a run on a 2-core rank does."""
    shape = (28, 28)
    rng = np.random.default_rng(2)
    x = rng.random((32, *shape), dtype=np.float32)
    y = rng.integers(0, 10, 32)
    try:
        one, two = (_step(MODELS[name](shape, 10), count, x, y) for count in (1, 2))
    finally:
        threads.configure(1)
    assert _same(one, two)


def test_batch_norm_evaluation_splits_to_the_same_bits(split_everything):
    spec = ModelSpec([Channels(), Conv2d(6, 3, padding=1), BatchNorm2d(), Flatten(), Dense(10)], (7, 7, 3), 10)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((9, 7, 7, 3)).astype(np.float32)
    outs = []
    for count in (1, 2):
        threads.configure(count)
        model = spec.build(np)
        model.init(0)
        model.forward_backward(x, np.zeros(9, int))   # the running statistics move
        conv, bn = model.layers[1:3]
        outs.append(bn.forward(model.ctx.inner[2], conv.forward(model.ctx.inner[1], x, False), False).copy())
    assert outs[0].tobytes() == outs[1].tobytes()


def test_ranges_cover_in_whole_units():
    assert threads.ranges(10, 2) == [(0, 5), (5, 10)]
    assert threads.ranges(10, 3, unit=4) == [(0, 4), (4, 8), (8, 10)]
    assert threads.ranges(3, 8) == [(0, 1), (1, 2), (2, 3)]
    assert threads.ranges(5, 2, unit=8) == [(0, 5)]
    for n in range(1, 40):
        for parts in range(1, 5):
            for unit in (1, 3, 8):
                got = threads.ranges(n, parts, unit)
                assert got[0][0] == 0 and got[-1][1] == n and len(got) <= parts
                assert all(hi > lo and lo % unit == 0 for lo, hi in got)
                assert all(a[1] == b[0] for a, b in zip(got, got[1:]))


def test_an_error_in_a_part_is_raised_after_every_part_finished():
    assert threads.configure(3) == 3
    finished = []

    def work(t, lo, hi):
        if t == 0:
            raise ValueError("part 0 failed")
        finished.append(t)
    try:
        with pytest.raises(ValueError, match="part 0 failed"):
            threads.run(work, [(0, 1), (1, 2), (2, 3)])
        assert sorted(finished) == [1, 2]
        threads.run(lambda t, lo, hi: finished.append(10 + t), [(0, 1), (1, 2), (2, 3)])   # still serving
        assert sorted(finished) == [1, 2, 10, 11, 12]
        with pytest.raises(ValueError, match=r"4 parts for 3 threads"):   # a real check, kept under python -O
            threads.run(work, [(0, 1), (1, 2), (2, 3), (3, 4)])
    finally:
        threads.configure(1)


def test_training_on_two_threads_saves_the_same_bits_as_on_one(job, tmp_path):
    """--threads 1 gives the rank's cores to BLAS, whose own threads sum in
    another order: held to one here, as --threads 2 holds it."""
    common = ["--model", "small_cnn", "--steps", "12", "--batch-size", "16", "--log-every", "6"]
    for count in (1, 2):
        r = job(1, *common, "--threads", str(count), "--save", tmp_path / f"t{count}.h5",
                env={"OPENBLAS_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr
        assert f"compute threads per rank: {count}" in r.stdout or count == 1
    assert same_bytes(tmp_path / "t1.h5", tmp_path / "t2.h5")


def test_threads_flag_refuses_zero(job):
    r = job(1, "--threads", "0", "--steps", "1")
    assert r.returncode == 2
    assert "--threads" in r.stderr and r.stderr.count("error") == 1


def _convs(layers, contexts):
    """(convolution, its context), a Residual's inner ones too."""
    for layer, ctx in zip(layers, contexts):
        if isinstance(layer, Residual):
            yield from _convs(layer.block + layer.projection, ctx.inner[0].inner + ctx.inner[1].inner)
        elif isinstance(layer, Conv2d):
            yield layer, ctx


@pytest.mark.parametrize("name", ["cnn", "resnet"])
def test_the_memory_check_counts_every_threads_blocks(name):
    """What a compute thread holds in each convolution (its blocks of
    columns, buffers keyed by thread) is within scratch_floats, which
    memory_bytes counts once per thread."""
    spec = MODELS[name]((28, 28), 10)
    rng = np.random.default_rng(5)
    x = rng.random((32, 28, 28), dtype=np.float32)
    try:
        _step(spec, 2, x, rng.integers(0, 10, 32))
        model = spec.build(np)
        model.init(0)
        model.forward_backward(x, rng.integers(0, 10, 32), noise=(0, 0, np.arange(32)))
    finally:
        threads.configure(1)
    def thread_1(key):   # ("cols", 1), not ("out", True): True == 1
        return isinstance(key, tuple) and type(key[1]) is int and key[1] == 1
    held = {id(layer): sum(buf.nbytes for key, buf in ctx._buffers.items() if thread_1(key))
            for layer, ctx in _convs(model.layers, model.ctx.inner)}
    assert sum(held.values()) > 0   # the second thread did hold blocks
    for layer, _ in _convs(model.layers, model.ctx.inner):
        assert held[id(layer)] <= 4 * layer.scratch_floats(), layer.describe()
    scratch = sum(layer.scratch_floats() for layer in spec.layers)
    assert spec.memory_bytes(32, 2, threads=3) - spec.memory_bytes(32, 2, threads=1) == 2 * 4 * scratch
