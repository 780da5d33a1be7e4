"""Layer kernels compiled by numba (`pip install 'hpctrain[fast]'`), on
when `--compiled-layers` says so (use(); run/startup.py): a convolution's
forward pass, weight gradient and input gradient without im2col for layers
with 16, 32 or 64 output channels (16 or 32 where the CPU has AVX2 but not
AVX-512; nn/conv.py), and, in nn/passes.py, batch norm's passes, max
pooling with windows k apart and ReLU's gradient. This module holds the
switch for both (use, on). Off, the layers run NumPy and BLAS alone.

Why: with 16 to 64 output channels im2col's GEMM is a poor shape for a BLAS
(N = 16 columns: each value of the 9x larger column matrix is used 16
times, and OpenBLAS packs it first). Measured here (one thread, batch 32,
28x28, 16 -> 16 channels, 3x3): the columns' GEMM ran at 32 GFLOP/s, a
third of this machine's SGEMM, and im2col's copy came on top; this forward
kernel ran at 108. It keeps a block of output pixels x all output
channels in vector registers (hpctrain/base/tuning.py: 4 x 16 floats, four
AVX-512 registers, at 16 channels), and for each
input value of the window broadcasts it and adds it times one row of W into
each pixel's accumulators: the input is read in place, the weights stay in
L1, nothing is copied. The weight gradient is the same idea turned round: a
block of input channels x the output channels of one kernel offset held in
registers while every pixel of the block of images goes by (a layer with
one input channel: a block of kernel offsets). The input
gradient is the forward kernel over dy padded with W turned round (stride
1), or a gathering kernel (input_gradient: larger strides).

Each output sums its window in the order (kh, kw, c) (on Intel's AVX-512
CPUs at stride 1, (kh, c, kw): the tuning row's `reuse`), each term a fused
multiply-add (fastmath "contract" only: no reassociation), so a value does
not depend on which block or thread computed it. numba's SLP vectorizer
(off by default, NUMBA_SLP_VECTORIZE) is switched on while these kernels
compile: it is what turns the unrolled channel loop into vector FMAs. The
kernels are compiled per shape and dtype when a layer is bound and cached
on disk where numba can write (their closures hold only numbers and a
dtype: what the cache hashes to find them again).

    python -m pytest -q tests/test_compiled.py
"""
import numpy as np

from ..base import vector_width
from ..base.tuning import STACK_ITEMS, tuning_for, vendor_of

_target = []


def _cpu():
    """(vector instructions, vendor) of what numba compiles for, asked of
    LLVM once: its NUMBA_CPU_FEATURES and NUMBA_CPU_NAME where set, else
    this CPU's."""
    if not _target:
        try:
            vector_width.load()
            from numba.core import config
            import llvmlite.binding as llvm
            features = config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()
            name = config.CPU_NAME or llvm.get_host_cpu_name()
        except ImportError:
            features, name = "", "generic"
        features = set(features.split(","))
        _target.append(("avx512" if "+avx512f" in features else
                        "avx2" if {"+avx2", "+fma"} <= features else None, vendor_of(name)))
    return _target[0]


def isa():
    """"avx512", "avx2" or None: the vector instructions numba compiles for."""
    return _cpu()[0]


def tuning():
    """hpctrain/base/tuning.py's row for what numba compiles for."""
    return tuning_for(*_cpu())


def tuning_key():
    """"isa/vendor: the row's key", what decides the kernels' bits here
    (isa "none": no AVX2 or AVX-512). Ranks and checkpoints compare it."""
    isa_name, vendor = _cpu()
    return f"{isa_name or 'none'}/{vendor}: {tuning().key}"


_kernels = {}
_on = False


def use(on):
    """Make the layers bound from now on run these kernels (on) or NumPy's
    code (off): once per process, before the model is built."""
    global _on
    _on = bool(on)


def on():
    """Whether layers bound now run these kernels."""
    return _on


def available():
    """Whether numba can be imported (the direct kernels exist)."""
    try:
        vector_width.load()
    except ImportError:
        return False
    return True


def fits(out_channels):
    """Whether a layer with `out_channels` outputs has direct kernels here:
    16, 32 or 64 with AVX-512, 16 or 32 with AVX2 (the ones measured;
    other widths are fair shapes for a BLAS), none without either."""
    return tuning().fits(out_channels)


def _kernel(name, make, key, dtype, loop_vectorize=None):
    """The kernel make(*key, dtype) compiled for three C-contiguous 4-D
    arrays of dtype, once per process; key[0] is the channel count its
    register blocks run over (what the tuning row's tables are keyed by)."""
    full = (name, *key, np.dtype(dtype).str)
    if full not in _kernels:
        if loop_vectorize is None:
            loop_vectorize = tuning().loop_vectorize[key[0]]
        _kernels[full] = _compile(make, key, dtype, loop_vectorize)
    return _kernels[full]


