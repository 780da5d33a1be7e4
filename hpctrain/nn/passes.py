"""One-pass layer kernels compiled by numba, run where compiled layers are
on (nn/compiled.py use/on, --compiled-layers): batch norm's statistics,
normalising, gradient sums and input gradient (nn/batchnorm.py), max
pooling with windows k apart (nn/pool.py), ReLU's gradient
(nn/layers.py), LayerNorm's two (nn/norm.py), GELU's two (nn/gelu.py;
the tanh form's forward its own; -x^2 / 2 before the forward's exp),
attention's causal softmax, forward and backward, over each row's
unmasked part only (nn/attention.py), and an embedding's gradient
(nn/embedding.py). Plain loops, no fastmath: each element gets the NumPy
path's float operations (batch norm's sums in float64; the embedding's
adds in np.add.at's order: the same bits), except:
- the row sums of LayerNorm and the softmax (float64, in vector lanes:
  "reassoc", _ROW_SUMS), and the softmax's exp (NumPy's, in the dtype:
  on float32 inside the one pass a row, nn/exp32.py, its bits);
- GELU's forward: on float64 Cody's erfc (nn/erfc.py) one element at a
  time, only the interval the element is in, each result rounded once; on
  float32 a branch-free fit in float32 lanes (nn/gelu_fast.py), from
  NumPy's exp of -x^2 / 2 (on float32 taken inside the same pass,
  nn/exp32.py, its bits); the tanh form's in float64, each result
  rounded once.
Those are within a few units of the last place of the NumPy path, not its
bits (tests/test_compiled.py).

    python -m pytest -q tests/test_compiled.py
"""
import math

import numpy as np

from ..base import vector_width
from ..base.precision import FLOAT32
from ..base.tuning import SUMS_CHANNELS
from . import compiled, exp32, gelu_fast
from .erfc import A, B, C, D, MIDDLE, P, Q, SMALL, SQRPI

_kernels = {}
_stack = None   # nn/compiled.py's stack intrinsic, set before a _SUMS kernel compiles


# ---- batch norm ----------------------------------------------------------------
# NumPy runs per-channel work over an (m, c) array with few channels slowly
# (nn/batchnorm.py: GEMVs for the sums, tiled rows for the passes: 7 passes
# forward, 5 backward). Here: the statistics in two passes (the sum, then
# the centred squares: no cancellation) accumulated in float64, and one
# pass for what is elementwise. Each float32 operation of
# the elementwise passes is NumPy code's, in its order (no fastmath).
# The two sums' kernels are also made per channel count (_make_*, up to
# SUMS_CHANNELS; _sums): the channel loop unrolled, the float64 sums on the
# stack, which LLVM keeps in registers, the same additions in the same
# order (the same bits); measured in hpctrain/base/tuning.py. The plain loop
# keeps its sums in memory: a store and a load per element.

def _bn_statistics(x, out):
    """out[0] = the mean of each column of x (m, c), out[1] = its biased variance (float64)."""
    m, c = x.shape
    total = np.zeros(c)
    for i in range(m):
        for j in range(c):
            total[j] += x[i, j]
    mean = total / m
    squares = np.zeros(c)
    for i in range(m):
        for j in range(c):
            d = x[i, j] - mean[j]
            squares[j] += d * d
    for j in range(c):
        out[0, j] = mean[j]
        out[1, j] = squares[j] / m


def _make_bn_statistics(C):
    """_bn_statistics for C columns, its sums in registers."""
    def bn_statistics(x, out):
        m = x.shape[0]
        total, mean = _stack(np.float64), _stack(np.float64)
        for j in range(C):
            total[j] = 0.0
        for i in range(m):
            for j in range(C):
                total[j] += x[i, j]
        for j in range(C):
            mean[j] = total[j] / m
            total[j] = 0.0
        for i in range(m):
            for j in range(C):
                d = x[i, j] - mean[j]
                total[j] += d * d
        for j in range(C):
            out[0, j] = mean[j]
            out[1, j] = total[j] / m
    return bn_statistics


def _bn_normalise(x, mean, inv_std, gamma, beta, y):
    """y = xhat * gamma + beta, per column, xhat = (x - mean) * inv_std."""
    m, c = x.shape
    for i in range(m):
        for j in range(c):
            h = (x[i, j] - mean[j]) * inv_std[j]
            y[i, j] = h * gamma[j] + beta[j]


