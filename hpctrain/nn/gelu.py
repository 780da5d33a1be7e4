"""GELU, the exact form nanoGPT uses (PyTorch's nn.GELU(), approximate='none'):
gelu(x) = x * Phi(x), Phi the standard normal distribution function,
Phi(x) = (1 + erf(x / sqrt 2)) / 2, not the tanh approximation.

NumPy has no erf, SciPy is not a dependency, and math.erf one element at a
time (np.frompyfunc) is a Python call per element. So Phi is computed here
from erfc with W. J. Cody's rational Chebyshev approximations ("Rational
Chebyshev approximations for the error function", Math. Comp. 23 (1969)
631-638; the coefficients of Netlib SPECFUN's CALERF), three intervals of
|z|, each a ratio of two polynomials: good to float64 rounding
(tests/test_transformer_layers.py holds it to math.erfc within 2e-15
relative, both tails), elementwise xp arithmetic only, so NumPy and CuPy
run the same code. Phi(x) for x < 0 is erfc(|z|)/2, not (1 + erf)/2: no
cancellation in the left tail. The price: some fifty elementwise passes
(all three intervals evaluated, each element's taken), the slowest layer of
a small GPT on NumPy (half its step at width 128). With compiled layers on
(--compiled-layers, numba) each direction is one pass instead
(nn/passes.py: the C library's erfc in float64), within a few float32 ulps
of this path, not its bits.

    python -m pytest -q tests/test_transformer_layers.py -k gelu
"""
import math

import numpy as np

from . import compiled, passes, threads
from .layers import Layer

# CALERF's coefficients, highest index the leading one as Cody lists them
_A = (3.16112374387056560e00, 1.13864154151050156e02, 3.77485237685302021e02, 3.20937758913846947e03,
      1.85777706184603153e-1)
_B = (2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03, 2.84423683343917062e03)
_C = (5.64188496988670089e-1, 8.88314979438837594e00, 6.61191906371416295e01, 2.98635138197400131e02,
      8.81952221241769090e02, 1.71204761263407058e03, 2.05107837782607147e03, 1.23033935479799725e03,
      2.15311535474403846e-8)
_D = (1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02, 1.62138957456669019e03,
      3.29079923573345963e03, 4.36261909014324716e03, 3.43936767414372164e03, 1.23033935480374942e03)
_P = (3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1, 1.60837851487422766e-2,
      6.58749161529837803e-4, 1.63153871373020978e-2)
_Q = (2.56852019228982242e00, 1.87295284992346047e00, 5.27905102951428412e-1, 6.05183413124413191e-2,
      2.33520497626869185e-3)
_SQRPI = 5.6418958354775628695e-1   # 1 / sqrt(pi)
_SMALL, _MIDDLE = 0.46875, 4.0       # the intervals' bounds


def _ratio(num, den, lead_num, last_num, last_den, t):
    """Cody's evaluation: ((lead_num t + num[0]) t + ... ) / ((t + den[0]) t + ...)."""
    xnum, xden = lead_num * t, t
    for a, b in zip(num, den):
        xnum = (xnum + a) * t
        xden = (xden + b) * t
    return (xnum + last_num) / (xden + last_den)


def _gauss(xp, a):
    """exp(-a^2) as exp(-s^2) exp(-(a - s)(a + s)), s = a to 1/16: a^2
    rounded whole would lose a^2 ulps of it (CALERF's way)."""
    s = xp.trunc(a * 16.0) / 16.0
    return xp.exp(-s * s) * xp.exp(-(a - s) * (a + s))


def erfc_abs(xp, a):
    """erfc(a) for a >= 0 (an xp array): each interval's formula evaluated
    everywhere (no masks: no gathers, nothing for a GPU to wait on) and
    each element's own taken. Past a ~ 26.5 the result underflows to 0."""
    small = 1.0 - a * _ratio(_A[:3], _B[:3], _A[4], _A[3], _B[3], a * a)
    middle = _ratio(_C[:7], _D[:7], _C[8], _C[7], _D[7], a)
    safe = xp.maximum(a, _MIDDLE)   # the third interval's 1/a^2, finite everywhere
    inv = 1.0 / (safe * safe)
    tail = (_SQRPI - inv * _ratio(_P[:4], _Q[:4], _P[5], _P[4], _Q[4], inv)) / safe
    return xp.where(a <= _SMALL, small, xp.where(a < _MIDDLE, middle, tail) * _gauss(xp, a))


