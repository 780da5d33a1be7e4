"""Gradient compression's arithmetic (--compression), with no MPI: the 16-bit
codecs that fp16 and bf16 put on the wire, and PowerSGD's pieces (which
tensors it compresses, its orthogonalisation, its initial Q). The exchanges
that use them are comm/compressed_exchange.py's and comm/powersgd.py's; the loops never
see either.

fp16 and bf16 travel as 16-bit words (uint16 arrays, which MPI moves as
MPI_UNSIGNED_SHORT and NCCL would not need to understand):
- fp16: IEEE binary16, NumPy's own cast (round to nearest even; 65504 is the
  largest finite value, so a larger magnitude becomes inf);
- bf16: the top 16 bits of the float32, rounded to nearest even (Google
  Brain's bfloat16: float32's exponent range, 8 bits of mantissa), with
  NumPy's integer operations; a NaN stays a NaN. No new dependency.
Every function takes NumPy or CuPy arrays alike (only ufuncs, views and
copyto), so the GPU runs the same code as the CPU tests.

PowerSGD (Vogels, Karimireddy, Jaggi: "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization", NeurIPS 2019; PyTorch DDP's
powerSGD_hook): a tensor of 2 or more dimensions is a matrix of
prod(shape[:-1]) rows and shape[-1] columns (a Dense layer's fan-in x units,
an NHWC convolution's kh*kw*cin x cout), and is sent as two factors of rank
R when that is at least --powersgd-min-rate times smaller, as DDP decides
(`compressed_rank`); 1-D tensors and small matrices go as they are.

    python -m pytest -q tests/test_compression.py
"""
import math

import numpy as np

from ..base.device import Scratch, array_module
from ..base.precision import FLOAT32

KINDS = ("none", "fp16", "bf16", "powersgd")
HALF_KINDS = ("fp16", "bf16")
# bf16's quiet NaN (what any NaN rounds to: never inf, never a number).
BF16_NAN = 0x7FC0


# --- 16-bit codecs -----------------------------------------------------------------
#
# Each conversion is a few integer ufuncs, run over blocks of BLOCK elements
# on the CPU so that every pass reads what the last one wrote from cache,
# and branch-free: a choice between two results is m * (a - b) + b, not a
# masked copy, whose branches mispredict on mixed data. NumPy's own float16
# cast is branchy and slow on values below fp16's smallest normal (6.1e-5;
# a gradient divided by the ranks has many): measured here 47 ns an element
# against 5 for this one, the same words (tests/test_compression.py). On a
# GPU one block is the whole array (a kernel launch per pass, no more).

BLOCK = 1 << 14
# fp16 <-> float32 (F. Giesen's branch-free conversions, round to nearest even)
_F16_BIAS = (((15 - 127) << 23) + 0xFFF) & 0xFFFFFFFF   # float32 exponent to fp16's, plus the rounding half
_F16_MIN_NORMAL = 113 << 23                              # |x| below 2**-14: an fp16 subnormal (or zero)
_F16_DENORM = ((127 - 15) + (23 - 10) + 1) << 23         # float32 0.5: x + it leaves x's subnormal word in its bits
_F16_INF, _F32_INF = 0x7C00, 0x7F800000


def _blocks(xp, n):
    step = BLOCK if xp is np else max(n, 1)
    return [(a, min(a + step, n)) for a in range(0, n, step)]


# Typed constants: a Python int beside a uint32 array is uint32 under NumPy 2's
# rules, and may not be under another array module's.
U = np.uint32


def _select(xp, mask, a, b, tmp):
    """b = a where mask else b, in place, uint32 (a: an array or a constant),
    branch-free: b + mask * (a - b), wrapping."""
    xp.subtract(a, b, out=tmp)
    xp.multiply(tmp, mask, out=tmp)
    xp.add(b, tmp, out=b)


def _bf16_block(xp, x, out, w):
    u = x.view(xp.uint32)
    t, n = w("t", xp.uint32), w("n", xp.uint32)
    xp.right_shift(u, U(16), out=t)
    xp.bitwise_and(t, U(1), out=t)
    xp.add(t, U(0x7FFF), out=t)
    xp.add(t, u, out=t)          # wraps only for NaN patterns, replaced below
    xp.right_shift(t, U(16), out=t)
    # a NaN whose rounding carried (into inf, or past the sign) is BF16_NAN
    xp.copyto(n, xp.isnan(x), casting="unsafe")
    _select(xp, n, U(BF16_NAN), t, w("d", xp.uint32))
    xp.copyto(out, t, casting="unsafe")


