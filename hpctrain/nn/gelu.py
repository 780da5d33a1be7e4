"""GELU, by default the exact form nanoGPT uses (PyTorch's nn.GELU(),
approximate='none'): gelu(x) = x * Phi(x), Phi the standard normal
distribution function, Phi(x) = (1 + erf(x / sqrt 2)) / 2; with
approximate="tanh" (PyTorch's name; `--model gpt:...,act=gelu_tanh`) GPT-2's
form, transformers' gelu_new: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).

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
(--compiled-layers, numba) each direction is one pass instead, forward
keeping the density for the gradient (nn/passes.py): on float32 a
branch-free fit of erfc in float32 lanes (Numerical Recipes' erfcc,
fractional error under 1.2e-7, about one float32 ulp, in both tails: the
erf form still, evaluated to float32's precision as PyTorch's CPU kernel
evaluates it, 4x faster than Cody's intervals there), on float64 Cody's
erfc element by element, its interval only; within a few float32 ulps of
|x| of this path, not its bits.

The tanh form is x S(x), S(x) = (1 + tanh u) / 2 = 1 / (1 + exp(-2u)),
u = sqrt(2/pi) (x + 0.044715 x^3), evaluated as the logistic of 2u with
e = exp(-2|u|) <= 1: S = 1 / (1 + e) or e / (1 + e), and its derivative
S' = 2 u' e / (1 + e)^2, so neither tail cancels (1 + tanh u near u = -9
is 0 in float32, e / (1 + e) is not). It keeps S and S' from the forward,
as the exact form's compiled path keeps Phi and phi, so the backward is
that one: dx = dy (S + x S'). With compiled layers the tanh forward is one
pass too, in float64 rounded once (nn/passes.py): within a few ulps of
PyTorch's either way (tests/test_gpt_options.py).

    python -m pytest -q tests/test_transformer_layers.py -k gelu
    python -m pytest -q tests/test_gpt_options.py
"""
import math

import numpy as np

from . import compiled, passes
from .erfc import erfc_abs
from .layers import Layer

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


def _gauss_then_kernel(x, y, cdf, phi):
    """The compiled forward: in one pass where the kernel takes NumPy's exp
    itself (float32, nn/exp32.py); else exp(-x^2 / 2) by NumPy (its exp runs
    in SIMD lanes, math.exp would be a call per element: most of its time),
    then the compiled pass; -x^2 / 2 in one pass before it (NumPy's two
    multiplies, their bits). The same bits either way."""
    if passes.exp_whole(x.dtype):
        passes.gelu_forward_whole(x, y, cdf, phi)
        return
    passes.half_square(x, phi)
    np.exp(phi, out=phi)
    passes.gelu_forward(x, y, cdf, phi)


# The tanh form's constants: u = K x (1 + C x^2), u' = K (1 + 3 C x^2).
TANH_K, TANH_C = math.sqrt(2 / math.pi), 0.044715
APPROXIMATE = ("none", "tanh")


def tanh_gate(xp, x, y, cdf, slope, e):
    """The tanh form on xp's arrays of one shape, in their dtype: cdf = S(x),
    slope = S'(x), y = x S(x), e scratch (see the module's docstring)."""
    t = x.dtype.type
    xp.multiply(x, x, out=slope)
    xp.multiply(slope, t(TANH_K * TANH_C), out=cdf)
    cdf += t(TANH_K)
    cdf *= x                                        # u
    slope *= t(6 * TANH_K * TANH_C)
    slope += t(2 * TANH_K)                          # 2 u'
    xp.abs(cdf, out=e)
    e *= t(-2)
    xp.exp(e, out=e)                                # exp(-2|u|), in (0, 1]
    slope *= e
    cdf[...] = xp.where(cdf < 0, e, t(1))
    e += t(1)
    cdf /= e
    slope /= e
    slope /= e
    xp.multiply(x, cdf, out=y)


class GELU(Layer):
    """y = x Phi(x), the exact (erf) form, or with approximate="tanh" GPT-2's
    x S(x); the derivative S(x) + x S'(x) (exact: Phi + x phi, phi the
    normal density). Keeps its input and S(x) (tanh: S'(x) too) for the backward."""
    keeps_output = False   # its backward reads its input and Phi
    elementwise = tokenwise = True
    kernel = "gelu"

    def __init__(self, approximate="none"):
        if approximate not in APPROXIMATE:
            raise ValueError(f"GELU(approximate={approximate!r}): one of {', '.join(map(repr, APPROXIMATE))}")
        self.approximate = approximate

    def bind(self, xp, params, grads, state):
        super().bind(xp, params, grads, state)
        self.compiled = compiled.on() and xp is np   # one pass each way (nn/passes.py)
        if self.compiled:
            forward = "gelu_tanh_forward" if self.approximate == "tanh" else "gelu_forward"
            passes.prepare((forward, "gelu_backward") + (() if self.approximate == "tanh" else ("half_square",)))

    def _rows(self, fn, *arrays):
        """fn over the flat arrays, split into rows over the compute threads."""
        # a range of the first axis, flattened: a view of a C-contiguous array, no list of reshaped arrays first
        self.in_parallel(len(arrays[0]), lambda t, lo, hi: fn(*[a[lo:hi].reshape(-1) for a in arrays]),
                         floats=4 * arrays[0].size)

    def forward(self, ctx, x, train):
        cdf = ctx.buffer("cdf", x.shape, x.dtype)
        y = ctx.buffer(("out", train), x.shape, x.dtype)
        if self.approximate == "tanh":   # S' kept as the exact form's compiled path keeps phi
            phi = ctx.phi = ctx.buffer("phi", x.shape, x.dtype)
            if self.compiled and x.flags.c_contiguous:
                self._rows(passes.gelu_tanh_forward, x, y, cdf, phi)
            else:
                self._rows(lambda *flat: tanh_gate(self.xp, *flat), x, y, cdf, phi,
                           ctx.buffer("e", x.shape, x.dtype))
        elif self.compiled and x.flags.c_contiguous:   # the density too, for the gradient
            phi = ctx.phi = ctx.buffer("phi", x.shape, x.dtype)
            self._rows(_gauss_then_kernel, x, y, cdf, phi)
        else:
            normal_cdf(self.xp, x, cdf, lambda n, work: self.in_parallel(n, work, floats=30 * x.size))
            self.xp.multiply(x, cdf, out=y)
        ctx.x, ctx.cdf = x, cdf
        return y

    def backward(self, ctx, dy, need_dx):
        if not need_dx:
            return None
        xp, x = self.xp, ctx.x
        dx = ctx.buffer("dx", dy.shape, dy.dtype)
        if self.compiled and x.flags.c_contiguous and dy.flags.c_contiguous:
            self._rows(passes.gelu_backward, x, ctx.cdf, ctx.phi, dy, dx)
            return dx
        if self.approximate == "tanh":   # S' from the forward
            xp.multiply(x, ctx.phi, out=dx)
            dx += ctx.cdf
            dx *= dy
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
        # its output, Phi, the input gradient, with compiled layers the density (and on NumPy erfc's
        # temporaries, a few per unit while it runs; the tanh form's scratch)
        return (5 if self.approximate == "tanh" else 4) * math.prod(self.in_shape)

    def flops(self):
        return 30 * math.prod(self.in_shape)   # Cody's ratios and two exps, in multiply-adds roughly

    def describe(self):
        return "GELU(tanh)" if self.approximate == "tanh" else "GELU"