def _forward_kernel(out, k, stride, dtype, width):
    row = tuning()
    pixels, channels, loop = row.forward_blocks(out, width)
    reuse = stride == 1 and row.reuse
    return _kernel("forward", _make_forward, (out, k, stride, pixels, channels, loop, reuse), dtype, loop)


def _compile(make, key, dtype, loop_vectorize):
    numba = vector_width.load()
    from numba.core import config
    stack()   # before the kernel compiles: it calls it
    array = numba.from_dtype(np.dtype(dtype))[:, :, :, ::1]
    options = dict(nogil=True, boundscheck=False, fastmath={"contract"}, error_model="numpy")
    slp, loop = config.SLP_VECTORIZE, config.LOOP_VECTORIZE
    config.SLP_VECTORIZE, config.LOOP_VECTORIZE = 1, int(loop_vectorize)
    try:
        fn = make(*key, np.dtype(dtype).type)
        try:
            return numba.njit(numba.void(array, array, array), cache=True, **options)(fn)
        except RuntimeError:   # no cache directory it can write: compile in memory
            return numba.njit(numba.void(array, array, array), **options)(fn)
    finally:
        config.SLP_VECTORIZE, config.LOOP_VECTORIZE = slp, loop


_stack = None


def stack():
    """The stack intrinsic (_make_stack), made once (it imports numba)."""
    global _stack
    if _stack is None:
        _stack = _make_stack()
    return _stack


def _make_stack():
    """An intrinsic: stack(dtype) is a pointer to STACK_ITEMS items on the
    stack (in the function's entry), which LLVM keeps in registers once the
    loops over them are unrolled. Module-level and one size: a kernel's
    closure holds only numbers and a dtype, which is what numba's disk
    cache hashes to find it again (a new object there would miss every
    time and add an entry)."""
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def stack(typingctx, dtype):
        item = dtype.dtype

        def codegen(context, builder, sig, args):
            return cgutils.alloca_once(builder, context.get_value_type(item),
                                       size=context.get_constant(types.intp, STACK_ITEMS))
        return types.CPointer(item)(dtype), codegen
    return stack


def _make_forward(O, K, S, PB, OB, LOOP, REUSE, dtype):
    """PB pixels a block, OB output channels a pass (W's columns for them
    stay in L1); LOOP, the loop vectorizer's setting, is in the closure too,
    which numba's disk cache hashes. REUSE (stride 1): each input value of
    a block's row is loaded once for the K kernel offsets that read it, its
    window terms then summed in the order (kh, c, kw), not (kh, kw, c)."""
    import numba
    if REUSE and S != 1:
        raise ValueError(f"the forward kernel reuses a row's input values at stride 1 only, not {S}")
    T = PB + K - 1   # REUSE: the input pixels a block's row reads

    def forward(xp, w, y):
        """y[b, i, j, :] = sum over (kh, kw, c) of xp[b, i*S+kh, j*S+kw, c] * w[kh, kw, c, :]."""
        n, oh, ow = y.shape[0], y.shape[1], y.shape[2]
        C = xp.shape[3]
        if LOOP is None:   # (never: LOOP is in the closure for the cache's key)
            return
        acc = numba.carray(_stack(dtype), (PB, OB))
        for b in range(n):
            for i in range(oh):
                for q0 in range(0, O, OB):
                    j0 = 0
                    while j0 < ow:
                        if ow >= PB and j0 + PB > ow:
                            # the row's last block overlaps the one before: those
                            # pixels again, the same sums (no narrow tail)
                            j0 = ow - PB
                        if j0 + PB <= ow:
                            for p in range(PB):
                                for q in range(OB):
                                    acc[p, q] = 0
                            if REUSE:
                                for kh in range(K):
                                    for c in range(C):
                                        for t in range(T):
                                            v = xp[b, i + kh, j0 + t, c]
                                            for kw in range(K):
                                                if 0 <= t - kw < PB:
                                                    for q in range(OB):
                                                        acc[t - kw, q] += v * w[kh, kw, c, q0 + q]
                            else:
                                for kh in range(K):
                                    for kw in range(K):
                                        for c in range(C):
                                            for p in range(PB):
                                                v = xp[b, i * S + kh, (j0 + p) * S + kw, c]
                                                for q in range(OB):
                                                    acc[p, q] += v * w[kh, kw, c, q0 + q]
                            for p in range(PB):
                                for q in range(OB):
                                    y[b, i, j0 + p, q0 + q] = acc[p, q]
                            j0 += PB
                        else:   # a row narrower than a block: one pixel at a time, the same order
                            for q in range(OB):
                                acc[0, q] = 0
                            if REUSE:
                                for kh in range(K):
                                    for c in range(C):
                                        for kw in range(K):
                                            v = xp[b, i + kh, j0 + kw, c]
                                            for q in range(OB):
                                                acc[0, q] += v * w[kh, kw, c, q0 + q]
                            else:
                                for kh in range(K):
                                    for kw in range(K):
                                        for c in range(C):
                                            v = xp[b, i * S + kh, j0 * S + kw, c]
                                            for q in range(OB):
                                                acc[0, q] += v * w[kh, kw, c, q0 + q]
                            for q in range(OB):
                                y[b, i, j0, q0 + q] = acc[0, q]
                            j0 += 1
    return forward


