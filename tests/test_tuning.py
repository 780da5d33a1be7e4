"""hpctrain/base/tuning.py, the compiled kernels' CPU table: every row forced in
a process of its own (numba told the CPU's name and features, as
NUMBA_CPU_NAME=haswell forces AVX2), this CPU's own row checked in the test's
process (its kernels in numba's disk cache after the first run, and shared
with the other tests' in the serial pass), and its kernels checked against the
plain float64 loops of tests/test_layers.py; each compiled kernel in
float32 within a stated bound of the exact sums; and the tuning key that
ranks and checkpoints compare.

The float32 bound. Every output of a kernel is a sum of K products, each
added in float32 (a fused multiply-add: one rounding a term), in an order
of the kernel's own. Whatever the order, recursive summation in a
precision with unit roundoff u is within gamma_K * sum |terms| of the exact
sum (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed.,
(3.4) and 4.2), gamma_K = K u / (1 - K u), u = 2**-24. The reference sums
the same float32 inputs in float64 (products exact, its own error within
gamma_K in u = 2**-53 of sum |terms|, added to the bound). K: the window
k*k*C of the forward pass, the n*oh*ow pixels of the weight gradient, and
at most k*k*O terms of the input gradient. A worst case, so no seed can
fail it; a wrong or missing term of a typical size is tens of times over
it (at 64 channels, 3x3: gamma_K * sum|terms| is about 0.02 of one term).

    .venv/bin/python -m pytest -q tests/test_tuning.py
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from hpctrain.base import tuning
from test_layers import bound, direct_conv, direct_conv_grads

TESTS = os.path.dirname(os.path.abspath(__file__))
SSE = "+64bit,+sse,+sse2,+sse3,+ssse3,+sse4.1,+sse4.2,+popcnt,+cx16"
AVX2 = SSE + ",+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+lzcnt,+movbe"
NO_AVX512 = ",-avx512f,-avx512bw,-avx512dq,-avx512vl,-avx512cd"
AVX512 = AVX2 + ",+avx512f,+avx512bw,+avx512dq,+avx512vl,+avx512cd"
# (isa, vendor) of each row -> the CPU numba is told it compiles for
FORCED = {("avx512", "intel"): ("skylake-avx512", AVX512 + ",-prefer-256-bit"),
          ("avx512", "*"): ("znver3", AVX512 + ",-prefer-256-bit"),   # Zen 4's features under a name LLVM 14 knows
          ("avx2", "*"): ("haswell", AVX2 + NO_AVX512),
          (None, "*"): ("x86-64", SSE + ",-avx,-avx2,-fma" + NO_AVX512)}


def gamma(k, u):
    return k * u / (1 - k * u)


def within_bound(got, exact, size, terms):
    """|got - exact| <= (gamma_K(2**-24) + gamma_K(2**-53)) * sum|terms|, elementwise."""
    limit = (gamma(terms, 2.0 ** -24) + gamma(terms, 2.0 ** -53)) * size
    excess = np.abs(got.astype(np.float64) - exact) - limit
    assert excess.max() <= 0, f"{excess.argmax()} over the float32 bound by {excess.max():g}"
    return np.abs(got - exact).max() / max(limit.max(), 1e-300)


def check_float32_kernels(out, k, s, p, shape, n=3):
    """A bound float32 Conv2d running the compiled kernels (forward, weight
    gradient, input gradient) within the bound above of the float64 sums of
    the same float32 values. Returns the worst error as a fraction of the bound."""
    from hpctrain.nn import Conv2d
    layer, _, _ = bound(Conv2d(out, k, stride=s, padding=p, bias=False), shape, dtype=np.float32)
    assert layer.direct
    rng = np.random.default_rng(11)
    x = rng.standard_normal((n, *shape)).astype(np.float32)
    W = layer.params["W"]
    y = layer.forward(x, True)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx = layer.backward(dy, True)
    x64, W64, dy64, zero = x.astype(np.float64), W.astype(np.float64), dy.astype(np.float64), np.zeros(out)
    exact, size = direct_conv(x64, W64, zero, s, p), direct_conv(abs(x64), abs(W64), zero, s, p)
    (want_dx, want_dW, _), (size_dx, size_dW, _) = (direct_conv_grads(x64, W64, dy64, s, p),
                                                    direct_conv_grads(abs(x64), abs(W64), abs(dy64), s, p))
    oh, ow = y.shape[1:3]
    return max(within_bound(y, exact, size, k * k * shape[2]),
               within_bound(layer.grads["W"], want_dW, size_dW, n * oh * ow),
               within_bound(dx, want_dx, size_dx, k * k * out))


def shapes_for(row):
    """Layers that take each path of the row's kernels: per output channel
    count, rows of 11 (Intel's 6 + 6, others' blocks and a tail), stride 2
    (the gathered input gradient), one input channel (its weight gradient
    in blocks of kernel offsets); (out, k, stride, padding, (h, w, c))."""
    shapes = []
    for out in sorted(row.pixels):
        shapes += [(out, 3, 1, 1, (4, 11, 16)), (out, 3, 2, 1, (7, 10, 16))]
    return shapes + [(min(row.pixels), 3, 1, 1, (5, 7, 1))] if row.pixels else []


def check_row(isa, vendor):
    """The row (isa, vendor) taken by this process's numba, its layers direct
    exactly where it fits, every path of shapes_for equal to the float64
    loops and within the float32 bound: the row's key."""
    from test_layers import check_against_loops
    from hpctrain.nn import Conv2d, compiled, passes
    row = compiled.tuning()
    assert (row.isa, row.vendor) == (isa, vendor), (row, compiled._cpu())
    compiled.use(True)
    try:
        for out in (16, 32, 64, 128):   # (shapes_for's first shape: its kernels, bound here, compiled once)
            assert bound(Conv2d(out, 3, padding=1), (4, 11, 16))[0].direct == row.fits(out), out
        for out, k, s, p, shape in shapes_for(row):
            layer, _, _ = bound(Conv2d(out, k, stride=s, padding=p), shape)
            check_against_loops(layer, shape, s, p)
            print(out, k, s, p, shape, "float32 error / bound %.3g" % check_float32_kernels(out, k, s, p, shape))
        x = np.random.default_rng(3).standard_normal((300, 16)).astype(np.float32)
        plain = np.empty((2, 16))
        passes._plain("bn_statistics", np.float32)(x, plain)
        assert passes.bn_statistics(x).tobytes() == plain.tobytes()   # batch norm's sums, made for 16 channels
        return compiled.tuning_key()
    finally:
        compiled.use(False)