def _bn_gradient_sums(dy, x, mean, inv_std, out):
    """out[0] = the sum of each column of dy, out[1] = of dy * xhat (float64),
    xhat = (x - mean) * inv_std in x's dtype (_bn_normalise's)."""
    m, c = dy.shape
    beta = np.zeros(c)
    gamma = np.zeros(c)
    for i in range(m):
        for j in range(c):
            beta[j] += dy[i, j]
            gamma[j] += np.float64(dy[i, j]) * ((x[i, j] - mean[j]) * inv_std[j])
    for j in range(c):
        out[0, j] = beta[j]
        out[1, j] = gamma[j]


def _make_bn_gradient_sums(C):
    """_bn_gradient_sums for C columns, its sums in registers."""
    def bn_gradient_sums(dy, x, mean, inv_std, out):
        m = dy.shape[0]
        beta, gamma = _stack(np.float64), _stack(np.float64)
        for j in range(C):
            beta[j] = 0.0
            gamma[j] = 0.0
        for i in range(m):
            for j in range(C):
                beta[j] += dy[i, j]
                gamma[j] += np.float64(dy[i, j]) * ((x[i, j] - mean[j]) * inv_std[j])
        for j in range(C):
            out[0, j] = beta[j]
            out[1, j] = gamma[j]
    return bn_gradient_sums


def _bn_input_gradient(dy, x, mean, inv_std, a, b, scale, dx):
    """dx = (dy - (xhat * a + b)) * scale, per column, xhat as _bn_normalise's."""
    m, c = dy.shape
    for i in range(m):
        for j in range(c):
            h = (x[i, j] - mean[j]) * inv_std[j]
            dx[i, j] = (dy[i, j] - (h * a[j] + b[j])) * scale[j]


# ---- max pooling and ReLU's gradient --------------------------------------------
# Each the NumPy path's result bit for bit (nn/pool.py MaxPool2d, nn/layers.py
# ReLU), in one pass where NumPy makes several: max pooling's k*k strided
# passes of compare, select and maximum over the output, ReLU's compare and
# multiply.

def _max_pool_forward(x, y, won, k):
    """y = each k x k window's maximum (windows k apart), won = the offset
    kh * k + kw of its first maximum; a NaN wins the value, not the offset
    (np.maximum's and np.greater's, which the NumPy path uses)."""
    n, oh, ow, c = y.shape
    for b in range(n):
        for i in range(oh):
            for j in range(ow):
                for q in range(c):
                    y[b, i, j, q] = x[b, i * k, j * k, q]
                    won[b, i, j, q] = 0
                for kh in range(k):
                    for kw in range(k):
                        if kh + kw > 0:
                            offset = kh * k + kw
                            for q in range(c):
                                v = x[b, i * k + kh, j * k + kw, q]
                                if v > y[b, i, j, q]:
                                    y[b, i, j, q] = v
                                    won[b, i, j, q] = offset
                                elif v != v:
                                    y[b, i, j, q] = v


def _max_pool_backward(dy, won, dx, k):
    """dx at each window's winning offset = dy (dy * 1), elsewhere dy * 0."""
    n, oh, ow, c = dy.shape
    for b in range(n):
        for i in range(oh):
            for kh in range(k):
                for j in range(ow):
                    for kw in range(k):
                        offset = kh * k + kw
                        for q in range(c):
                            hit = 1.0 if won[b, i, j, q] == offset else 0.0
                            dx[b, i * k + kh, j * k + kw, q] = dy[b, i, j, q] * hit


def _relu_backward(y, dy):
    """dy *= (y > 0), in place, on flat arrays."""
    for i in range(y.shape[0]):
        dy[i] = dy[i] * (1.0 if y[i] > 0 else 0.0)


_INV_SQRT2, _INV_SQRT_2PI = gelu_fast.INV_SQRT2, gelu_fast.INV_SQRT_2PI


