"""Which library computes the layers' matrix products on the CPU (`--blas`):
NumPy's own BLAS (the default; OpenBLAS in NumPy's wheels) or Intel MKL's
cblas_sgemm and cblas_dgemm (`--blas mkl`, `pip install 'hpctrain[mkl]'`,
or conda's mkl), called here through ctypes. Dense layers, attention's
projections and the im2col convolutions take their 2-D products from
`matmul`; attention's small per-head products stay NumPy's (MKL's batched
call measured no faster on them). `configure` once a process, before the
model is built (run/startup.py; bench compare hands the flag on).

Why: on an Intel CPU, MKL's SGEMM is 1.07-1.19x OpenBLAS's at the GPT
recipe's shapes on one thread (768x128 @ 128x512 and its transposes;
docs/benchmarks.md), and PyTorch's products are MKL's.

Bits: MKL on one thread (its sequential layer: hpctrain's compute threads
and ranks are the parallelism) sums each output in its own order, which is
OpenBLAS's at some shapes and not at others (a 1024^3 product differs in
the last bits), so `--blas mkl` is an opt-in with its own results; they do
not depend on the compute threads (a product's rows are cut in whole row
tiles, as for OpenBLAS) nor on the rank count. MKL's choice of kernels
follows the CPU, as OpenBLAS's does: ranks on another CPU model may round
otherwise (MKL_CBWR pins a branch; MKL reads it itself).

    python -m hpctrain.mnist --data PLAYS --model gpt:layers=4,heads=4,width=128 --blas mkl
    python -m pytest -q tests/test_blas.py
"""
import ctypes
import glob
import os
import sys

import numpy as np

from ..base.errors import HpctrainError

# cblas enums (mkl_cblas.h) and mkl_rt's layer switches (mkl_service.h)
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
INTERFACE_LP64, THREADING_SEQUENTIAL = 0, 1
INT_MAX = 2 ** 31 - 1

_gemm = None   # MKL's, once configure("mkl") has loaded it; None: NumPy's


def library_paths():
    """Where libmkl_rt may be: the `mkl` wheel's files (its lib/ under the
    environment's prefix), conda's and the system's library folders, and
    the loader's own search (LD_LIBRARY_PATH, ld.so.cache)."""
    found = []
    try:
        from importlib.metadata import PackageNotFoundError, distribution
        dist = distribution("mkl")
        found += [str(dist.locate_file(f)) for f in dist.files or () if "libmkl_rt.so" in f.name]
    except (ImportError, PackageNotFoundError):
        pass
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix, os.environ.get("MKLROOT", ""))):
        if prefix:
            found += sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")), reverse=True)
    return found + ["libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so"]


def load_mkl():
    """libmkl_rt, set to 32-bit integers and one thread a call, or an error line."""
    for path in dict.fromkeys(library_paths()):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        # Before any other MKL call: LP64 (our ints are C ints) and the
        # sequential layer (MKL's own threads would fight ours for the cores)
        lib.MKL_Set_Interface_Layer(INTERFACE_LP64)
        lib.MKL_Set_Threading_Layer(THREADING_SEQUENTIAL)
        return lib
    raise HpctrainError("--blas mkl: Intel MKL's libmkl_rt was not found (pip install 'hpctrain[mkl]', or conda's "
                        "mkl; or MKLROOT); or use --blas numpy")


def available():
    """Whether libmkl_rt loads here (--blas mkl can run)."""
    try:
        load_mkl()
    except HpctrainError:
        return False
    return True


def _layout(x):
    """(transpose flag, leading dimension) of a 2-D float array as a row-major
    BLAS operand, or None where its strides are no BLAS matrix (a step
    between columns, negative, zero or overlapping strides)."""
    rows, cols = x.shape
    s0, s1 = x.strides
    item = x.itemsize
    if s0 <= 0 or s1 <= 0 or s0 % item or s1 % item:
        return None
    if s1 == item and s0 >= item * cols:
        return NO_TRANS, s0 // item
    if s0 == item and s1 >= item * rows:
        return TRANS, s1 // item
    return None


class MKLProducts:
    """out = a @ b by cblas_?gemm where the operands are BLAS matrices of one
    float dtype and out does not overlap them; `__call__` says whether it did."""

    def __init__(self, lib):
        text = ctypes.create_string_buffer(200)
        lib.MKL_Get_Version_String(text, len(text))
        # "Intel(R) oneAPI Math Kernel Library Version 2026.2-Product Build 20260915", less " for Intel(R) 64 ..."
        self.version = text.value.decode(errors="replace").split(" for ")[0].strip()
        argtypes = [ctypes.c_int] * 6
        ptr, c_int = ctypes.c_void_p, ctypes.c_int
        self.fns = {}
        for dtype, name, scalar in ((np.float32, "cblas_sgemm", ctypes.c_float),
                                    (np.float64, "cblas_dgemm", ctypes.c_double)):
            fn = getattr(lib, name)
            fn.argtypes = argtypes + [scalar, ptr, c_int, ptr, c_int, scalar, ptr, c_int]
            fn.restype = None
            self.fns[np.dtype(dtype)] = (fn, scalar(1.0), scalar(0.0))

    def __call__(self, a, b, out):
        if not (type(a) is type(b) is type(out) is np.ndarray and a.ndim == b.ndim == out.ndim == 2):
            return False
        entry = self.fns.get(out.dtype)
        if entry is None or a.dtype != out.dtype or b.dtype != out.dtype:
            return False
        (m, k), n = a.shape, b.shape[1]
        if b.shape[0] != k or out.shape != (m, n) or k == 0 or max(m, n, k) > INT_MAX:
            return False
        la, lb, lo = _layout(a), _layout(b), _layout(out)
        if la is None or lb is None or lo is None or lo[0] != NO_TRANS or not out.flags.writeable:
            return False
        if np.may_share_memory(out, a) or np.may_share_memory(out, b):
            return False
        fn, one, zero = entry
        # ctypes lets go of the GIL for the call: compute threads multiply at once
        fn(ROW_MAJOR, la[0], lb[0], m, n, k, one, a.ctypes.data, la[1], b.ctypes.data, lb[1],
           zero, out.ctypes.data, lo[1])
        return True


def configure(name):
    """Use `name`'s products from now on: "numpy" or "mkl" (loaded here:
    HpctrainError where it cannot be). Returns the name in force."""
    global _gemm
    _gemm = MKLProducts(load_mkl()) if name == "mkl" else None
    return name if name == "mkl" else "numpy"


def name():
    """The products' library in force: "mkl" or "numpy"."""
    return "numpy" if _gemm is None else "mkl"


def line():
    """The start-up line of a run whose products are MKL's (the library
    that loaded, as it names itself), or None for NumPy's."""
    return None if _gemm is None else f"matrix products: {_gemm.version}, one thread a call (--blas mkl)"


def matmul(xp, a, b, out):
    """out = a @ b: MKL's where configured and it takes the operands, else xp's (NumPy or CuPy)."""
    if _gemm is None or not _gemm(a, b, out):
        xp.matmul(a, b, out=out)
    return out