def _make_weight_gradient(O, K, S, C, dtype):
    import numba
    if C == 1:
        return _make_weight_gradient_rows(O, K, S, C, dtype)
    CB = min(tuning().channels[O], C)

    def weight_gradient(xp, dy, dw):
        """dw[kh, kw, c, :] = sum over (b, i, j) of xp[b, i*S+kh, j*S+kw, c] * dy[b, i, j, :].
        Image by image (one image's dy and input stay in L2 while every
        kernel offset and block of channels goes over them, not the whole
        batch's once per offset and block): each block's sums go on from
        where the image before left them in dw, so every sum still adds its
        terms in (b, i, j) order, the same bits as one pass."""
        n, oh, ow = dy.shape[0], dy.shape[1], dy.shape[2]
        acc = numba.carray(_stack(dtype), (CB, O))
        for b in range(n):
            for kh in range(K):
                for kw in range(K):
                    c0 = 0
                    while c0 < C:
                        block = CB if c0 + CB <= C else 1
                        if b == 0:
                            for r in range(CB):
                                for q in range(O):
                                    acc[r, q] = 0
                        else:
                            for r in range(block):
                                for q in range(O):
                                    acc[r, q] = dw[kh, kw, c0 + r, q]
                        for i in range(oh):
                            for j in range(ow):
                                if block == CB:
                                    for r in range(CB):
                                        v = xp[b, i * S + kh, j * S + kw, c0 + r]
                                        for q in range(O):
                                            acc[r, q] += v * dy[b, i, j, q]
                                else:
                                    v = xp[b, i * S + kh, j * S + kw, c0]
                                    for q in range(O):
                                        acc[0, q] += v * dy[b, i, j, q]
                        for r in range(block):
                            for q in range(O):
                                dw[kh, kw, c0 + r, q] = acc[r, q]
                        c0 += block
    return weight_gradient


def _make_weight_gradient_rows(O, K, S, C, dtype):
    """The weight gradient of a layer with one input channel (a first
    layer on grey images), where a block of channels at one kernel offset
    is one row of dw: one chain of dependent adds. Here blocks of R rows of
    dw viewed as (k*k*C, O), i.e. of kernel offsets; R the largest divisor
    of k*k*C up to the register block. Each sum still adds its terms in
    (b, i, j) order, image after image: the same bits as the kernel above.
    Measured on Intel (one thread, batch 32, ms): 28x28, 1 -> 16 channels
    3x3 0.37 -> 0.08 (R = 9), 1 -> 32 0.59 -> 0.28 (R = 3), 5x5 1 -> 16 1.05
    -> 0.30 (R = 5). Not for 3 channels and more: 3 -> 16 gained 1.8x but
    3 -> 32 and 64 nothing, and 5 -> 16 lost 1.5-6x (R = 5 to 15: a block
    across offsets whose start is not a constant)."""
    import numba
    R = max(r for r in range(1, tuning().channels[O] + 1) if (K * K * C) % r == 0)

    def weight_gradient(xp, dy, dw):
        n, oh, ow = dy.shape[0], dy.shape[1], dy.shape[2]
        acc = numba.carray(_stack(dtype), (R, O))
        dw2 = dw.reshape(K * K * C, O)
        for b in range(n):
            for r0 in range(0, K * K * C, R):
                for r in range(R):
                    for q in range(O):
                        acc[r, q] = 0 if b == 0 else dw2[r0 + r, q]
                for i in range(oh):
                    for j in range(ow):
                        for r in range(R):
                            kh, rest = divmod(r0 + r, K * C)
                            kw, c = divmod(rest, C)
                            v = xp[b, i * S + kh, j * S + kw, c]
                            for q in range(O):
                                acc[r, q] += v * dy[b, i, j, q]
                for r in range(R):
                    for q in range(O):
                        dw2[r0 + r, q] = acc[r, q]
    return weight_gradient