def _gelu_forward(x, y, cdf, phi):
    """cdf = Phi(x) = erfc(|x| / sqrt 2) / 2 or 1 - that (Cody's erfc,
    nn/erfc.py, its own interval only, in float64), given phi = exp(-x^2 / 2)
    (NumPy's exp, vectorised, in the dtype), which the erfc needs and
    turns into the normal density for the gradient; each rounded once;
    y = x cdf in the dtype (NumPy's multiply); flat arrays."""
    for i in range(x.shape[0]):
        v = float(x[i])
        a = abs(v) * _INV_SQRT2
        gauss = float(phi[i])
        if a <= SMALL:
            t = a * a
            xnum, xden = A[4] * t, t
            for j in range(3):
                xnum = (xnum + A[j]) * t
                xden = (xden + B[j]) * t
            erfc = 1.0 - a * (xnum + A[3]) / (xden + B[3])
        elif a < MIDDLE:
            xnum, xden = C[8] * a, a
            for j in range(7):
                xnum = (xnum + C[j]) * a
                xden = (xden + D[j]) * a
            erfc = (xnum + C[7]) / (xden + D[7]) * gauss
        else:
            inv = 1.0 / (a * a)
            xnum, xden = P[5] * inv, inv
            for j in range(4):
                xnum = (xnum + P[j]) * inv
                xden = (xden + Q[j]) * inv
            erfc = (SQRPI - inv * (xnum + P[4]) / (xden + Q[4])) / a * gauss
        cdf[i] = 0.5 * erfc if v < 0 else 1.0 - 0.5 * erfc
        phi[i] = gauss * _INV_SQRT_2PI
        y[i] = x[i] * cdf[i]


_TANH_K, _TANH_C = math.sqrt(2 / math.pi), 0.044715   # nn/gelu.py TANH_K, TANH_C


def _half_square(x, out):
    """out = -x^2 / 2: x x rounded to the dtype, then halved (exact: NumPy's
    two multiplies' bits, in one pass); flat arrays."""
    for i in range(x.shape[0]):
        square = x[i] * x[i]
        out[i] = square * -0.5


def _gelu_tanh_forward(x, y, cdf, phi):
    """GPT-2's tanh GELU (nn/gelu.py tanh_gate's arithmetic) an element at a
    time in float64, each result rounded once: cdf = S(x), the logistic of
    2u, u = K x (1 + C x^2); phi = S'(x) = 2 u' e / (1 + e)^2, e =
    exp(-2|u|); y = x cdf in the dtype; flat arrays."""
    for i in range(x.shape[0]):
        v = float(x[i])
        s = v * v
        u = v * (_TANH_K + _TANH_K * _TANH_C * s)
        e = math.exp(-2.0 * abs(u))
        d = 1.0 + e
        cdf[i] = (e if u < 0 else 1.0) / d
        phi[i] = (2.0 * _TANH_K + 6.0 * _TANH_K * _TANH_C * s) * e / (d * d)
        y[i] = x[i] * cdf[i]


def _gelu_backward(x, cdf, phi, dy, dx):
    """dx = dy (Phi(x) + x phi(x)) in float64, rounded once; flat arrays."""
    for i in range(x.shape[0]):
        dx[i] = float(dy[i]) * (float(cdf[i]) + float(x[i]) * float(phi[i]))


def _add_rows(ids, rows, out):
    """out[ids[p]] += rows[p] for p in order (an embedding's gradient:
    np.add.at's adds, in its order)."""
    for p in range(ids.shape[0]):
        k = ids[p]
        for j in range(rows.shape[1]):
            out[k, j] += rows[p, j]


def _layer_norm(x, gamma, beta, eps, xhat, rstd, y):
    """Each row of x (m, c): its mean and biased variance in float64 (two
    passes: no cancellation), xhat = (x - mean) / sqrt(var + eps) rounded
    once, y = xhat gamma + beta in the dtype (NumPy's multiply and add)."""
    m, c = x.shape
    for i in range(m):
        total = 0.0
        for j in range(c):
            total += x[i, j]
        mean = total / c
        squares = 0.0
        for j in range(c):
            d = x[i, j] - mean
            squares += d * d
        r = 1.0 / math.sqrt(squares / c + eps)
        rstd[i] = r
        for j in range(c):
            xhat[i, j] = (x[i, j] - mean) * r
            y[i, j] = xhat[i, j] * gamma[j] + beta[j]


def _layer_norm_backward(dy, gamma, xhat, rstd, dx, sums, with_sums):
    """dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy gamma, each row's
    means in float64, rounded once. with_sums (all of the rows in one call,
    on one thread): gamma's and beta's gradients too, into sums[0] and
    sums[1] (the dtype), NumPy's column sums of dy xhat (each product
    rounded to the dtype) and of dy as NumPy adds them: from 0, each row in
    order (the same bits, +0 for a column of -0)."""
    m, c = dy.shape
    if with_sums:
        for j in range(c):
            sums[0, j] = 0.0
            sums[1, j] = 0.0
    for i in range(m):
        m1 = 0.0
        m2 = 0.0
        for j in range(c):
            g = float(dy[i, j]) * float(gamma[j])
            m1 += g
            m2 += g * xhat[i, j]
        m1 /= c
        m2 /= c
        r = float(rstd[i])
        for j in range(c):
            dx[i, j] = r * (float(dy[i, j]) * float(gamma[j]) - m1 - xhat[i, j] * m2)
        if with_sums:
            for j in range(c):
                sums[0, j] += dy[i, j] * xhat[i, j]
                sums[1, j] += dy[i, j]


