"""--blas mkl: the layers' 2-D products through Intel MKL (hpctrain/nn/blas.py).
Every layout a layer passes is MKL's product and NumPy's to rounding; what
MKL cannot take is left to NumPy, untouched; a run says which library it
loaded and a resume across libraries is warned of. The bits on any number
of compute threads: tests/test_threads.py.

    python -m pytest -q tests/test_blas.py
"""
import json
import os

import numpy as np
import pytest

from conftest import REPO
from hpctrain.nn import blas

pytestmark = pytest.mark.skipif(not blas.available(), reason="--blas mkl needs MKL (pip install 'hpctrain[mkl]')")


@pytest.fixture
def mkl():
    assert blas.configure("mkl") == "mkl"
    yield blas._gemm
    blas.configure("numpy")


def _operands(rng, dtype, m, k, n, ta, tb):
    """a (m x k) and b (k x n), each a transposed view where asked, both row
    slices of larger arrays (leading dimensions wider than the matrix)."""
    a = rng.standard_normal((k, m + 3) if ta else (m + 2, k + 5)).astype(dtype)
    b = rng.standard_normal((n + 1, k) if tb else (k, n + 4)).astype(dtype)
    a = a[:, 1:m + 1].T if ta else a[1:m + 1, 2:k + 2]
    b = b[1:n + 1].T if tb else b[:, :n]
    return a, b


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_mkl_computes_every_layout_the_layers_pass(mkl, dtype, ta, tb):
    rng = np.random.default_rng(0)
    a, b = _operands(rng, dtype, 37, 130, 21, ta, tb)
    out = np.full((40, 21), np.nan, dtype)[2:39]      # a row slice: rows apart as a wider array's
    assert mkl(a, b, out), "MKL declined operands it should take"
    exact = np.matmul(a.astype(np.float64), b.astype(np.float64))   # sums of 130 terms near 30: rounding's
    np.testing.assert_allclose(out, exact, rtol=0, atol=1e-4 if dtype == np.float32 else 1e-11)


def test_what_mkl_cannot_take_is_left_to_numpy(mkl):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((8, 12)).astype(np.float32)
    b = rng.standard_normal((12, 6)).astype(np.float32)
    declined = {
        "a column step": (a[:, ::2], b[:6], np.empty((8, 6), np.float32)),
        "a transposed out": (a, b, np.empty((6, 8), np.float32).T),
        "mixed dtypes": (a, b.astype(np.float64), np.empty((8, 6), np.float32)),
        "integers": (a.astype(np.int32), b.astype(np.int32), np.empty((8, 6), np.int32)),
        "a vector": (a, b[:, 0], np.empty(8, np.float32)),
        "out over an operand": (a[:, :8], np.eye(8, dtype=np.float32), a[:, :8]),
    }
    for what, (x, y, out) in declined.items():
        before = out.copy()
        assert not mkl(x, y, out), what
        assert np.array_equal(out, before, equal_nan=True), what
        blas.matmul(np, x, y, out)                 # NumPy's then
        assert np.array_equal(out, np.matmul(x, y).astype(out.dtype)), what


def test_a_run_names_the_library_and_a_resume_across_libraries_is_warned(job, tmp_path, capsys):
    """...and `hpctrain evaluate --blas mkl` scores the saved model as the run's final evaluation did."""
    from hpctrain import evaluate
    from hpctrain.nn import threads
    common = ["--steps", "6", "--batch-size", "16", "--log-every", "3", "--checkpoint-dir", tmp_path / "ck",
              "--checkpoint-every", "3"]
    first = job(1, *common[:1], "3", *common[2:])
    assert first.returncode == 0, first.stderr
    assert "matrix products" not in first.stdout
    r = job(1, *common, "--blas", "mkl", "--metrics", tmp_path / "m.jsonl", "--save", tmp_path / "m.h5")
    assert r.returncode == 0, r.stderr
    assert "matrix products: Intel(R) oneAPI Math Kernel Library Version" in r.stdout, r.stdout
    assert "this run's as NumPy, MKL's products" in r.stderr, r.stderr
    with open(tmp_path / "m.jsonl") as f:
        final = [json.loads(line) for line in f][-1]
    assert final["config"]["blas"] == "mkl" and final["steps"] == 6
    assert final["sgemm_gflops"] > 0   # the MFU's SGEMM measured through MKL too
    try:
        assert evaluate.main(["--params", str(tmp_path / "m.h5"), "--data", os.path.join(REPO, "data", "mnist"),
                              "--blas", "mkl", "--json"]) in (0, None)
        assert blas.name() == "mkl"
    finally:
        blas.configure("numpy")
        threads.configure(1)
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert scored["loss"] == final["test_loss"], (scored, final)