def _make_input_gradient(C, K, S, P, dtype):
    import numba
    PB = tuning().pixels[C]

    def input_gradient(dy, wt, dx):
        """dx[b, y, x, :] = the sum over (kh, kw, o), where y + P - kh = i * S
        and x + P - kw = j * S land on an output (i, j), of dy[b, i, j, o] *
        wt[kh, kw, o, :]: a strided layer's input gradient, gathered. A
        block is PB pixels of one row S apart (x, x + S, ...): the same kh
        and kw reach all of them, at consecutive outputs j."""
        n, h, w = dx.shape[0], dx.shape[1], dx.shape[2]
        oh, ow, O = dy.shape[1], dy.shape[2], dy.shape[3]
        acc = numba.carray(_stack(dtype), (PB, C))
        for b in range(n):
            for y in range(h):
                Y = y + P
                for first in range(S):
                    x = first
                    while x < w:
                        X = x + P
                        block = x + (PB - 1) * S < w
                        for kw in range(K):   # every pixel of the block reaches an output through kw
                            if block and (X - kw) % S == 0:
                                j = (X - kw) // S
                                block = j >= 0 and j + PB - 1 < ow
                        if block:
                            for t in range(PB):
                                for c in range(C):
                                    acc[t, c] = 0
                            for kh in range(K):
                                i = (Y - kh) // S
                                if (Y - kh) % S == 0 and 0 <= i < oh:
                                    for kw in range(K):
                                        if (X - kw) % S == 0:
                                            j = (X - kw) // S
                                            for o in range(O):
                                                for t in range(PB):
                                                    v = dy[b, i, j + t, o]
                                                    for c in range(C):
                                                        acc[t, c] += v * wt[kh, kw, o, c]
                            for t in range(PB):
                                for c in range(C):
                                    dx[b, y, x + t * S, c] = acc[t, c]
                            x += PB * S
                        else:   # one pixel, each output checked
                            for c in range(C):
                                acc[0, c] = 0
                            for kh in range(K):
                                i = (Y - kh) // S
                                if (Y - kh) % S == 0 and 0 <= i < oh:
                                    for kw in range(K):
                                        j = (X - kw) // S
                                        if (X - kw) % S == 0 and 0 <= j < ow:
                                            for o in range(O):
                                                v = dy[b, i, j, o]
                                                for c in range(C):
                                                    acc[0, c] += v * wt[kh, kw, o, c]
                            for c in range(C):
                                dx[b, y, x, c] = acc[0, c]
                            x += S
    return input_gradient


def input_gradient(dy, wt, dx, stride, pad):
    """dx (n, h, w, C) of dy (n, oh, ow, O) and wt (k, k, O, C): W with its
    channel axes swapped; any stride, the unpadded input's gradient."""
    k, c = wt.shape[0], wt.shape[3]
    _kernel("input_gradient", _make_input_gradient, (c, k, stride, pad), dy.dtype)(dy, wt, dx)


def forward(xp, w, y, stride):
    """y (n, oh, ow, O) from the padded input xp (n, H, W, C) and w (k, k, C, O), all C-contiguous."""
    k, out, width = w.shape[0], w.shape[3], y.shape[2]
    kernel = _by_width.get((out, k, stride, y.dtype, width))
    if kernel is None:
        kernel = _by_width[out, k, stride, y.dtype, width] = _forward_kernel(out, k, stride, y.dtype, width)
    kernel(xp, w, y)


_by_width = {}   # forward's kernels by (out, k, stride, dtype, width): the step's lookups, one dict


def weight_gradient(xp, dy, dw, stride):
    """dw (k, k, C, O) of the padded input xp (n, H, W, C) and dy (n, oh, ow, O): the sum over these images."""
    k, c, out = dw.shape[0], dw.shape[2], dw.shape[3]
    _kernel("weight_gradient", _make_weight_gradient, (out, k, stride, c), dy.dtype)(xp, dy, dw)


def prepare_conv(k, stride, pad, in_channels, out_channels, dtype, input_gradient, in_width, out_width):
    """Compile (or load from numba's cache) a convolution's kernels before
    its first step; input_gradient: "turned" (stride 1: the forward kernel
    over dy padded), "gathered" (input_gradient) or None (im2col's); the
    input's and output's widths in pixels."""
    _forward_kernel(out_channels, k, stride, dtype, out_width)
    _kernel("weight_gradient", _make_weight_gradient, (out_channels, k, stride, in_channels), dtype)
    if input_gradient == "turned":
        _forward_kernel(in_channels, k, 1, dtype, in_width)
    elif input_gradient == "gathered":
        _kernel("input_gradient", _make_input_gradient, (in_channels, k, stride, pad), dtype)