SHIFT, NORMALISE, WHOLE = 0, 1, 2   # _causal_softmax's stages


def _causal_softmax(att, scale, stage):
    """Each row i of each (t, t) matrix of scores, in place. SHIFT: scale *
    its first i + 1 entries less their maximum (in float64, rounded once),
    -inf beyond (the causal mask), for NumPy's exp; NORMALISE, after that
    exp: the first i + 1 entries over their sum (in float64; beyond them
    exp(-inf) = 0 already); WHOLE: both, with NumPy's exp between them
    taken here (nn/exp32.py, its bits; _exp32), in one pass a row: the
    same operations in the same order, the same bits."""
    for b in range(att.shape[0]):
        for i in range(att.shape[1]):
            if stage != NORMALISE:
                # the row's max in four interleaved chains (a max's latency a step, not a chain of i + 1):
                # the max of float(x) * scale for a scale > 0 in any order, rounding being monotonic (which
                # of +0 and -0 wins changes no x - top after it)
                m0 = m1 = m2 = m3 = att[b, i, 0]
                j = 1
                while j + 4 <= i + 1:
                    m0, m1 = max(m0, att[b, i, j]), max(m1, att[b, i, j + 1])
                    m2, m3 = max(m2, att[b, i, j + 2]), max(m3, att[b, i, j + 3])
                    j += 4
                for j in range(j, i + 1):
                    m0 = max(m0, att[b, i, j])
                top = float(max(max(m0, m1), max(m2, m3))) * scale
                if stage == SHIFT:
                    for j in range(i + 1):
                        att[b, i, j] = float(att[b, i, j]) * scale - top
                    for j in range(i + 1, att.shape[2]):
                        att[b, i, j] = -np.inf
                    continue
                # up to the row's unmasked part rounded up to 16: whole vectors, no scalar tail a row
                n = min(att.shape[2], (i + 16) // 16 * 16)
                for j in range(n):
                    e = _exp32(np.float32(float(att[b, i, j]) * scale - top))
                    att[b, i, j] = e if j <= i else 0.0
                for j in range(n, att.shape[2]):
                    att[b, i, j] = 0.0
            total = 0.0
            for j in range(i + 1):
                total += att[b, i, j]
            inv = 1.0 / total
            for j in range(i + 1):
                att[b, i, j] = float(att[b, i, j]) * inv


def _causal_softmax_backward(att, datt, scale):
    """The softmax's backward in place on datt (its output A's gradient):
    scale * A (dA - sum_j dA A) over each row's first i + 1 entries (the
    sum in float64), 0 beyond."""
    for b in range(att.shape[0]):
        for i in range(att.shape[1]):
            total = 0.0
            for j in range(i + 1):
                total += float(datt[b, i, j]) * float(att[b, i, j])
            for j in range(i + 1):
                datt[b, i, j] = float(att[b, i, j]) * (float(datt[b, i, j]) - total) * scale
            for j in range(i + 1, att.shape[2]):
                datt[b, i, j] = 0.0


# name: (function, its arguments: m an (rows, c) array of the dtype, v a (c,)
# vector, o (2, c) float64, i a 4-D array of the dtype, u 4-D uint8, f a flat
# array of the dtype, k an integer, c a 3-D array of the dtype, d a float64, j int64 ids, b a boolean)
_PLAIN = {"bn_statistics": (_bn_statistics, "mo"), "bn_normalise": (_bn_normalise, "mvvvvm"),
          "bn_gradient_sums": (_bn_gradient_sums, "mmvvo"), "bn_input_gradient": (_bn_input_gradient, "mmvvvvvm"),
          "max_pool_forward": (_max_pool_forward, "iiuk"), "max_pool_backward": (_max_pool_backward, "iuik"),
          "relu_backward": (_relu_backward, "ff"), "gelu_forward": (_gelu_forward, "ffff"),
          "half_square": (_half_square, "ff"),
          "gelu_tanh_forward": (_gelu_tanh_forward, "ffff"),
          "gelu_backward": (_gelu_backward, "fffff"), "causal_softmax": (_causal_softmax, "cdk"),
          "layer_norm": (_layer_norm, "mvvdmfm"), "layer_norm_backward": (_layer_norm_backward, "mvmfmmb"),
          "causal_softmax_backward": (_causal_softmax_backward, "ccd"), "add_rows": (_add_rows, "jmm")}
# Kernels whose float64 sums over a row may be reassociated ("reassoc"
# only): LLVM then sums a row in vector lanes, 3x faster on a GPT's
# (768, 128) LayerNorm; the sums are float64 of float32 values, so the
# order shows in the outputs' float32 bits rarely, within the rounding
# the tests hold these kernels to (tests/test_compiled.py).
_ROW_SUMS = {"layer_norm", "layer_norm_backward", "causal_softmax", "causal_softmax_backward"}
# Kernels that call nn/exp32.py's intrinsic (_exp32, set before they compile), float32 only
_EXP = {"causal_softmax"}
_exp32 = None
_SUMS = {"bn_statistics": (_make_bn_statistics, "mo"), "bn_gradient_sums": (_make_bn_gradient_sums, "mmvvo")}


def _signature(numba, args, dtype):
    item = numba.from_dtype(np.dtype(dtype))
    kinds = {"m": item[:, ::1], "v": item[::1], "o": numba.float64[:, ::1], "i": item[:, :, :, ::1],
             "u": numba.uint8[:, :, :, ::1], "f": item[::1], "k": numba.int64, "c": item[:, :, ::1],
             "d": numba.float64, "j": numba.int64[::1], "b": numba.boolean}
    return numba.void(*[kinds[a] for a in args])


def _njit(numba, fn, sig, fastmath=False):
    options = dict(nogil=True, boundscheck=False, error_model="numpy", fastmath=fastmath)
    try:
        return numba.njit(sig, cache=True, **options)(fn)
    except RuntimeError:   # no cache directory it can write: compile in memory
        return numba.njit(sig, **options)(fn)


def _plain(name, dtype):
    """The kernel `name` of _PLAIN compiled for dtype (loops numba compiles
    as they are: no fastmath, its default vectorizers)."""
    full = (name, np.dtype(dtype))   # a layer's every call asks: one lookup, no dtype string made
    kernel = _kernels.get(full)
    if kernel is None:
        numba = vector_width.load()
        fn, args = _PLAIN[name]
        if name in _EXP:
            global _exp32
            _exp32 = exp32.make()   # before the kernel compiles: it calls it
        kernel = _kernels[full] = _njit(numba, fn, _signature(numba, args, dtype),
                                        {"reassoc"} if name in _ROW_SUMS else False)
    return kernel


def _sums(name, c, dtype):
    """Batch norm's sums kernel `name` for c channels: _SUMS' made for c
    (no fastmath; numba's SLP vectorizer on while it compiles) up to
    SUMS_CHANNELS, _PLAIN's beyond."""
    if c > SUMS_CHANNELS:
        return _plain(name, dtype)
    full = (name, c, np.dtype(dtype).str)
    if full not in _kernels:
        global _stack
        numba = vector_width.load()
        from numba.core import config
        _stack = compiled.stack()   # before the kernel compiles: it calls it
        make, args = _SUMS[name]
        slp, config.SLP_VECTORIZE = config.SLP_VECTORIZE, 1
        try:
            _kernels[full] = _njit(numba, make(c), _signature(numba, args, dtype))
        finally:
            config.SLP_VECTORIZE = slp
    return _kernels[full]


def _fast_gelu(whole=False):
    """gelu_fast.make's kernel for float32, compiled once (fastmath "contract"
    only). float32 by name here and in prepare and gelu_forward: the fast
    form's constants and its error bound are float32's (nn/gelu_fast.py).
    whole: the kernel that takes exp(-x^2 / 2) itself (exp_whole)."""
    name = "gelu_forward_whole" if whole else "gelu_forward_fast"
    if name not in _kernels:
        numba = vector_width.load()
        if whole:
            gelu_fast._exp32 = exp32.make()   # before the kernel compiles: it calls it
        _kernels[name] = _njit(numba, gelu_fast.make(np.float32, whole), _signature(numba, "ffff", np.float32),
                               {"contract"})
    return _kernels[name]


def exp_whole(dtype):
    """Whether the kernels take NumPy's exp themselves for `dtype`: float32
    where nn/exp32.py's matches NumPy's here; else NumPy's pass between them."""
    return np.dtype(dtype) == np.float32 and exp32.matches()


def prepare(names, dtype=FLOAT32.compute):
    """Compile (or load from numba's cache) these _PLAIN kernels for `dtype`
    (a layer's bind: the activations', the run's compute dtype) before the
    first step."""
    for name in names:
        if name == "gelu_forward" and np.dtype(dtype) == np.float32:
            _fast_gelu(exp_whole(dtype))
        else:
            _plain(name, dtype)


def prepare_batchnorm(channels, dtype):
    """Compile (or load) batch norm's kernels for `channels` before the first step."""
    prepare(("bn_normalise", "bn_input_gradient"), dtype)
    for name in _SUMS:
        _sums(name, channels, dtype)


def max_pool_forward(x, y, won, k):
    _plain("max_pool_forward", x.dtype)(x, y, won, k)


def max_pool_backward(dy, won, dx, k):
    _plain("max_pool_backward", dy.dtype)(dy, won, dx, k)


def relu_backward(y, dy):
    _plain("relu_backward", dy.dtype)(y, dy)


def add_rows(ids, rows, out):
    _plain("add_rows", rows.dtype)(np.ascontiguousarray(ids, dtype=np.int64), rows, out)


def layer_norm(x, gamma, beta, eps, xhat, rstd, y):
    _plain("layer_norm", x.dtype)(x, gamma, beta, float(eps), xhat, rstd, y)


def layer_norm_backward(dy, gamma, xhat, rstd, dx, sums=None):
    """sums: a (2, c) array for gamma's and beta's gradients in the same pass (NumPy's column sums' bits)."""
    with_sums = sums is not None
    sums = sums if with_sums else np.empty((2, dy.shape[1]), dy.dtype)
    _plain("layer_norm_backward", dy.dtype)(dy, gamma, xhat, rstd, dx, sums, with_sums)


def causal_softmax(att, scale):
    """The causal softmax of scale * att's rows (rows, t, t), in place: one
    pass a row where exp_whole(att.dtype); else the shift (a pass over each
    row's unmasked part), NumPy's exp (in SIMD lanes: a call of math.exp per
    element was 5 ns of the 7 an element took), the normalising (a pass)."""
    kernel = _plain("causal_softmax", att.dtype)
    if exp_whole(att.dtype):
        kernel(att, float(scale), WHOLE)
        return
    kernel(att, float(scale), SHIFT)
    np.exp(att, out=att)
    kernel(att, float(scale), NORMALISE)


def causal_softmax_backward(att, datt, scale):
    _plain("causal_softmax_backward", att.dtype)(att, datt, float(scale))


def gelu_forward(x, y, cdf, phi):
    """From phi = exp(-x^2 / 2) (nn/gelu.py: NumPy's exp before it)."""
    if x.dtype == np.float32:
        _fast_gelu()(x, y, cdf, phi)
    else:
        _plain("gelu_forward", x.dtype)(x, y, cdf, phi)


def gelu_forward_whole(x, y, cdf, phi):
    """From x alone, where exp_whole(x.dtype): exp(-x^2 / 2) in the same pass, its bits."""
    _fast_gelu(True)(x, y, cdf, phi)


def half_square(x, out):
    _plain("half_square", x.dtype)(x, out)


def gelu_tanh_forward(x, y, cdf, phi):
    _plain("gelu_tanh_forward", x.dtype)(x, y, cdf, phi)


def gelu_backward(x, cdf, phi, dy, dx):
    _plain("gelu_backward", x.dtype)(x, cdf, phi, dy, dx)


def bn_statistics(x):
    """(mean, biased variance) of each column of x (m, c), float64."""
    out = np.empty((2, x.shape[1]))
    _sums("bn_statistics", x.shape[1], x.dtype)(x, out)
    return out


def bn_normalise(x, mean, inv_std, gamma, beta, y):
    _plain("bn_normalise", x.dtype)(x, mean, inv_std, gamma, beta, y)


def bn_gradient_sums(dy, x, mean, inv_std):
    """(the sum of each column of dy, of dy * xhat), float64."""
    out = np.empty((2, dy.shape[1]))
    _sums("bn_gradient_sums", dy.shape[1], dy.dtype)(dy, x, mean, inv_std, out)
    return out


def bn_input_gradient(dy, x, mean, inv_std, a, b, scale, dx):
    _plain("bn_input_gradient", dy.dtype)(dy, x, mean, inv_std, a, b, scale, dx)
