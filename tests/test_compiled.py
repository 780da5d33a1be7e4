"""The compiled layer kernels (hpctrain/nn/compiled.py, `--compiled-layers`):
each path a direct convolution takes (forward, weight gradient, input gradient
by the turned kernel at stride 1, by col2im otherwise; row tails shorter
than a register block; blocks of images) against the plain loops of
tests/test_layers.py in float64, finite differences, the same bits on any
number of compute threads, the zoo's models against im2col in float32,
and a training job.

    .venv/bin/python -m pytest -q tests/test_compiled.py
"""
import numpy as np
import pytest

from conftest import same_bytes
from test_layers import bound, check_against_loops, check_gradients
from hpctrain.nn import MODELS, BatchNorm2d, Conv2d, ReLU, Residual, compiled, conv, threads

pytest.importorskip("numba")


@pytest.fixture
def compiled_layers():
    """Layers bound inside run nn/compiled.py's kernels; NumPy's again afterwards."""
    compiled.use(True)
    yield
    compiled.use(False)


@pytest.mark.parametrize("out, k, s, p, shape", [
    (16, 3, 1, 1, (6, 7, 16)),     # every path direct, rows of 7: a block of 4 and a tail of 3
    (32, 3, 1, 1, (5, 5, 3)),      # first-layer width in: the input gradient by the turned GEMM
    (64, 3, 1, 1, (4, 6, 64)),
    (32, 3, 2, 1, (7, 8, 16)),     # stride 2: forward and dW direct, dx by col2im
    (16, 1, 2, 0, (5, 5, 16)),     # a 1x1 projection
    (16, 5, 1, 2, (6, 6, 1)),      # 5x5, one input channel
    (64, 3, 1, 0, (6, 9, 32)),     # unpadded: the kernels read the input itself
])
@pytest.mark.parametrize("blocks", ["one", "of 1 image"])
def test_direct_layers_equal_the_plain_loops(out, k, s, p, shape, blocks, compiled_layers, monkeypatch):
    layer, _, _ = bound(Conv2d(out, k, stride=s, padding=p), shape)
    assert layer.direct
    monkeypatch.setattr(conv, "BLOCK_FLOATS", 1 << 62 if blocks == "one" else 1)
    layer.params["b"][...] = np.arange(out) * 0.25
    check_against_loops(layer, shape, s, p)


@pytest.mark.parametrize("make, shape", [
    (lambda: Conv2d(16, 3, padding=1), (5, 6, 16)),
    (lambda: Conv2d(32, 3, stride=2, padding=1, bias=False), (6, 5, 3)),
    (lambda: Residual([Conv2d(16, 3, padding=1), BatchNorm2d(), ReLU(), Conv2d(16, 3, padding=1)]), (4, 5, 16)),
], ids=lambda v: v().describe() if callable(v) else "x".join(map(str, v)))
def test_direct_layers_match_finite_differences(make, shape, compiled_layers):
    check_gradients(make(), shape, batch=5 if "Batch" in make().describe() else 3)


def _train_step(spec, x, y):
    model = spec.build(np)
    model.init(3)
    loss = model.forward_backward(x, y, noise=(0, 0, np.arange(len(x))))
    return np.float64(loss), model.grads.copy(), model.evaluate(x, y)


@pytest.mark.parametrize("name", ["small_cnn", "resnet"])
def test_zoo_models_train_as_with_im2col_to_float32_rounding(name):
    """float32: the sums run in another order than BLAS's, so the bits move
    (by float32 rounding), not the function."""
    spec = MODELS[name]((28, 28), 10)
    rng = np.random.default_rng(2)
    x, y = rng.random((32, 28, 28), dtype=np.float32), rng.integers(0, 10, 32)
    want = _train_step(spec, x, y)
    compiled.use(True)
    try:
        model = spec.build(np)
        assert any(getattr(layer, "direct", False) for layer in model.layers)
        got = _train_step(spec, x, y)
    finally:
        compiled.use(False)
    assert abs(got[0] - want[0]) < 1e-5
    assert np.linalg.norm(got[1] - want[1]) < 1e-4 * np.linalg.norm(want[1])


@pytest.mark.parametrize("name", ["small_cnn", "resnet"])
def test_compiled_layers_give_the_same_bits_on_two_threads(name, compiled_layers):
    shape = (28, 28)
    rng = np.random.default_rng(2)
    x, y = rng.random((32, *shape), dtype=np.float32), rng.integers(0, 10, 32)
    results = []
    try:
        for count in (1, 2):
            assert threads.configure(count) == count
            results.append(_train_step(MODELS[name](shape, 10), x, y))
    finally:
        threads.configure(1)
    assert results[0][0] == results[1][0] and results[0][1].tobytes() == results[1][1].tobytes()


def test_only_fitting_layers_run_direct(compiled_layers):
    assert compiled.fits(16) and compiled.fits(64) and not compiled.fits(10) and not compiled.fits(128)
    assert not bound(Conv2d(10, 3), (5, 5, 3))[0].direct        # 10 outputs: im2col
    assert not bound(Conv2d(16, 1), (5, 5, 3))[0].direct        # 1x1 stride 1: one GEMM already
    assert bound(Conv2d(16, 3), (5, 5, 3), dtype=np.float32)[0].direct
    compiled.use(False)
    assert not bound(Conv2d(16, 3), (5, 5, 3), dtype=np.float32)[0].direct


# --- training with --compiled-layers ----------------------------------------------------

def _final_loss(stdout):
    lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    return float(lines[-1].split("loss")[1].split()[0].strip(":=,"))


def test_a_job_trains_with_compiled_layers_as_without(job, tmp_path):
    common = ["--model", "small_cnn", "--steps", "12", "--batch-size", "16", "--log-every", "6"]
    out = {}
    for on, line in (("off", "layers: NumPy"), ("on", "layers: compiled")):
        r = job(2, *common, "--compiled-layers", on, "--threads", "1")
        assert r.returncode == 0, r.stderr
        assert line in r.stdout
        out[on] = _final_loss(r.stdout)
    assert abs(out["on"] - out["off"]) < 1e-3 * abs(out["off"])


def test_compiled_layers_on_without_numba_is_one_line(job, tmp_path):
    """numba hidden from the job (a package that fails to import, as a missing one does)."""
    hidden = tmp_path / "numba"
    hidden.mkdir()
    (hidden / "__init__.py").write_text("raise ImportError('No module named numba')\n")
    r = job(2, "--model", "small_cnn", "--steps", "1", "--compiled-layers", "on", env={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 2
    assert "--compiled-layers on: numba is not installed" in r.stderr and r.stderr.count("error") == 1


def test_compiled_layers_auto_takes_them_where_they_pay():
    from types import SimpleNamespace
    from hpctrain.run.startup import COMPILED_FROM, compiled_layers

    def flag(value):
        return SimpleNamespace(compiled_layers=value)
    assert compiled_layers(flag("auto"), np, COMPILED_FROM) is True
    assert compiled_layers(flag("auto"), np, COMPILED_FROM - 1) is False
    assert compiled_layers(flag("off"), np, 10 ** 6) is False
    assert compiled_layers(flag("on"), np, 1) is True
    assert compiled_layers(flag("on"), object(), 1) is False   # not NumPy: CuPy's own kernels