def _fp16_block(xp, x, out, w):
    u = x.view(xp.uint32)
    v, s, m, f, d = (w(k, xp.uint32) for k in ("v", "s", "m", "f", "d"))
    xp.bitwise_and(u, U(0x7FFFFFFF), out=v)                     # |x|
    xp.right_shift(v, U(13), out=s)                             # normal: rebias, round to nearest even
    xp.bitwise_and(s, U(1), out=s)
    xp.add(s, v, out=s)
    xp.add(s, U(_F16_BIAS), out=s)
    xp.right_shift(s, U(13), out=s)
    fv = f.view(xp.float32)                                  # subnormal: the float add rounds it
    xp.add(v.view(xp.float32), U(_F16_DENORM).view(xp.float32), out=fv)
    xp.subtract(f, U(_F16_DENORM), out=f)
    xp.less(v, U(_F16_MIN_NORMAL), out=m, casting="unsafe")
    _select(xp, m, f, s, d)
    xp.minimum(s, U(_F16_INF), out=s)                           # past 65504 (and inf): inf
    xp.greater(v, U(_F32_INF), out=m, casting="unsafe")         # NaN: inf's word and the quiet bit
    xp.left_shift(m, U(9), out=m)
    xp.bitwise_or(s, m, out=s)
    xp.right_shift(u, U(16), out=v)
    xp.bitwise_and(v, U(0x8000), out=v)
    xp.bitwise_or(s, v, out=s)
    xp.copyto(out, s, casting="unsafe")


def _from_fp16_block(xp, words, out, w):
    o = out.view(xp.uint32)
    e, m, f, d = (w(k, xp.uint32) for k in ("e", "m", "f", "d"))
    xp.left_shift(words, U(13), out=o, dtype=xp.uint32)
    xp.bitwise_and(o, U(0x0FFFE000), out=o)                     # exponent and mantissa, in float32's place
    xp.add(o, U((127 - 15) << 23), out=o)                       # normal: rebias
    xp.bitwise_and(words, U(0x7C00), out=e, dtype=xp.uint32)
    xp.copyto(m, e == U(0x7C00), casting="unsafe")              # inf, NaN: the exponent all ones
    xp.multiply(m, U((128 - 16) << 23), out=m)
    xp.add(o, m, out=o)
    xp.bitwise_and(words, U(0x3FF), out=f, dtype=xp.uint32)     # zero, subnormal: mantissa x 2**-24, exact
    fv = f.view(xp.float32)
    xp.multiply(f, xp.float32(2.0 ** -24), out=fv, dtype=xp.float32)
    xp.copyto(m, e == U(0), casting="unsafe")
    _select(xp, m, f, o, d)
    xp.bitwise_and(words, U(0x8000), out=e, dtype=xp.uint32)
    xp.left_shift(e, U(16), out=e)
    xp.bitwise_or(o, e, out=o)


def _from_bf16_block(xp, words, out, w):
    xp.left_shift(words, U(16), out=out.view(xp.uint32), dtype=xp.uint32)


class Half:
    """One 16-bit format on the wire (`kind`: fp16 or bf16): encode a float32
    array into 16-bit words (uint16), decode them back, or decode and add
    them into a float32 array (a ring's receive); NumPy or CuPy arrays."""

    def __init__(self, kind):
        if kind not in HALF_KINDS:
            raise ValueError(f"not a 16-bit compression: {kind!r}")
        self.kind = kind
        self._encode, self._decode = (_fp16_block, _from_fp16_block) if kind == "fp16" else \
            (_bf16_block, _from_bf16_block)
        # fp16's largest value is 65504: each rank divides its gradient by the
        # number of ranks before the sum (Horovod's and DDP's fp16 hooks do),
        # so no partial sum on the wire exceeds the largest of the gradients
        # summed. bf16 has float32's range and needs none.
        self.prescale = kind == "fp16"
        self._work = Scratch()   # one per codec: one thread at a time uses it

    def _run(self, block, src, dst):
        xp = array_module(src)
        for a, b in _blocks(xp, src.size):
            block(xp, src[a:b], dst[a:b], self._scratch(xp, b - a))
        return dst

    def _scratch(self, xp, n):
        return lambda name, dtype: self._work.get(name, xp, dtype, n)

    def encode(self, x, out):
        """out (uint16, x's size) = x's words."""
        return self._run(self._encode, x, out)

    def decode(self, words, out):
        """out (float32) = the words' values."""
        return self._run(self._decode, words, out)

    def decode_add(self, words, out):
        """out += the words' values, in float32, block by block."""
        xp = array_module(out)
        for a, b in _blocks(xp, words.size):
            values = self._work.get("values", xp, xp.float32, b - a)
            self._decode(xp, words[a:b], values, self._scratch(xp, b - a))
            xp.add(out[a:b], values, out=out[a:b])
        return out

    def round_(self, x, words):
        """x rounded to the 16-bit format in place; words (uint16) then hold its words."""
        self.encode(x, words)
        return self.decode(words, x)


