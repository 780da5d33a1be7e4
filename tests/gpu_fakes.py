"""Stand-ins for CUDA on NumPy, shared by the tests of the GPU plumbing that
runs without a GPU (test_staged.py, test_device_buffers.py, test_gpu_on_cpu.py).

LazyCopier models CUDA streams on NumPy: a copy runs only when something
waits for it (or for a later copy on its stream), and fresh buffers are NaN,
so a missing wait or use() shows up as wrong numbers, not as luck. FakeCupy
(fake_cupy) goes one level lower: device.CudaCopier itself runs against it,
its raw memcpyAsync calls deferred per stream until an event or stream says
so. These check hpctrain's ordering logic and pointer arithmetic, not CUDA:
tests/test_gpu.py does that on a GPU.

fake_cupy(per_thread=True) gives each host thread its own current stream, as
CuPy does with CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1: "kernels" that a test
queues there (`launch`) run only when that stream is synchronized or an
event behind them is waited for, so work on two threads is ordered only by
the events hpctrain hands between them (comm/fusion.py). Every stream
records which threads synchronized it (`synced_by`). KernelUpdate is the
data-parallel update as comm/fusion.FusedAllreduce drives it, with the
update a kernel of the test's own.
"""
import ctypes
import sys
import threading
import types

import numpy as np
import pytest

from hpctrain.base import device


class KernelUpdate:
    """What comm/fusion.FusedAllreduce asks of comm/data_parallel.DataParallelUpdate,
    over one buffer `grads` cut into `buckets`: each bucket summed by
    `strategy` (a stand-in's allreduce), then `kernel(lo, hi)` in place of
    the optimizer (a test queues it on the calling thread's stream).
    Neither sharded (nor its gradient) nor deferred."""
    sharded = deferred = shard_grads = False

    def __init__(self, strategy, grads, buckets, kernel):
        self.strategy, self.kernel = strategy, kernel
        self.parts = [types.SimpleNamespace(grads=grads, params=grads, buckets=buckets, owned=buckets)]

    def reduce(self, k, i):
        lo, hi = self.parts[k].buckets[i]
        self.strategy.allreduce(self.parts[k].grads[lo:hi])

    def update(self, k, i):
        self.kernel(*self.parts[k].buckets[i])

    def sent_bytes(self, k, i):
        lo, hi = self.parts[k].buckets[i]
        return (hi - lo) * self.parts[k].grads.itemsize


class LazyCopier(device.HostCopier):
    """device.HostCopier with CUDA's freedom: each direction is a stream whose
    copies run as late as allowed (when waited for, or when a later copy on
    the same stream is)."""

    def __init__(self):
        self.queues = {"d2h": [], "h2d": []}
        self.copies = 0

    def host_empty(self, shape, dtype):
        return np.full(shape, np.nan, dtype) if np.dtype(dtype).kind == "f" else np.full(shape, -7, dtype)

    device_empty = host_empty

    def _enqueue(self, stream, dst, src):
        token = (stream, object())
        self.queues[stream].append((token, dst, src))
        return token

    def to_host(self, dev, host, after=None):
        return self._enqueue("d2h", host, dev)

    def to_device(self, host, dev, after=None):
        return self._enqueue("h2d", dev, host)

    def wait(self, token):
        if token is None:
            return
        queue = self.queues[token[0]]
        while queue:
            tok, dst, src = queue.pop(0)
            np.copyto(dst, src)
            self.copies += 1
            if tok is token:
                return

    use = wait  # NumPy 'compute' is synchronous: waiting in the stream = waiting now

    def idle(self):
        return not any(self.queues.values())


class Scale:
    """A stand-in allreduce of 'size' 2 for serial tests: h = 3h + 1, chunk lengths recorded."""
    size = 2
    name = "scale"

    def __init__(self):
        self.lengths = []

    def allreduce(self, h):
        self.lengths.append(h.size)
        h *= 3
        h += 1
        return h


# One device runs every stream's work, one op at a time (re-entrant: an op
# may wait for an event on another stream, which runs that stream's work).
_DEVICE = threading.RLock()


class FakeStream:
    """A CUDA stream whose work (copies) runs only when someone waits for it.
    The null stream stands for compute, which NumPy does at once."""
    registry = {}

    def __init__(self, null=False, non_blocking=False):
        self.null, self.queue, self.done = null, [], 0
        self.synced_by = []
        self.ptr = 0 if null else id(self)
        FakeStream.registry[self.ptr] = self

    def run_until(self, n):
        with _DEVICE:
            while self.done < n:
                op = self.queue[self.done]
                self.done += 1
                op()

    def synchronize(self):
        self.synced_by.append(threading.current_thread().name)
        self.run_until(len(self.queue))

    def wait_event(self, event):
        if self.null:
            event.synchronize()
        else:  # later work on this stream waits for the event's work
            self.queue.append(event.synchronize)


class FakeEvent:
    def __init__(self, block=False, disable_timing=False):
        self.stream, self.pos = None, 0

    def record(self, stream=None):
        self.stream, self.pos = stream, len(stream.queue)

    def synchronize(self):
        if self.stream is not None:
            self.stream.run_until(self.pos)


class DevArray(np.ndarray):
    """NumPy memory posing as device memory: .data.ptr, as CuPy has."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


def launch(cupy, kernel):
    """Queue `kernel()` (a Python function standing for a CUDA kernel) on
    the calling thread's current stream of a fake_cupy."""
    cupy.cuda.get_current_stream().queue.append(kernel)


def fake_cupy(per_thread=False):
    null = FakeStream(null=True)
    local = threading.local()

    def current_stream():
        if not per_thread:
            return null
        if not hasattr(local, "stream"):
            local.stream = FakeStream(non_blocking=True)
        return local.stream

    def memcpy_async(dst, src, size, kind, stream_ptr):
        assert kind in (1, 2) and size > 0
        FakeStream.registry[stream_ptr].queue.append(lambda: ctypes.memmove(dst, src, size))
        if stream_ptr == 0:
            FakeStream.registry[0].synchronize()

    runtime = types.SimpleNamespace(memcpyAsync=memcpy_async, memcpyHostToDevice=1, memcpyDeviceToHost=2,
                                    getDevice=lambda: 0, setDevice=lambda i: None)
    cuda = types.SimpleNamespace(Stream=FakeStream, Event=FakeEvent, runtime=runtime,
                                 get_current_stream=current_stream,
                                 alloc_pinned_memory=lambda nbytes: bytearray(nbytes))

    def empty(shape, dtype):
        return np.full(shape, np.nan if np.dtype(dtype).kind == "f" else -7, dtype).view(DevArray)
    return types.SimpleNamespace(cuda=cuda, empty=empty, __name__="cupy")


@pytest.fixture
def cudacopier(monkeypatch):
    fake = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)  # device.pinned_empty imports it
    return lambda: device.CudaCopier(fake)


@pytest.fixture
def threadstreams(monkeypatch):
    """A fake_cupy with a stream per host thread, installed as `cupy`."""
    fake = fake_cupy(per_thread=True)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    return fake

