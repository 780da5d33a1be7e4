"""NumPy's float32 exp, bit for bit, inside the compiled layers' kernels
(nn/passes.py): GELU's forward and attention's softmax take exp(x) in the
same pass as the arithmetic around it instead of a NumPy pass of its own
between two kernels (the exponent written out, read, written, read again).

NumPy (1.22 to 2.x) computes a float32 exp on x86 CPUs with AVX2 and FMA,
or AVX-512, by one algorithm (numpy/_core/src/umath/
loops_exponent_log.dispatch.c.src, simd_exp_FLOAT): NaN, x >= 88.7228...
(inf) and x <= -103.972... (0) set aside; k = x log2(e) rounded to an
integer by adding and subtracting 1.5 * 2^23; the Cody-Waite reduction
r = x + k c1 + k c2 (+ k 0) in fused multiply-adds; exp(r) = P(r) / Q(r),
a degree-5 over a degree-2 polynomial, each by Horner in fused
multiply-adds; then P/Q * 2^k, rounded once (AVX-512's scalef; AVX2's
exponent arithmetic, whose subnormal results are one division by a power
of two, rounded once too). `make` emits that sequence as LLVM IR in an
intrinsic whose operations carry a flag of their own (NEUTRAL), so that
numba's fast-math pass, which flags every float operation without one,
leaves them as they are: with the kernel's "contract" on them, LLVM fused
x log2(e) with the add after it into one multiply-add, which moved k for
84 of the 2^32 inputs. LLVM vectorises it as it stands.

Checked against every one of the 2^32 float32 inputs on an Intel Xeon
(AVX-512, NumPy 2.4): the same bits (a NaN for a NaN). A NumPy built
otherwise (no AVX2: the C library's expf) rounds otherwise: `matches`
compares the two on a sample of every exponent's inputs, once a process,
and the kernels take NumPy's pass wherever it says no.

Kernels that call it are cached on disk by numba, which sees their own
file's changes, not this one's: a change here wants NUMBA_CACHE_DIR
cleared (or the kernels' files touched).

    python -m pytest -q tests/test_compiled.py -k exp32
"""
import numpy as np

from ..base import vector_width

# NumPy's constants (npy_math.h, npy_simd_data.h), as float32 bit patterns
_BITS = {"log2e": 0x3FB8AA3B, "magic": 0x4B400000, "c1": 0xBF317200, "c2": 0xB5BFBE8E,
         "xmax": 0x42B17218, "xmin": 0xC2CFF1B5, "nan": 0x7FC00000,
         "p": (0x3F800000, 0x3F39CBD5, 0x3E7D4C58, 0x3D517D8C, 0x3BDD7159, 0x3A053DD8),
         "q": (0x3F800000, 0xBE8C6857, 0x3CB0E832)}
_made = {}
# The flag exp32's own float operations carry: "afn" (approximate library functions) changes nothing
# about an add, multiply, divide or compare, and a flag already there keeps the kernel's "contract" or
# "reassoc" off them (numba adds its fast-math flags to float operations that have none)
NEUTRAL = "afn"


def _float(bits):
    return float(np.uint32(bits).view(np.float32))


def make():
    """The intrinsic exp32(x) for a float32 x (numba imported through
    vector_width.load), made once."""
    if "exp32" in _made:
        return _made["exp32"]
    vector_width.load()
    import llvmlite.ir as ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def exp32(typingctx, x):
        if x != types.float32:
            return None

        def codegen(context, builder, sig, args):
            f32, f64, i64 = ir.FloatType(), ir.DoubleType(), ir.IntType(64)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")

            def c(name, i=None):
                bits = _BITS[name] if i is None else _BITS[name][i]
                return ir.Constant(f32, _float(bits))
            x, = args

            def own(ins):   # numba's fast-math pass flags only float operations that have no flags yet
                ins.flags.append(NEUTRAL)
                return ins
            nan = builder.fcmp_unordered("uno", x, x, flags=(NEUTRAL,))
            big = builder.fcmp_ordered(">=", x, c("xmax"), flags=(NEUTRAL,))
            small = builder.fcmp_ordered("<=", x, c("xmin"), flags=(NEUTRAL,))
            zero = ir.Constant(f32, 0.0)
            x = builder.select(builder.or_(nan, builder.or_(big, small)), zero, x)
            k = own(builder.fmul(x, c("log2e")))
            k = own(builder.fsub(own(builder.fadd(k, c("magic"))), c("magic")))   # rounded to an integer
            r = builder.call(fma, [k, c("c1"), x])
            # NumPy's third step, r + k 0, only turns r = -0 into +0, which P/Q below does not tell apart
            r = builder.call(fma, [k, c("c2"), r])
            num = builder.call(fma, [c("p", 5), r, c("p", 4)])
            for i in (3, 2, 1, 0):
                num = builder.call(fma, [num, r, c("p", i)])
            den = builder.call(fma, [c("q", 2), r, c("q", 1)])
            den = builder.call(fma, [den, r, c("q", 0)])
            poly = own(builder.fdiv(num, den))
            # P/Q * 2^k: exact in float64 (k in [-150, 128]), then rounded once to float32
            scale = builder.shl(builder.add(builder.fptosi(k, i64), ir.Constant(i64, 1023)), ir.Constant(i64, 52))
            y = builder.fptrunc(own(builder.fmul(builder.fpext(poly, f64), builder.bitcast(scale, f64))), f32)
            y = builder.select(small, zero, y)
            y = builder.select(big, ir.Constant(f32, float("inf")), y)
            return builder.select(nan, c("nan"), y)
        return types.float32(types.float32), codegen
    _made["exp32"] = exp32
    return exp32


def sample():
    """float32 inputs for the check: of every exponent and sign, 64
    mantissas each (the extremes among them, NaN and the infinities), and
    the inputs within 8 units of the last place of (n + 1/2) ln 2, where
    x log2(e) is half way between two k (where a fused multiply-add
    showed)."""
    hi = (np.arange(512, dtype=np.uint32) << np.uint32(23))   # sign and exponent
    lo = np.unique(np.concatenate([np.linspace(0, 2 ** 23 - 1, 62).astype(np.uint32), [1, 2 ** 23 - 2]]))
    ties = ((np.arange(-151, 129) + 0.5) * np.log(2)).astype(np.float32).view(np.int32)
    near = (ties[:, None] + np.arange(-8, 9, dtype=np.int32)[None, :]).reshape(-1)
    return np.concatenate([(hi[:, None] | lo[None, :]).reshape(-1).view(np.float32), near.view(np.float32)])


_exp32 = None   # make()'s intrinsic, for _each: a global, which numba's disk cache does not hash


def _each(x, out):
    for i in range(x.shape[0]):
        out[i] = _exp32(x[i])


def matches():
    """Whether exp32 gives NumPy's np.exp bits here (once a process; the
    check's kernel from numba's disk cache where it can write one)."""
    global _exp32
    if "matches" not in _made:
        numba = vector_width.load()
        _exp32 = make()
        sig = numba.void(numba.float32[::1], numba.float32[::1])
        try:
            each = numba.njit(sig, cache=True)(_each)
        except RuntimeError:   # no cache directory it can write: compile in memory
            each = numba.njit(sig)(_each)
        x = sample()
        ours = np.empty_like(x)
        each(x, ours)
        with np.errstate(all="ignore"):
            theirs = np.exp(x)
        _made["matches"] = bool(np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
                                or np.array_equal(ours, theirs, equal_nan=True))
    return _made["matches"]
