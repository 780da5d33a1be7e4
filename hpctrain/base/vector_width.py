"""The vector registers numba compiles the compiled layers for (nn/compiled.py).

LLVM tunes Intel's AVX-512 CPUs (Skylake-SP to Sapphire Rapids, its
"prefer-256-bit") to vectorize with 256-bit registers even where 512-bit
ones exist, so numba's kernels for the compiled layers used ymm registers
only: half their width, and twice the instructions. Measured on an Intel
Xeon with AVX-512 (LLVM names it rocketlake), one thread, batch 32, GFLOP/s
of the 3x3 kernels, 256-bit (LLVM's choice) -> 512-bit: weight gradient
16->16 channels 81 -> 115, 32->32 77 -> 124, 64->32 55 -> 81, 32->64 56
-> 70; forward 16->16 100 -> 112, 32->32 101 -> 115 (32->64 unchanged,
about 87). AMD's Zen 4 is not tuned that way: nothing changes there. So,
as numba loads (it reads the variable then), where the CPU has AVX-512, its
row of hpctrain/base/tuning.py says `wide_vectors` (every AVX-512 row does) and
NUMBA_CPU_FEATURES is not set, it is set to the CPU's own features with
-prefer-256-bit. The bits do not change: each output channel is its own
vector lane, summed in the same order at any width. A variable you set
yourself is left alone.

Every place in hpctrain that imports numba does it through load(), so
LLVM's library (about 44 MB resident) is loaded only in a process that
loads numba anyway: not at start-up, where the memory check counts what a
rank holds before its model.

    python -c "import os; from hpctrain.base import vector_width as v; print(v.configure(dict(os.environ)))"
"""
import importlib.util
import os
import sys

from .tuning import tuning_for, vendor_of

FEATURES = "NUMBA_CPU_FEATURES"


def configure(env):
    """Set env's NUMBA_CPU_FEATURES as above (call before numba is
    imported: it reads it once). Returns a note for the log, or ""."""
    if FEATURES in env or importlib.util.find_spec("llvmlite") is None:
        return ""
    try:
        import llvmlite.binding as llvm   # LLVM itself, ~50 ms; no NumPy
        features, name = llvm.get_host_cpu_features().flatten(), llvm.get_host_cpu_name()
    except Exception:   # a host LLVM cannot describe: numba's own defaults
        return ""
    if "+avx512f" not in features.split(",") or not tuning_for("avx512", vendor_of(name)).wide_vectors:
        return ""
    env[FEATURES] = features + ",-prefer-256-bit"
    return "compiled layers: 512-bit vectors"


def load():
    """numba, imported after configure(os.environ) (ImportError where it is
    not installed)."""
    if "numba" not in sys.modules:
        configure(os.environ)
    import numba
    return numba


def wide():
    """Whether this process set the 512-bit vectors (for the start-up line)."""
    return os.environ.get(FEATURES, "").endswith(",-prefer-256-bit")
