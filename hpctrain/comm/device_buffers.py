"""Device arrays through MPI, outside the gradient allreduce: one buffer for
Send/Recv/Bcast (`HostMirror`, `bcast`: the initial parameter broadcast, and
the parameter-server loop when it runs on a GPU), and `BoundToDevice`, which
makes a strategy's calls run on this rank's GPU from any thread.

For NumPy arrays everything here is the array itself, no copies; the staged
logic runs on CPU with a stand-in copier, which is how it is tested:

    python -m pytest -q tests/test_device_buffers.py
    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_device_buffers.py
"""
from ..base import device
from .strategy import WrappedStrategy


class BoundToDevice(WrappedStrategy):
    """A strategy whose calls run with this rank's CUDA device current in the
    calling thread (fusion's communication thread starts on device 0). Same
    interface as the strategy it wraps; `path` says how buffers reach MPI."""

    def __init__(self, inner, xp, path=""):
        super().__init__(inner)
        self.xp = xp
        self.device_id = device.current_device(xp)
        self.name = inner.name
        self.path = path

    def allreduce(self, buf):
        device.use_device(self.xp, self.device_id)
        return self.inner.allreduce(buf)

    def reduce_scatter(self, buf):
        device.use_device(self.xp, self.device_id)
        return self.inner.reduce_scatter(buf)

    def allgather(self, buf):
        device.use_device(self.xp, self.device_id)
        return self.inner.allgather(buf)


class HostMirror:
    """What MPI should read and write for one (contiguous) array.

    NumPy array: the array itself, no copies. CuPy array with direct=True
    (CUDA-aware MPI): the device array, after a stream synchronize. CuPy
    otherwise: a pinned host copy, allocated once.

        m = HostMirror(grads)                        # once
        comm.Send(m.to_host(), dest)                 # device -> host, then send
        comm.Recv(m.recv_buffer(), source)           # receive into the host copy ...
        m.to_device()                                # ... and copy it to the device

    to_host() returns when the data is on the host (safe to Send). to_device()
    is asynchronous but ordered before later compute on the current stream;
    recv_buffer() waits until the last to_device() has read the host copy.
    A `copier` given explicitly forces staging through it (with
    device.HostCopier and a NumPy array, the CPU tests of this logic).
    """

    def __init__(self, array, direct=False, copier=None):
        self.array = array
        self.xp = device.array_module(array)
        if not array.flags.c_contiguous:
            raise ValueError("HostMirror needs a contiguous array")
        self.staged = copier is not None or (device.is_gpu(self.xp) and not direct)
        self._back = None
        if self.staged:
            self.copier = copier or device.copier(self.xp)
            self.host = self.copier.host_empty(array.shape, array.dtype)
        else:
            self.copier = None
            self.host = array

    def to_host(self):
        if self.staged:
            self.copier.wait(self.copier.to_host(self.array, self.host, after=self.copier.mark()))
        else:
            device.synchronize(self.xp)
        return self.host

    def recv_buffer(self):
        if self.staged:
            self.copier.wait(self._back)
            self._back = None
        else:
            device.synchronize(self.xp)  # pending kernels may still read the array
        return self.host

    def to_device(self):
        if self.staged:
            # after=mark(): kernels queued before still read the old values
            self._back = self.copier.to_device(self.host, self.array, after=self.copier.mark())
            self.copier.use(self._back)
        return self.array

    def wait(self):
        """Block until no copy reads the host buffer any more: call it before
        dropping a mirror whose to_device() may still run (CuPy's pinned pool
        may hand the memory out again at once)."""
        if self.staged:
            self.copier.wait(self._back)
            self._back = None


def bcast(comm, array, root=0):
    """comm.Bcast of an xp array from root, through host memory for CuPy (a
    one-off at start-up: always staged, so it is safe on any MPI)."""
    mirror = HostMirror(array)
    comm.Bcast(mirror.to_host() if comm.Get_rank() == root else mirror.recv_buffer(), root=root)
    if comm.Get_rank() != root:
        mirror.to_device()
        mirror.wait()   # the mirror's pinned buffer is freed on return
    return array
