"""The array module for this rank: NumPy on CPU, CuPy on a GPU; and the few
device-memory primitives the rest of hpctrain builds on.

Code that computes takes `xp` and never imports numpy/cupy directly for its
math, so the same model and optimizer run on either. Before MPI reads a CuPy
buffer, the stream that wrote it must be synchronized: `synchronize(xp)`.

Copies between host and device go through a `Copier` (`copier(xp)`): pinned
host memory, asynchronous copies on their own CUDA streams, and events that
order them against the compute stream without blocking the host. For NumPy
the same interface copies synchronously, so code written against it
(comm/staged.py, comm/device_buffers.py, prefetch.py) runs, and is tested, on CPU.

CuPy is imported as `cupy`, whichever wheel provides it (cupy-cuda11x,
cupy-cuda12x, cupy-cuda13x, ...); nothing here depends on the CUDA version.

    python -m hpctrain.base.device        # prints what --device auto would pick
"""
import numpy as np

from .errors import HpctrainError


CUPY_MISSING = "CuPy is not installed"
# Said only where a GPU was asked for: a CPU run (auto) needs no CuPy.
CUPY_HINT = " (pip install cupy-cuda12x, or the cupy-cuda1Xx matching your CUDA)"


def _cupy_or_reason():
    """(cupy module, None) when a CUDA GPU is usable, else (None, why not)."""
    try:
        import cupy
    except ImportError:
        return None, CUPY_MISSING
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
        raise HpctrainError(f"--device gpu: {why}" + (CUPY_HINT if why == CUPY_MISSING else ""))
    return np, "cpu", f"--device auto: {why}"


def is_gpu(xp):
    return xp is not np


def array_module(array):
    """numpy or cupy, whichever `array` belongs to (CuPy is imported only for
    arrays that are not NumPy's, so CPU runs never load it)."""
    if isinstance(array, np.ndarray):
        return np
    import cupy
    return cupy.get_array_module(array)


def synchronize(xp):
    """Wait for the current stream, so MPI sees fully written device memory."""
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def to_host(array):
    """A NumPy array for any xp array (no copy for NumPy)."""
    if isinstance(array, np.ndarray):
        return array
    return array.get()


def all_finite(array):
    """Whether every value of an array (NumPy or CuPy) is finite: its min and
    max (a NaN wins both), no array of its size made."""
    if not array.size:
        return True
    return bool(np.isfinite(float(array.min())) and np.isfinite(float(array.max())))


def current_device(xp):
    """The CUDA device id this thread computes on (None for NumPy)."""
    return None if xp is np else xp.cuda.runtime.getDevice()


def use_device(xp, device_id):
    """Make the calling thread compute on `device_id`. The current CUDA device
    is per host thread: a thread that hpctrain starts (the fused-allreduce
    communication thread) begins on device 0 whatever the main thread chose.
    A no-op for NumPy, and cheap when the device is already current."""
    if xp is not np and device_id is not None and xp.cuda.runtime.getDevice() != device_id:
        xp.cuda.runtime.setDevice(device_id)


class Scratch:
    """Scratch arrays by (name, array module), each grown on demand and kept:
    a warm step allocates none. get() gives the first n elements; one
    thread at a time uses an instance."""

    def __init__(self):
        self.arrays = {}

    def get(self, name, xp, dtype, n):
        key = (name, xp.__name__)
        a = self.arrays.get(key)
        if a is None or a.size < n:
            a = self.arrays[key] = xp.empty(max(n, 1), dtype)
        return a[:n]


def pinned_empty(shape, dtype):
    """An uninitialized NumPy array in page-locked (pinned) host memory, which
    the GPU's copy engines can read and write asynchronously."""
    import cupy
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    count = int(np.prod(shape, dtype=np.int64))
    mem = cupy.cuda.alloc_pinned_memory(max(count, 1) * dtype.itemsize)
    return np.ndarray(shape, dtype, buffer=mem)  # the array keeps `mem` alive


# ---------------------------------------------------------------------------
# ordering work between host threads' streams

class HostMarks:
    """The Marks interface for NumPy, where work is done when the call
    returns: every token is None and nothing waits."""

    def bind_thread(self):
        """Make the calling thread work on the device these marks belong to."""

    def mark(self):
        """A token for 'everything the calling thread's stream has been given so far'."""
        return None

    def use(self, token):
        """Make the calling thread's stream wait for `token` (the host does not block)."""


