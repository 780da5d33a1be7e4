"""The compiled layer kernels (hpctrain/nn/compiled.py, `--compiled-layers`):
each path a direct convolution takes (forward, weight gradient, input gradient
by the turned kernel at stride 1, by col2im otherwise; row tails shorter
than a register block; blocks of images) against the plain loops of
tests/test_layers.py in float64, finite differences, the same bits on any
number of compute threads, the zoo's models against im2col in float32,
and a training job.

    .venv/bin/python -m pytest -q tests/test_compiled.py
"""
import functools

import numpy as np
import pytest

from test_layers import bound, check_against_loops, check_gradients
from hpctrain.nn import (MODELS, AvgPool2d, BatchNorm1d, BatchNorm2d, Conv2d, MaxPool2d, ReLU, Residual,
                         compiled, conv, passes, threads)

pytest.importorskip("numba")


@pytest.fixture
def compiled_layers():
    """Layers bound inside run nn/compiled.py's kernels; NumPy's again afterwards."""
    compiled.use(True)
    yield
    compiled.use(False)


@pytest.mark.parametrize("out, k, s, p, shape", [
    (16, 3, 1, 1, (6, 7, 16)),     # every path direct, rows of 7: one block (AVX-512), a block of 4 and a tail of 3 (AVX2)
    (16, 3, 1, 1, (4, 3, 16)),     # rows of 3, narrower than any block: a pixel at a time
    (32, 3, 1, 1, (5, 5, 3)),      # first-layer width in: the input gradient by the turned GEMM
    (64, 3, 1, 1, (4, 6, 64)),
    (32, 3, 2, 1, (7, 8, 16)),     # stride 2: dx gathered, odd and even columns, blocks and edges
    (32, 3, 2, 1, (13, 14, 16)),   # wider: full blocks of 4 pixels 2 apart
    (64, 3, 2, 1, (10, 12, 32)),
    (16, 3, 2, 1, (7, 7, 5)),      # 5 channels in: dx by col2im
    (16, 1, 2, 0, (5, 5, 16)),     # a 1x1 projection, dx gathered
    (16, 5, 3, 2, (11, 13, 16)),   # stride 3, 5x5
    (16, 5, 1, 2, (6, 6, 1)),      # 5x5, one input channel: dW in blocks of 5 kernel offsets
    (16, 3, 1, 1, (7, 6, 1)),      # one input channel: dW in one block of all 9 offsets
    (32, 3, 2, 1, (9, 8, 1)),      # one input channel, stride 2: dW in blocks of 3 offsets
    (64, 3, 1, 0, (6, 9, 32)),     # unpadded: the kernels read the input itself
])
@pytest.mark.parametrize("blocks", ["one", "of 1 image"])
def test_direct_layers_equal_the_plain_loops(out, k, s, p, shape, blocks, compiled_layers, monkeypatch):
    if not compiled.fits(out):
        pytest.skip(f"{out} output channels run direct only with AVX-512 (this CPU: {compiled.isa()})")
    layer, _, _ = bound(Conv2d(out, k, stride=s, padding=p), shape)
    assert layer.direct
    monkeypatch.setattr(conv, "BLOCK_FLOATS", 1 << 62 if blocks == "one" else 1)
    layer.params["b"][...] = np.arange(out) * 0.25
    check_against_loops(layer, shape, s, p)


@pytest.mark.parametrize("make, shape", [
    (lambda: BatchNorm2d(), (4, 3, 5)),
    (lambda: BatchNorm1d(), (6,)),
    (lambda: Conv2d(16, 3, padding=1), (5, 6, 16)),
    (lambda: Conv2d(32, 3, stride=2, padding=1, bias=False), (6, 5, 3)),
    (lambda: Residual([Conv2d(16, 3, padding=1), BatchNorm2d(), ReLU(), Conv2d(16, 3, padding=1)]), (4, 5, 16)),
], ids=lambda v: v().describe() if callable(v) else "x".join(map(str, v)))
def test_direct_layers_match_finite_differences(make, shape, compiled_layers):
    check_gradients(make(), shape, batch=5 if "Batch" in make().describe() else 3)