# --- PowerSGD ------------------------------------------------------------------------

def matrix_shape(shape):
    """(rows, cols) PowerSGD views a tensor as: the last axis as columns,
    the rest as rows (Dense (fan_in, units); NHWC Conv2d (kh, kw, cin, cout)
    -> (kh*kw*cin, cout), its input patch against its filters); None for a
    tensor of fewer than 2 dimensions."""
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        return None
    return math.prod(shape[:-1]), shape[-1]


def compressed_rank(shape, rank, min_rate):
    """The rank PowerSGD sends tensor `shape` with, or 0 to send it as it is:
    a matrix of rows x cols goes as (rows + cols) x r floats (r = rank, at
    most min(rows, cols)), compressed only when that times min_rate is
    less than rows x cols (DDP's _should_compress)."""
    dims = matrix_shape(shape)
    if dims is None:
        return 0
    rows, cols = dims
    r = min(int(rank), rows, cols)
    return r if (rows + cols) * r * min_rate < rows * cols else 0


def orthogonalise(p, eps=0.0):
    """The columns of p (rows x r) made orthonormal in place, Gram-Schmidt, in
    column order. Elementwise products and NumPy's (or CuPy's) own sums
    only, no BLAS: every rank orthogonalises the same summed P, and a BLAS
    splits its sums by its thread count, which may differ between nodes; these
    bits do not. Each column is divided by its norm + eps (DDP's
    orthogonalization_epsilon); a column whose norm + eps is 0 stays 0
    instead of becoming NaN (a matrix whose gradient is zero)."""
    xp = array_module(p)
    for i in range(p.shape[1]):
        col, done = p[:, i], p[:, :i]
        # Twice ("twice is enough", Giraud et al.): of a column that the ones
        # before span already (a gradient of rank below R), one pass leaves
        # rounding noise that is not orthogonal to them; the second pass
        # removes that, so P stays orthonormal and low ranks exact.
        for _ in range(2 if i else 0):
            coef = xp.sum(done * col[:, None], axis=0)
            col -= xp.sum(done * coef[None, :], axis=1)
        norm = xp.sqrt(xp.sum(col * col)) + p.dtype.type(eps)
        col /= xp.where(norm > 0, norm, p.dtype.type(1))
    return p


def initial_q(seed, index, cols, rank, step=None):
    """The first Q (cols x rank, float32, orthonormal columns) of the
    `index`-th compressed tensor: standard normal from (seed, index) (and the
    step, for --powersgd-warm-start off, which draws a new one every step),
    so every rank draws the same, whatever its rank."""
    key = [int(seed), 0x9D5, int(index)] + ([] if step is None else [int(step)])
    q = np.random.default_rng(key).standard_normal((cols, rank)).astype(FLOAT32.grads)
    return orthogonalise(q)


class Matrix:
    """One tensor PowerSGD compresses: [lo, hi) of the buffer, its (rows,
    cols), its rank, where its Q lies in the flat Q buffer ([q_lo, q_hi)),
    and `index`, its place among the compressed tensors (its initial Q's draw)."""
    __slots__ = ("name", "lo", "hi", "rows", "cols", "rank", "q_lo", "q_hi", "index")

    def __init__(self, name, lo, hi, rows, cols, rank, q_lo, index):
        self.name, self.lo, self.hi, self.rows, self.cols, self.rank = name, lo, hi, rows, cols, rank
        self.q_lo, self.q_hi, self.index = q_lo, q_lo + cols * rank, index

    @property
    def p_size(self):
        return self.rows * self.rank


def powersgd_layout(tensors, rank, min_rate):
    """[Matrix] of the tensors PowerSGD compresses (tensors: [(name, shape,
    lo, hi)] in buffer order), their Qs laid out one after another; and the
    layout's key, what a checkpoint's Q must match to be used again."""
    out, q, parts = [], 0, []
    for name, shape, lo, hi in tensors:
        r = compressed_rank(shape, rank, min_rate)
        if r:
            rows, cols = matrix_shape(shape)
            out.append(Matrix(name, lo, hi, rows, cols, r, q, len(out)))
            q += cols * r
            parts.append(f"{name}:{rows}x{cols}r{r}")
    return out, ";".join(parts)