class CudaMarks(HostMarks):
    """Tokens are CUDA events recorded on the calling thread's current stream.

    Two host threads may compute on two streams: with CuPy's per-thread
    default streams (CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1) or a stream made
    current with `with stream:`, nothing orders one thread's kernels after
    the other's, as the legacy default stream does. A mark handed from one
    thread to the other and `use`d there does, without blocking either host
    thread (comm/fusion.py: backprop -> communication thread -> next step)."""

    def __init__(self, cupy):
        self.cp = cupy
        self.device_id = current_device(cupy)

    def bind_thread(self):
        # A new host thread starts on device 0: its current stream, and the
        # events recorded there, must be those of this rank's device.
        use_device(self.cp, self.device_id)

    def _event(self):
        return self.cp.cuda.Event(block=False, disable_timing=True)

    def mark(self):
        ev = self._event()
        ev.record(self.cp.cuda.get_current_stream())
        return ev

    def use(self, token):
        if token is not None:
            self.cp.cuda.get_current_stream().wait_event(token)


def stream_marks(xp):
    """The Marks for arrays of module xp: CudaMarks for CuPy, HostMarks for NumPy."""
    return HostMarks() if xp is np else CudaMarks(xp)


# ---------------------------------------------------------------------------
# copies between host and device

class HostCopier(HostMarks):
    """The Copier interface for NumPy arrays standing in for device arrays:
    copies happen at once and every token is None. CPU runs and the CPU tests
    of the staging and prefetch logic use it."""

    def host_empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def device_empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def to_host(self, dev, host, after=None):
        """Start copying dev -> host (after the token `after`); returns a token."""
        np.copyto(host, dev)
        return None

    def to_device(self, host, dev, after=None):
        """Start copying host -> dev (after the token `after`); returns a token."""
        np.copyto(dev, host)
        return None

    def wait(self, token):
        """Block the host until the copy behind `token` is done."""


class CudaCopier(CudaMarks):
    """Copies on two non-blocking CUDA streams of the current device, one per
    direction, so a device-to-host copy, a host-to-device copy and compute can
    all run at once. Tokens are CUDA events. Host buffers must be pinned
    (host_empty) for the copies to be asynchronous.

    Non-blocking streams do not synchronize with CUDA's legacy default stream
    (where CuPy computes unless told otherwise); every ordering between copies
    and compute is therefore explicit: `after=mark()` before a copy reads what
    compute wrote, `use(token)` before compute reads what a copy wrote."""

    def __init__(self, cupy):
        self.cp = cupy
        self.device_id = None   # made on the calling thread's device; bind_thread() leaves threads alone
        self.d2h = cupy.cuda.Stream(non_blocking=True)
        self.h2d = cupy.cuda.Stream(non_blocking=True)
        rt = cupy.cuda.runtime
        self._memcpy, self._D2H, self._H2D = rt.memcpyAsync, rt.memcpyDeviceToHost, rt.memcpyHostToDevice

    def host_empty(self, shape, dtype):
        return pinned_empty(shape, dtype)

    def device_empty(self, shape, dtype):
        return self.cp.empty(shape, dtype)

    def _copy(self, dst_ptr, src_ptr, nbytes, kind, stream, after):
        if after is not None:
            stream.wait_event(after)
        if nbytes:
            self._memcpy(dst_ptr, src_ptr, nbytes, kind, stream.ptr)
        ev = self._event()
        ev.record(stream)
        return ev

    def to_host(self, dev, host, after=None):
        _check_pair(dev, host)
        return self._copy(host.ctypes.data, dev.data.ptr, dev.nbytes, self._D2H, self.d2h, after)

    def to_device(self, host, dev, after=None):
        _check_pair(dev, host)
        return self._copy(dev.data.ptr, host.ctypes.data, dev.nbytes, self._H2D, self.h2d, after)

    def wait(self, token):
        if token is not None:
            token.synchronize()


def _check_pair(dev, host):
    # Raw memcpy of whole buffers: both sides must be contiguous and the same size.
    if dev.nbytes != host.nbytes or not (dev.flags.c_contiguous and host.flags.c_contiguous):
        raise ValueError(f"copy between {dev.shape} {dev.dtype} and {host.shape} {host.dtype}: "
                         "need contiguous buffers of equal size")


def copier(xp):
    """The Copier for arrays of module xp: CudaCopier for CuPy, HostCopier for NumPy."""
    return HostCopier() if xp is np else CudaCopier(xp)


if __name__ == "__main__":
    xp, name, note = select("auto")
    print(f"device: {name} ({note})")