ROW_SCRIPT = """
import sys
from test_tuning import check_row
print("row ok", check_row(sys.argv[1] if sys.argv[1] != "None" else None, sys.argv[2]))
"""


def avx512_here():
    import llvmlite.binding as llvm
    return "+avx512f" in llvm.get_host_cpu_features().flatten().split(",")


def test_every_row_is_forced_by_a_test():
    assert set(FORCED) == {(row.isa, row.vendor) for row in tuning.ROWS}


def where_forced(key):
    """How row `key` is checked here: "skip: why", "here" (this CPU's own
    row, in this process) or "process" (a process whose numba is told the
    row's CPU)."""
    if key[0] == "avx512" and not avx512_here():
        return "skip: this CPU has no AVX-512: code compiled for that row would not run here"
    from hpctrain.nn import compiled
    here = compiled.tuning()
    if (here.isa, here.vendor) == key and "NUMBA_CPU_NAME" not in os.environ:
        # this CPU's own row: numba compiles for it as it is, in this process
        # (the kernels of this file's other float32 checks shared, no numba
        # started and compiling afresh for a CPU named by hand)
        return "here"
    return "process"


@pytest.fixture(scope="module")
def forced_rows(forced_cpu_cache):
    """{key: its process} for every row checked in a process of its own,
    all started at once: numba compiles on one thread, and each compiles
    for a CPU of its own (nothing shared between them), so on a machine of
    several cores they compile side by side (and beside this process's own
    row) instead of one after another."""
    pytest.importorskip("numba")
    started = {}
    for key in FORCED:
        if where_forced(key) == "process":
            name, features = FORCED[key]
            env = dict(os.environ, NUMBA_CPU_NAME=name, NUMBA_CPU_FEATURES=features, NUMBA_CACHE_DIR=forced_cpu_cache,
                       PYTHONPATH=os.pathsep.join([TESTS, os.path.dirname(TESTS)]))
            started[key] = subprocess.Popen([sys.executable, "-c", ROW_SCRIPT, str(key[0]), key[1]], env=env,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield started
    for proc in started.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.parametrize("key", list(FORCED), ids=lambda key: f"{key[0]}-{key[1]}")
def test_each_row_forced_computes_the_plain_loops_sums(key, forced_rows):
    """numba told it compiles for the row's CPU: that row taken, its
    layers direct exactly where it fits, every path equal to the float64
    loops and within the float32 bound."""
    where = where_forced(key)
    if where.startswith("skip: "):
        pytest.skip(where[len("skip: "):])
    if where == "here":
        check_row(*key)
        return
    out, err = forced_rows[key].communicate(timeout=600)
    assert forced_rows[key].returncode == 0 and "row ok" in out, out[-2000:] + err[-3000:]


@pytest.mark.parametrize("out, k, s, p, shape", [
    (16, 3, 1, 1, (5, 11, 16)),    # forward and the turned input gradient, blocks and a tail
    (32, 3, 2, 1, (9, 10, 16)),    # the gathered input gradient
    (16, 5, 1, 2, (6, 6, 1)),      # one input channel: the weight gradient in blocks of offsets
    (16, 3, 3, 1, (11, 13, 32)),   # stride 3
])
def test_float32_kernels_stay_within_the_stated_bound(out, k, s, p, shape):
    """This CPU's row, float32 (what training compiles) against the exact sums."""
    pytest.importorskip("numba")
    from hpctrain.nn import compiled
    if not compiled.fits(out):
        pytest.skip(f"no direct kernels for {out} channels on this CPU")
    compiled.use(True)
    try:
        assert check_float32_kernels(out, k, s, p, shape) <= 1
    finally:
        compiled.use(False)


def test_rows_fit_the_stack_and_are_found_by_isa_and_vendor():
    for row in tuning.ROWS:
        for out in row.pixels:   # the forward kernel's, the weight gradient's and the gathered input gradient's blocks
            held = [max(row.forward_pixels or (0,)) * row.forward_blocks(out, 100)[1],
                    row.pixels[out] * out, row.channels[out] * out]
            assert max(held) <= tuning.STACK_ITEMS, (row, out)
    assert tuning.tuning_for("avx512", "intel").reuse and not tuning.tuning_for("avx512", "amd").reuse
    assert tuning.tuning_for("avx2", "intel") is tuning.tuning_for("avx2", "amd")
    assert tuning.tuning_for(None, "intel").key == "no direct convolutions"
    assert [tuning.vendor_of(n) for n in ("znver4", "amdfam10", "generic", "sapphirerapids")] == \
        ["amd", "amd", "generic", "intel"]
    assert len({row.key for row in tuning.ROWS}) == len(tuning.ROWS)   # each row its own bits


def test_intel_rows_forward_blocks_cut_rows_with_the_fewest_pixels():
    intel = tuning.tuning_for("avx512", "intel")
    assert intel.forward_blocks(64, 14) == (7, 32, False) and intel.forward_blocks(64, 11) == (6, 32, False)
    assert tuning.tuning_for("avx512", "amd").forward_blocks(64, 11) == (3, 64, True)


# --- start-up and checkpoints agree on the key ------------------------------------------

def _mixed_job(cache, *flags):
    """Two ranks, rank 1's numba told it compiles for a CPU without AVX2
    (hpctrain/base/tuning.py's row for neither: another key than this CPU's)."""
    from conftest import MPIRUN, OPEN_MPI, REPO, child_env, under_mpirun, without_launcher_banners
    if under_mpirun() or OPEN_MPI:
        pytest.skip("its own MPICH job, one rank's environment of its own (hydra's -env)")
    name, features = FORCED[(None, "*")]
    run = [sys.executable, "-m", "hpctrain.mnist", "--model", "small_cnn", "--steps", "2", "--batch-size", "4",
           "--compiled-layers", "on", "--threads", "1", *flags]
    r = subprocess.run([MPIRUN, "-n", "1", *run, ":", "-n", "1", "-env", "NUMBA_CPU_NAME", name,
                        "-env", "NUMBA_CPU_FEATURES", features, "-env", "NUMBA_CACHE_DIR", cache,
                        *run], capture_output=True, text=True, timeout=300, env=child_env(), cwd=REPO)
    r.stderr = without_launcher_banners(r.stderr)
    return r


def test_a_pipeline_on_cpus_that_round_apart_is_refused_in_one_line(forced_cpu_cache):
    pytest.importorskip("numba")
    from hpctrain.nn import compiled
    if compiled.tuning().isa is None:
        pytest.skip("this CPU takes the row for neither AVX2 nor AVX-512: nothing rounds apart")
    r = _mixed_job(forced_cpu_cache, "--pipeline-stages", "2")
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "--pipeline-stages 2 with compiled layers on CPUs whose kernels round apart" in \
        lines[0] and "rank 0 (" in lines[0] and "rank 1 (" in lines[0] and "none/" in lines[0], r.stderr


def test_data_parallel_replicas_on_cpus_that_round_apart_go_on_with_a_note(forced_cpu_cache):
    pytest.importorskip("numba")
    from hpctrain.nn import compiled
    if compiled.tuning().isa is None:
        pytest.skip("this CPU takes the row for neither AVX2 nor AVX-512: nothing rounds apart")
    r = _mixed_job(forced_cpu_cache)
    assert r.returncode == 0, r.stderr
    assert "compiled layers: the ranks' CPUs round apart (rank 0 (" in r.stdout and "replicas stay identical" \
        in r.stdout, r.stdout


def test_the_verdict_names_the_ranks_that_differ():
    from hpctrain.base.errors import HpctrainError
    from hpctrain.run.startup import tuning_verdict
    hosts = ["a", "a", "b", "b"]
    assert tuning_verdict({0: "avx512/amd: k", 1: "avx512/generic: k"}, hosts, 2) is None   # the same bits
    assert tuning_verdict({0: "k", 1: "k", 3: "k"}, hosts, 2) is None   # rank 2 a ps server: not compared
    note = tuning_verdict({0: "k", 1: "k", 2: "j", 3: "j"}, hosts, 1)
    assert note.startswith("compiled layers: the ranks' CPUs round apart (rank 0 (a): k; rank 2 (b): j; rank 3 (b): j)")
    with pytest.raises(HpctrainError, match=r"--pipeline-stages 2 .*\(rank 0 \(a\): k; rank 2 \(b\): j; rank 3"):
        tuning_verdict({0: "k", 1: "k", 2: "j", 3: "j"}, hosts, 2)


def test_a_resume_with_other_rounding_says_so_in_one_warning(job, tmp_path):
    """Checkpoints record how the layers rounded (`tuning`, beside
    init_version); a resume whose layers round otherwise warns, and goes on."""
    import h5py
    from conftest import checkpoint_file
    from hpctrain.checkpoints.file import list_checkpoints
    pytest.importorskip("numba")
    common = ["--model", "small_cnn", "--batch-size", "4", "--threads", "1", "--checkpoint-dir", tmp_path / "c",
              "--checkpoint-every", "2"]
    r = job(1, *common, "--steps", "2", "--compiled-layers", "off")
    assert r.returncode == 0, r.stderr
    with h5py.File(checkpoint_file(list_checkpoints(str(tmp_path / "c"))[0][1]), "r") as f:
        assert f.attrs["tuning"] == "NumPy" and "init_version" in f.attrs
    r = job(1, *common, "--steps", "4", "--compiled-layers", "on")
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "the checkpoint's layers rounded as NumPy, this run's as " in warnings[0] and \
        "bits will differ" in warnings[0], r.stderr
    r = job(1, *common, "--steps", "6", "--compiled-layers", "on")   # the same rounding: nothing said
    assert r.returncode == 0 and "rounded as" not in r.stderr, r.stderr


# --- checks that stay under python -O ----------------------------------------------------

def test_build_refuses_buffers_its_layers_cannot_view():
    from hpctrain.nn import MODELS
    spec = MODELS["small_cnn"]((28, 28), 10)
    with pytest.raises(ValueError, match=r"build.s params must be one contiguous float32 buffer of \d+ elements, "
                                         r"got shape .*, float64"):
        spec.build(np, params=np.zeros(spec.num_params))
    with pytest.raises(ValueError, match="build.s grads .*, not contiguous"):
        spec.build(np, grads=np.zeros(2 * spec.num_params, np.float32)[::2])


def test_the_forward_kernel_refuses_reuse_at_a_stride():
    pytest.importorskip("numba")
    from hpctrain.nn import compiled
    with pytest.raises(ValueError, match="at stride 1 only, not 2"):
        compiled._make_forward(16, 3, 2, 4, 16, False, True, np.float32)