# Elements per pass of normal_cdf on the host: erfc's dozens of temporaries
# then stay small (64 KB in float64: below malloc's mmap threshold, in the
# cache), instead of each a fresh, page-faulted array of the whole input.
# A GPU takes the whole array at once.
CHUNK = 8192


def normal_cdf(xp, x, out=None, split=None):
    """Phi(x) = erfc(-x / sqrt 2) / 2, elementwise, in x's dtype, into `out`
    (x's shape) or a new array; `split(n, work)`: a layer's thread split
    (nn/layers.py Layer.split) of the n chunks, None: one after another."""
    out = xp.empty_like(x) if out is None else out
    flat, dst = x.reshape(-1), out.reshape(-1)
    chunk = CHUNK if xp is np else max(flat.size, 1)
    scale, dtype = x.dtype.type(1 / math.sqrt(2)), x.dtype

    def chunks(t, first, last):
        for lo in range(first * chunk, min(last * chunk, flat.size), chunk):
            z = flat[lo:lo + chunk] * scale
            half = 0.5 * erfc_abs(xp, xp.abs(z))
            dst[lo:lo + chunk] = xp.where(z < 0, half, 1.0 - half).astype(dtype, copy=False)
    n = -(-flat.size // chunk)
    (split or (lambda n, work: work(0, 0, n)))(n, chunks)
    return out


class GELU(Layer):
    """y = x Phi(x), the exact (erf) form; its derivative Phi(x) + x phi(x),
    phi the normal density. Keeps its input and Phi(x) for the backward."""
    keeps_output = False   # its backward reads its input and Phi

    def bind(self, xp, params, grads, state):
        super().bind(xp, params, grads, state)
        self.compiled = compiled.on() and xp is np   # one pass each way (nn/passes.py)
        if self.compiled:
            passes.prepare(("gelu_forward", "gelu_backward"), np.float32)

    def _rows(self, fn, *arrays):
        """fn over the flat arrays, split into rows over the compute threads."""
        n = len(arrays[0])
        flat = [a.reshape(n, -1) for a in arrays]
        self.split(n, lambda t, lo, hi: fn(*(a[lo:hi].reshape(-1) for a in flat)),
                   most=threads.most(floats=4 * arrays[0].size))

    def forward(self, ctx, x, train):
        cdf = ctx.buffer("cdf", x.shape, x.dtype)
        y = ctx.buffer(("out", train), x.shape, x.dtype)
        if self.compiled and x.flags.c_contiguous:
            self._rows(passes.gelu_forward, x, y, cdf)
        else:
            normal_cdf(self.xp, x, cdf, lambda n, work: self.split(n, work, most=threads.most(floats=30 * x.size)))
            self.xp.multiply(x, cdf, out=y)
        ctx.x, ctx.cdf = x, cdf
        return y

    def backward(self, ctx, dy, need_dx):
        if not need_dx:
            return None
        xp, x = self.xp, ctx.x
        dx = ctx.buffer("dx", dy.shape, dy.dtype)
        if self.compiled and x.flags.c_contiguous and dy.flags.c_contiguous:
            self._rows(passes.gelu_backward, x, ctx.cdf, dy, dx)
            return dx
        # phi(x) = exp(-x^2 / 2) / sqrt(2 pi), into dx, then x phi + Phi, times dy
        xp.multiply(x, x, out=dx)
        dx *= x.dtype.type(-0.5)
        xp.exp(dx, out=dx)
        dx *= x.dtype.type(1 / math.sqrt(2 * math.pi))
        dx *= x
        dx += ctx.cdf
        dx *= dy
        return dx

    def train_floats(self):
        # its output, Phi, the input gradient (and erfc's temporaries, a few per unit while it runs)
        return 3 * math.prod(self.in_shape)

    def flops(self):
        return 30 * math.prod(self.in_shape)   # Cody's ratios and two exps, in multiply-adds roughly

    def describe(self):
        return "GELU"