@pytest.mark.parametrize("layer, shape", [(BatchNorm2d, (9, 7, 16)), (BatchNorm1d, (40,))])
def test_batch_norm_trains_as_numpys_to_float32_rounding(layer, shape):
    """Outputs, both gradients and the running statistics over two steps;
    the statistics are summed in float64 here, in float32 GEMVs there."""
    rng = np.random.default_rng(6)
    x = (3 + 2 * rng.standard_normal((12, *shape))).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    results = []
    for on in (False, True):
        compiled.use(on)
        try:
            bn, params, grads = bound(layer(), shape, dtype=np.float32, seed=3)
        finally:
            compiled.use(False)
        assert bn.compiled == on
        bn.params["gamma"][...] = rng.random(bn.channels) + 0.5
        for _ in range(2):
            y = bn.forward(x, True).copy()
            dx = bn.backward(dy, True).copy()
        results.append((y, dx, grads.copy(), bn.state["running_mean"].copy(), bn.state["running_var"].copy(),
                        bn.forward(x, False).copy()))
        rng = np.random.default_rng(6)   # the same gamma for both
        x = (3 + 2 * rng.standard_normal((12, *shape))).astype(np.float32)
        dy = rng.standard_normal(x.shape).astype(np.float32)
    for numpy_value, compiled_value in zip(*results):
        assert np.allclose(compiled_value, numpy_value, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("c", [5, 16, 64, 65])
def test_batch_norm_sums_made_per_channel_count_give_the_plain_loops_bits(c, dtype):
    """nn/passes.py's statistics and gradient sums made for c channels (their
    float64 sums in registers; 65 is past SUMS_CHANNELS: the plain loop)
    against the plain loops: the same bits."""
    rng = np.random.default_rng(8)
    x = (5 + 3 * rng.standard_normal((1000, c))).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    mean, inv_std = (rng.standard_normal(c) + 5).astype(dtype), rng.random(c).astype(dtype) + 0.5
    plain = np.empty((2, c)), np.empty((2, c))
    passes._plain("bn_statistics", dtype)(x, plain[0])
    passes._plain("bn_gradient_sums", dtype)(dy, x, mean, inv_std, plain[1])
    for name in ("bn_statistics", "bn_gradient_sums"):   # the kernel made for c, where one is made
        assert (passes._sums(name, c, dtype) is passes._plain(name, dtype)) == (c > passes.SUMS_CHANNELS)
    assert passes.bn_statistics(x).tobytes() == plain[0].tobytes()
    assert passes.bn_gradient_sums(dy, x, mean, inv_std).tobytes() == plain[1].tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k, shape", [(2, (8, 6, 5)), (2, (7, 9, 3)), (3, (9, 7, 2))])
def test_max_pool_and_relu_give_numpys_bits(k, shape, dtype):
    """Ties (the first maximum wins), a NaN in a window, rows and columns
    past the last window (their gradient 0), negative and NaN gradients
    where ReLU is inactive (-0.0, NaN): bit for bit the NumPy path's."""
    rng = np.random.default_rng(7)
    x = rng.integers(-3, 4, (4, *shape)).astype(dtype)   # many ties
    x[1, 0, 0, 0] = x[1, 1, 1, 1] = np.nan   # the first offset, and a later one
    dy_relu = rng.standard_normal(x.shape).astype(dtype)
    dy_relu[2, 1, 1, 1] = np.nan
    results = []
    for on in (False, True):
        compiled.use(on)
        try:
            pool, _, _ = bound(MaxPool2d(k), shape, dtype=dtype)
            relu, _, _ = bound(ReLU(), shape, dtype=dtype)
        finally:
            compiled.use(False)
        assert pool.compiled == relu.compiled == on
        y = pool.forward(x, True).copy()
        dy = np.random.default_rng(8).standard_normal(y.shape).astype(dtype)
        dx = pool.backward(dy, True).copy()
        r = relu.forward(x.copy(), True).copy()
        dr = relu.backward(dy_relu.copy(), True).copy()
        results.append((y, dx, r, dr))
    for numpy_value, compiled_value in zip(*results):
        assert numpy_value.tobytes() == compiled_value.tobytes()


def test_pools_keep_numpy_where_windows_overlap(compiled_layers):
    assert bound(MaxPool2d(2), (6, 6, 2))[0].compiled
    assert not bound(MaxPool2d(3, 2), (7, 7, 2))[0].compiled   # overlapping windows: the NumPy passes
    assert not hasattr(bound(AvgPool2d(2), (6, 6, 2))[0], "compiled")


def _train_step(spec, x, y, dtype=np.float32, params=None):
    model = spec.build(np, dtype=dtype)
    model.init(3)
    if params is not None:
        model.params[...] = params
    loss = model.forward_backward(x.astype(dtype), y, noise=(0, 0, np.arange(len(x))))
    return np.float64(loss), model.grads.copy(), model.evaluate(x.astype(dtype), y)


@functools.cache
def float64_step(name):
    """(spec, images, labels, initial parameters, the float64 step's
    (loss, gradients, evaluation)) of zoo model `name`: computed once for
    both paths below (resnet's float64 step is most of its cost)."""
    spec = MODELS[name]((28, 28), 10)
    rng = np.random.default_rng(4)
    x, y = rng.random((32, 28, 28), dtype=np.float32), rng.integers(0, 10, 32)
    reference = spec.build(np)
    reference.init(3)
    return spec, x, y, reference.params, _train_step(spec, x, y, np.float64, reference.params)


@pytest.mark.parametrize("on", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("name", ["small_cnn", "resnet"])
def test_zoo_models_step_as_in_float64(name, on):
    """A float32 step against the same step in float64 (NumPy's layers, the
    same weights): loss and gradients within 1e-5. Measured, gradients:
    small_cnn 1.8e-7 compiled, 1.5e-7 NumPy; resnet 9.0e-7 compiled, 5.7e-7
    NumPy (1.2e-3 while batch norm's NumPy sums were single float32 GEMVs
    over the whole batch). A ReLU whose input falls within float32's
    rounding of 0 takes the other side of it in one of the two runs, and
    that one flip also moves resnet's gradients by 1e-3: the images here
    (seed 4) have none such on either path; seeds 2, 3 and 5 had one once
    the forward kernel summed in the order (kh, c, kw)."""
    spec, x, y, params, exact = float64_step(name)
    compiled.use(on)
    try:
        assert any(getattr(layer, "direct", False) for layer in spec.build(np).layers) == on
        ours = _train_step(spec, x, y, params=params)
    finally:
        compiled.use(False)
    assert abs(ours[0] - exact[0]) < 1e-5 * abs(exact[0])
    assert np.linalg.norm(ours[1] - exact[1]) < 1e-5 * np.linalg.norm(exact[1])


@pytest.mark.parametrize("name", ["small_cnn", "resnet"])
def test_compiled_layers_give_the_same_bits_on_two_threads(name, compiled_layers):
    """This thread's BLAS held to one thread on both sides, as a worker's is:
    OpenBLAS's own threads (--threads 1 on a multi-core rank) cut a product
    where they like, and on AVX2's row tiles of 12 that gives other bits."""
    shape = (28, 28)
    rng = np.random.default_rng(2)
    x, y = rng.random((32, *shape), dtype=np.float32), rng.integers(0, 10, 32)
    results = []
    hold = threads._blas_local_threads()
    hold(1)
    try:
        for count in (1, 2):
            assert threads.configure(count) == count
            results.append(_train_step(MODELS[name](shape, 10), x, y))
    finally:
        hold(0)
        threads.configure(1)
    assert results[0][0] == results[1][0] and results[0][1].tobytes() == results[1][1].tobytes()


def test_only_fitting_layers_run_direct(compiled_layers):
    assert compiled.fits(16) and compiled.fits(32) and not compiled.fits(10) and not compiled.fits(128)
    assert compiled.fits(64) == (compiled.isa() == "avx512")   # 64 channels: im2col under AVX2
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
    from hpctrain.base.errors import HpctrainError
    from hpctrain.run.startup import COMPILED_FROM, compiled_layers

    def flag(value):
        return SimpleNamespace(compiled_layers=value)
    assert compiled_layers(flag("auto"), np, COMPILED_FROM) is True
    assert compiled_layers(flag("auto"), np, COMPILED_FROM - 1) is False
    assert compiled_layers(flag("off"), np, 10 ** 6) is False
    assert compiled_layers(flag("on"), np, 1) is True
    assert compiled_layers(flag("auto"), object(), 10 ** 6) is False   # not NumPy: CuPy's own kernels
    with pytest.raises(HpctrainError, match="--compiled-layers on: the compiled layers are the CPU's"):
        compiled_layers(flag("on"), object(), 1)


def _layers(layers, contexts):
    """(layer, its context) of every layer, a Residual's inner ones too (its
    context's inner: the block's chain, then the projection's)."""
    for layer, ctx in zip(layers, contexts):
        yield layer, ctx
        if isinstance(layer, Residual):
            yield from _layers(layer.block + layer.projection, ctx.inner[0].inner + ctx.inner[1].inner)


def test_the_memory_check_counts_what_compiled_layers_hold(compiled_layers):
    """Every buffer a compiled layer keeps after a training step (padded
    input, padded dy, batch norm's output and input gradient, ...) is within what the memory
    check counts for it (train_floats per sample; nn/spec.py memory_bytes)."""
    spec = MODELS["resnet"]((28, 28), 10)
    model = spec.build(np)
    model.init(0)
    rng = np.random.default_rng(5)
    n = 16
    model.forward_backward(rng.random((n, 28, 28), dtype=np.float32), rng.integers(0, 10, n),
                           noise=(0, 0, np.arange(n)))
    checked = 0
    for layer, ctx in _layers(model.layers, model.ctx.inner):
        if isinstance(layer, (Conv2d, BatchNorm2d)):
            held = ctx.held_bytes()
            assert 0 < held <= 4 * (n * layer.train_floats() + layer.scratch_floats()), layer.describe()
            checked += 1
    assert checked == 18   # resnet's 9 convolutions and 9 batch norms


def test_auto_takes_compiled_layers_only_where_every_rank_has_numba(tmp_path):
    """Rank 1 without numba, the chief with it: auto runs NumPy's layers on
    both (one rank's compiled layers would round differently)."""
    import subprocess
    import sys
    from conftest import MPIRUN, OPEN_MPI, REPO, child_env, under_mpirun
    if under_mpirun() or OPEN_MPI:
        pytest.skip("its own MPICH job, one rank's environment of its own (hydra's -env)")
    hidden = tmp_path / "numba"
    hidden.mkdir()
    (hidden / "__init__.py").write_text("raise ImportError('No module named numba')\n")
    run = [sys.executable, "-m", "hpctrain.mnist", "--model", "small_cnn", "--steps", "200", "--batch-size", "4",
           "--log-every", "200", "--threads", "1"]
    r = subprocess.run([MPIRUN, "-n", "1", *run, ":", "-n", "1", "-env", "PYTHONPATH", str(tmp_path), *run],
                       capture_output=True, text=True, timeout=240, env=child_env(), cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "layers: NumPy" in r.stdout, r.stdout


VECTORS_SCRIPT = """
import os, sys
import numpy as np
from hpctrain.base import vector_width
if sys.argv[1] == "512":
    note = vector_width.configure(os.environ)
else:   # LLVM's own choice: the CPU's features as they are (hpctrain then leaves the variable alone)
    import llvmlite.binding as llvm
    os.environ["NUMBA_CPU_FEATURES"], note = llvm.get_host_cpu_features().flatten(), ""
from hpctrain.nn import compiled
rng = np.random.default_rng(3)
x = rng.standard_normal((4, 10, 11, 16), dtype=np.float32)   # padded input
w = rng.standard_normal((3, 3, 16, 32), dtype=np.float32)
dy = rng.standard_normal((4, 8, 9, 32), dtype=np.float32)
y, dw = np.empty_like(dy), np.empty_like(w)
forward = compiled._forward_kernel(32, 3, 1, np.float32, 9)
gradient = compiled._kernel("weight_gradient", compiled._make_weight_gradient, (32, 3, 1, 16), np.float32)
forward(x, w, y)
gradient(x, dy, dw)
np.save(sys.argv[2], np.concatenate([y.ravel(), dw.ravel()]))
asm = "".join(forward.inspect_asm().values()) + "".join(gradient.inspect_asm().values())
print(note or "-", asm.count("zmm"))
"""


def test_512_bit_vectors_on_avx512_cpus_give_the_same_bits(tmp_path):
    """hpctrain/base/vector_width.py: on an AVX-512 CPU the kernels compile to 512-bit
    registers (LLVM's tuning for Intel's asks for 256), with the bits of
    LLVM's own choice; elsewhere nothing is set."""
    import os
    import subprocess
    import sys
    from hpctrain.base import vector_width
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CPU_FEATURES"}
    mine = dict(env, NUMBA_CPU_FEATURES="+avx2")
    assert vector_width.configure(mine) == "" and mine["NUMBA_CPU_FEATURES"] == "+avx2"   # the user's, kept
    probe = dict(env)
    note = vector_width.configure(probe)
    if not note:
        assert "NUMBA_CPU_FEATURES" not in probe
        pytest.skip("no AVX-512 on this CPU: numba's defaults")
    assert probe["NUMBA_CPU_FEATURES"].endswith(",-prefer-256-bit") and "+avx512f" in probe["NUMBA_CPU_FEATURES"]
    runs = {}
    for width in ("default", "512"):
        run_env = dict(env, NUMBA_CACHE_DIR=str(tmp_path / f"cache-{width}"))   # compiled afresh: its code inspected
        r = subprocess.run([sys.executable, "-c", VECTORS_SCRIPT, width, str(tmp_path / f"{width}.npy")],
                           capture_output=True, text=True, env=run_env, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[width] = r.stdout.split()[-1]
    assert int(runs["512"]) > 0, runs   # 512-bit registers in the kernels
    assert np.array_equal(np.load(tmp_path / "default.npy"), np.load(tmp_path / "512.npy"))


@pytest.mark.parametrize("dtype, ulps", [(np.float32, 4), (np.float64, 64)])
def test_gelus_compiled_passes_match_numpys(dtype, ulps):
    """GELU's one-pass kernels (nn/passes.py: on float32 the fit in float32
    lanes, on float64 Cody's erfc an element at a time) against the NumPy
    path (Cody's ratios in the dtype), forward
    and input gradient, both tails included, within a few units of the
    last place of what each sums (or 1e-30 where a value underflows); and
    a gradient that the finite differences accept."""
    from hpctrain.nn import compiled
    from hpctrain.nn.gelu import GELU
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal((6, 50)) * 3, np.linspace(-12, 12, 300).reshape(6, 50)], 1)
    x, dy = x.astype(dtype), rng.standard_normal(x.shape).astype(dtype)
    out = {}
    for on in (False, True):
        compiled.use(on)
        try:
            slot, _, _ = bound(GELU(), x.shape[1:], dtype=dtype)
        finally:
            compiled.use(False)
        assert slot.layer.compiled == on
        out[on] = (slot.forward(x.copy(), True).copy(), slot.backward(dy.copy(), True).copy())
    # the scale of what each sums: x Phi's |x|; dy (Phi + x phi)'s |dy| (1 + |x|), whose terms cancel
    # near x = -0.75, where the gradient crosses 0
    scales = (np.abs(x), np.abs(dy) * (1 + np.abs(x)))
    for numpy_path, kernel, scale in zip(out[False], out[True], scales):
        error = np.abs(kernel - numpy_path)
        assert (error <= ulps * np.finfo(dtype).eps * scale + 1e-30).all(), (error / scale).max()
    compiled.use(True)
    try:
        check_gradients(GELU(), (7,))
    finally:
        compiled.use(False)


@pytest.mark.parametrize("dtype, tol", [(np.float32, 2e-6), (np.float64, 1e-13)])
def test_attentions_compiled_softmax_matches_numpys(dtype, tol):
    """CausalSelfAttention with the compiled softmax (one pass a row over the
    unmasked part, nn/passes.py) against NumPy's masked passes: output and
    every gradient within rounding; finite differences through it."""
    from hpctrain.nn import compiled
    from hpctrain.nn.attention import CausalSelfAttention
    rng = np.random.default_rng(3)
    x, dy = (rng.standard_normal((3, 7, 8)).astype(dtype) for _ in range(2))
    out = {}
    for on in (False, True):
        compiled.use(on)
        try:
            slot, _, grads = bound(CausalSelfAttention(2), (7, 8), dtype=dtype, seed=5)
        finally:
            compiled.use(False)
        assert slot.layer.compiled == on
        y = slot.forward(x.copy(), True).copy()
        out[on] = (y, slot.backward(dy.copy(), True).copy(), grads.copy())
    for numpy_path, kernel in zip(out[False], out[True]):
        assert np.abs(kernel - numpy_path).max() <= tol * max(1.0, np.abs(numpy_path).max())
    compiled.use(True)
    try:
        check_gradients(CausalSelfAttention(2), (5, 4))
    finally:
        compiled.use(False)


@pytest.mark.parametrize("dtype, tol", [(np.float32, 2e-6), (np.float64, 1e-13)])
def test_layer_norms_compiled_passes_match_numpys(dtype, tol):
    """LayerNorm's compiled passes (a row's float64 statistics, nn/passes.py)
    against NumPy's, on rows far from mean 0 too: output, input gradient and
    gamma/beta's gradients within rounding; finite differences through it."""
    from hpctrain.nn import compiled
    from hpctrain.nn.norm import LayerNorm
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((5, 6, 12)) * 3 + 2).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    out = {}
    for on in (False, True):
        compiled.use(on)
        try:
            slot, params, grads = bound(LayerNorm(), (6, 12), dtype=dtype)
        finally:
            compiled.use(False)
        assert slot.layer.compiled == on
        params[...] = rng.standard_normal(params.size) if not on else out[False][3]
        y = slot.forward(x.copy(), True).copy()
        out[on] = (y, slot.backward(dy.copy(), True).copy(), grads.copy(), params.copy())
    for numpy_path, kernel in zip(out[False][:3], out[True][:3]):
        assert np.abs(kernel - numpy_path).max() <= tol * max(1.0, np.abs(numpy_path).max())
    compiled.use(True)
    try:
        check_gradients(LayerNorm(), (3, 5))
    finally:
        compiled.use(False)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_embeddings_compiled_gradient_has_numpys_bits(dtype):
    """The embedding's gradient by the compiled loop (nn/passes.py add_rows)
    against np.add.at: the same adds in the same order, so the same bits,
    with ids repeated many times and gradients of -0.0 among them."""
    from hpctrain.nn import compiled
    from hpctrain.nn.embedding import Embedding
    rng = np.random.default_rng(6)
    x = rng.integers(0, 7, (9, 40))
    dy = rng.standard_normal((9, 40, 5)).astype(dtype)
    dy[rng.random(dy.shape) < 0.2] = -0.0
    out = {}
    for on in (False, True):
        compiled.use(on)
        try:
            slot, _, grads = bound(Embedding(7, 5), (40,), dtype=dtype)
        finally:
            compiled.use(False)
        assert slot.layer.compiled == on
        slot.forward(x.copy(), True)
        slot.backward(dy.copy(), False)
        out[on] = grads.copy()
    assert out[True].tobytes() == out[False].tobytes()
    assert np.abs(out[True]).max() > 0



@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelus_half_square_has_numpys_bits(dtype):
    """GELU's -x^2 / 2 before NumPy's exp (nn/passes.py half_square) against
    NumPy's two multiplies it replaced: x x rounded to the dtype, then
    halved: the same bits, subnormal squares, overflow, -0.0 and NaN among them."""
    from hpctrain.nn import passes
    info = np.finfo(dtype)
    x = np.random.default_rng(9).standard_normal(500).astype(dtype) * dtype(4)
    x[:8] = [0.0, -0.0, np.nan, np.inf, -np.inf, info.max, info.tiny, np.sqrt(info.tiny) * dtype(1.3)]
    x[8:40] = np.sqrt(info.tiny) * np.linspace(0.5, 1.5, 32).astype(dtype)   # squares near the subnormals
    out = np.empty_like(x)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        expected = np.multiply(x, x)
        expected *= dtype(-0.5)
        passes.half_square(x, out)
    assert out.tobytes() == expected.tobytes()


def _bits_of_numpys_exp_everywhere():
    """float32 inputs for exp32's test: every 251st bit pattern of all 2^32
    (every sign, exponent and some of each's mantissas: 17 M values) and
    nn/exp32.py's own check sample (the ties where k is decided)."""
    from hpctrain.nn import exp32
    patterns = np.arange(0, 2 ** 32, 251, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([patterns.view(np.float32), exp32.sample()])


@pytest.mark.parametrize("fastmath", [False, {"contract"}, {"reassoc"}])
def test_exp32_has_numpys_exp_bits_inside_any_kernel(fastmath):
    """nn/exp32.py's intrinsic, inside a kernel compiled with each of the
    fast-math settings the compiled layers use, against np.exp: the same
    bits (NaN's too), subnormal results, overflow and underflow included.
    (All 2^32 inputs agreed when checked by hand; this is a 1-in-251 sample
    and every tie.) Where this NumPy's exp rounds otherwise, `matches` says
    so and the layers keep NumPy's pass: the test is skipped there."""
    from hpctrain.base import vector_width
    from hpctrain.nn import exp32
    if not exp32.matches():
        pytest.skip("this NumPy's float32 exp is not the AVX2/AVX-512 algorithm nn/exp32.py reproduces")
    numba = vector_width.load()
    exp = exp32.make()

    @numba.njit(numba.void(numba.float32[::1], numba.float32[::1]), fastmath=fastmath)
    def each(x, out):
        for i in range(x.shape[0]):
            out[i] = exp(x[i])
    x = _bits_of_numpys_exp_everywhere()
    ours = np.empty_like(x)
    each(x, ours)
    with np.errstate(all="ignore"):
        theirs = np.exp(x)
    differ = np.flatnonzero(ours.view(np.uint32) != theirs.view(np.uint32))
    assert differ.size == 0, (differ.size, x[differ[:5]], ours[differ[:5]], theirs[differ[:5]])
    subnormal = (theirs > 0) & (theirs < np.finfo(np.float32).tiny)
    assert (theirs == 0).any() and np.isinf(theirs).any() and subnormal.any()


def test_gelus_one_pass_forward_has_the_three_passes_bits():
    """GELU's float32 forward in one pass (its exp inside, nn/exp32.py)
    against half_square, NumPy's exp and the kernel after it: y, Phi and
    the density bit for bit (a NaN a NaN), over a sample of every float32
    pattern and the values a layer meets."""
    from hpctrain.nn import exp32
    if not exp32.matches():
        pytest.skip("this NumPy's float32 exp is not the algorithm nn/exp32.py reproduces: one pass is not used")
    passes.prepare(("gelu_forward", "half_square"))
    assert passes.exp_whole(np.float32)
    x = np.concatenate([_bits_of_numpys_exp_everywhere(),
                        np.random.default_rng(10).standard_normal(100_000).astype(np.float32) * 3])
    three, one = [tuple(np.empty_like(x) for _ in range(3)) for _ in range(2)]
    with np.errstate(all="ignore"):
        passes.half_square(x, three[2])
        np.exp(three[2], out=three[2])
        passes.gelu_forward(x, *three)
        passes.gelu_forward_whole(x, *one)
    for a, b in zip(three, one):   # a NaN's payload (the input NaN's, or NumPy's exp's) may differ
        differ = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
        assert np.isnan(a[differ]).all() and np.isnan(b[differ]).all(), (x[differ[:5]], a[differ[:5]], b[differ[:5]])


def test_causal_softmax_in_one_pass_has_the_three_passes_bits():
    """The causal softmax in one pass a row (nn/passes.py: the max in four
    chains, NumPy's exp inside, the float64 sum) against the shift, NumPy's
    exp over the array and the normalising, for rows of many lengths and
    scales (the masked part 0 in both): the same bits."""
    from hpctrain.nn import exp32
    if not exp32.matches():
        pytest.skip("this NumPy's float32 exp is not the algorithm nn/exp32.py reproduces: one pass is not used")
    passes.prepare(("causal_softmax",))
    kernel = passes._plain("causal_softmax", np.float32)
    rng = np.random.default_rng(11)
    for t in (1, 3, 4, 5, 15, 16, 17, 64, 100):
        att = (rng.standard_normal((6, t, t)) * rng.choice([0.1, 1.0, 30.0], (6, 1, 1))).astype(np.float32)
        att[0, :, :2] = 0.0   # zeros, +0 and -0 among the maxima
        att[0, :, 2:3] = -0.0
        three, one = att.copy(), att.copy()
        with np.errstate(all="ignore"):
            kernel(three, 0.125, passes.SHIFT)
            np.exp(three, out=three)
            kernel(three, 0.125, passes.NORMALISE)
        passes.causal_softmax(one, 0.125)
        assert one.tobytes() == three.tobytes(), t
        assert (one[:, np.triu_indices(t, 1)[0], np.triu_indices(t, 1)[1]] == 0).all()


def test_layer_norms_backward_sums_in_its_pass_have_numpys_bits():
    """LayerNorm's compiled backward with gamma's and beta's gradients in
    the same pass (one compute thread) against the pass and NumPy's column
    sums after it: the same bits, rows of many widths and scales, -0.0
    among the first row's gradients."""
    rng = np.random.default_rng(12)
    passes.prepare(("layer_norm_backward",))
    for m, c in ((1, 2), (3, 5), (7, 16), (64, 128), (300, 384)):
        dy = (rng.standard_normal((m, c)) * rng.choice([1e-3, 1.0, 1e3], (m, 1))).astype(np.float32)
        dy[0, :2] = dy[:, -1] = -0.0   # a column of -0.0: NumPy's sum starts at +0
        gamma, xhat = rng.standard_normal(c).astype(np.float32), rng.standard_normal((m, c)).astype(np.float32)
        rstd = rng.random(m).astype(np.float32) + 0.5
        dx, dx_fused, sums = np.empty_like(dy), np.empty_like(dy), np.empty((2, c), np.float32)
        passes.layer_norm_backward(dy, gamma, xhat, rstd, dx)
        passes.layer_norm_backward(dy, gamma, xhat, rstd, dx_fused, sums)
        expected = np.empty_like(xhat)
        np.multiply(dy, xhat, out=expected)
        assert dx_fused.tobytes() == dx.tobytes()
        assert sums[0].tobytes() == expected.sum(axis=0).tobytes() and sums[1].tobytes() == dy.sum(axis=0).tobytes()
