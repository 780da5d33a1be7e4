"""The array module for this rank: NumPy on CPU, CuPy on a GPU.

Code that computes takes `xp` and never imports numpy/cupy directly for its
math, so the same model and optimizer run on either. Before MPI reads a CuPy
buffer, the stream that wrote it must be synchronized: `synchronize(xp)`.

    python -m hpctrain.device        # prints what --device auto would pick
"""
import numpy as np

from .errors import HpctrainError


def _cupy_or_reason():
    """(cupy module, None) when a CUDA GPU is usable, else (None, why not)."""
    try:
        import cupy
    except ImportError:
        return None, "CuPy is not installed (pip install 'hpctrain[gpu]')"
    except Exception as exc:  # a broken CUDA install raises all sorts
        return None, f"CuPy failed to import: {exc}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return None, f"CuPy sees no CUDA device ({exc.__class__.__name__}: {exc})"
    if count < 1:
        return None, "CuPy sees no CUDA device"
    return cupy, None


def select(device):
    """Resolve --device cpu|gpu|auto to (xp, name, note). `note` says why, for the log."""
    if device == "cpu":
        return np, "cpu", "--device cpu"
    cupy, why = _cupy_or_reason()
    if cupy is not None:
        return cupy, "gpu", f"CUDA device {cupy.cuda.runtime.getDevice()}"
    if device == "gpu":
        raise HpctrainError(f"--device gpu: {why}")
    return np, "cpu", f"--device auto fell back to CPU: {why}"


def is_gpu(xp):
    return xp is not np


def synchronize(xp):
    """Wait for the current stream, so MPI sees fully written device memory."""
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def to_host(array):
    """A NumPy array for any xp array (no copy for NumPy)."""
    if isinstance(array, np.ndarray):
        return array
    return array.get()


if __name__ == "__main__":
    xp, name, note = select("auto")
    print(f"device: {name} ({note})")
