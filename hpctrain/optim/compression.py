"""Gradient compression's arithmetic (--compression), with no MPI: the 16-bit
codecs that fp16 and bf16 put on the wire, and PowerSGD's pieces (which
tensors it compresses, its orthogonalisation, its initial Q). The exchanges
that use them are comm/compress.py's; the loops never see either.

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

from ..device import array_module

KINDS = ("none", "fp16", "bf16", "powersgd")
HALF_KINDS = ("fp16", "bf16")
# bf16's quiet NaN (what any NaN rounds to: never inf, never a number).
BF16_NAN = 0x7FC0


# --- 16-bit codecs -----------------------------------------------------------------

def to_bf16(x, out, scratch=None):
    """out (uint16) = the bfloat16 words of x (float32), rounded to nearest
    even: add 0x7FFF plus the lowest kept bit, keep the top 16 bits. A NaN
    (whose rounding could carry into the sign or make it inf) is BF16_NAN.
    scratch: a uint32 array of x's size, or None (one is made)."""
    xp = array_module(x)
    u = x.view(xp.uint32)
    t = scratch if scratch is not None else xp.empty(x.shape, xp.uint32)
    xp.right_shift(u, 16, out=t)
    xp.bitwise_and(t, 1, out=t)
    xp.add(t, 0x7FFF, out=t)
    xp.add(t, u, out=t)          # wraps only for NaN patterns, set below
    xp.right_shift(t, 16, out=t)
    xp.copyto(out, t, casting="unsafe")
    xp.copyto(out, xp.uint16(BF16_NAN), where=xp.isnan(x))
    return out


def from_bf16(words, out):
    """out (float32) = the bfloat16 words as float32 (exact: their low 16 bits zero)."""
    xp = array_module(words)
    xp.left_shift(words, 16, out=out.view(xp.uint32), dtype=xp.uint32)
    return out


def to_fp16(x, out, scratch=None):
    """out (uint16) = the binary16 words of x (NumPy's cast: nearest even, inf past 65504)."""
    xp = array_module(x)
    xp.copyto(out.view(xp.float16), x, casting="unsafe")
    return out


def from_fp16(words, out):
    xp = array_module(words)
    xp.copyto(out, words.view(xp.float16), casting="unsafe")
    return out


class Half:
    """One 16-bit format on the wire (`kind`: fp16 or bf16): encode a float32
    array into 16-bit words, decode them back, or decode and add them into a
    float32 array (a ring's receive)."""

    def __init__(self, kind):
        if kind not in HALF_KINDS:
            raise ValueError(f"not a 16-bit compression: {kind!r}")
        self.kind = kind
        self._to, self._from = (to_fp16, from_fp16) if kind == "fp16" else (to_bf16, from_bf16)
        # fp16's largest value is 65504: each rank divides its gradient by the
        # number of ranks before the sum (Horovod's and DDP's fp16 hooks do),
        # so no partial sum on the wire exceeds the largest of the gradients
        # summed. bf16 has float32's range and needs none.
        self.prescale = kind == "fp16"

    def encode(self, x, out, scratch=None):
        """out (uint16, x's size) = x's words. scratch: uint32 of x's size (bf16), optional."""
        return self._to(x, out, scratch)

    def decode(self, words, out):
        return self._from(words, out)

    def decode_add(self, words, out, scratch):
        """out += the words' values, in float32. scratch: float32 of the words' size."""
        xp = array_module(out)
        if self.kind == "fp16":
            xp.add(out, words.view(xp.float16), out=out)   # float16 widened inside the ufunc
        else:
            xp.add(out, self._from(words, scratch), out=out)
        return out

    def round_(self, x, words, scratch=None):
        """x rounded to the 16-bit format in place; words (uint16) then hold its words."""
        self._to(x, words, scratch)
        self._from(words, x)
        return x


def roundtrip(kind, x):
    """x (float32) through the 16-bit format and back, as a new array (tests, measurements)."""
    xp = array_module(x)
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    words = xp.empty(x.shape, xp.uint16)
    return Half(kind).round_(x.copy(), words)


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
    q = np.random.default_rng(key).standard_normal((cols, rank)).astype(np.float32)
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
