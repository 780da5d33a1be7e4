"""The handle a tensor-parallel layer's collectives go through
(nn/tensor_parallel.TensorGroup.comm): in-place sums, maxima and minima
over the mesh's tensor axis (run/mesh.py: the T ranks that split one
layer), each one MPI Allreduce under the watchdog's deadline, so a tensor
rank that stalls mid-layer is named within --timeout by its coordinates
(the watchdog names ranks by the mesh). On a GPU the array goes through
the host (CUDA-aware MPI or NCCL would skip the copy: not yet measured on
a device). Blocking, on the calling thread: forward and backward wait for
it, as Megatron's layers wait for theirs.

    mpirun -n 2 python -m mpi4py -m pytest -q --only-mpi tests/test_tensor_parallel.py
"""
import numpy as np
from mpi4py import MPI

from ..base import device
from .strategy import waiting


class TensorComm:
    """comm: the tensor axis's communicator; watchdog: the run's (None: no
    deadline, for tests); xp: where the layers' arrays live."""

    def __init__(self, comm, watchdog=None, xp=np):
        self.comm, self.watchdog, self.xp = comm, watchdog, xp
        self.calls = 0   # allreduces so far (the tests count them: two a transformer block forward)
        self._buffers = {}   # the sequence-parallel host buffers, one per (use, shape, dtype): a warm step allocates none

    def _buffer(self, use, shape, dtype):
        key = (use, tuple(shape), np.dtype(dtype))
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = np.empty(shape, dtype)
        return buf

    def sum(self, a):
        self._allreduce(a, MPI.SUM, "sum")

    def max(self, a):
        self._allreduce(a, MPI.MAX, "max")

    def min(self, a):
        self._allreduce(a, MPI.MIN, "min")

    def reduce_scatter(self, full, out):
        """--sequence-parallel: `full` (n, t, ...) partial sums over the group
        into `out` (n, t / T, ...), this rank's positions of the sum."""
        self.calls += 1
        size, (n, t) = self.comm.Get_size(), full.shape[:2]
        host = device.to_host(full) if self.xp is not np else full
        by_rank = host.reshape(n, size, t // size, *host.shape[2:]).swapaxes(0, 1)   # rank r's positions at [r]
        blocks = self._buffer("blocks", by_rank.shape, host.dtype)
        np.copyto(blocks, by_rank)
        mine = self._buffer("mine", out.shape, host.dtype) if self.xp is not np or not out.flags.c_contiguous else out
        with waiting(self.watchdog, f"tensor-parallel reduce-scatter of {host.size} values over {size} tensor ranks"):
            self.comm.Reduce_scatter_block(blocks, mine, op=MPI.SUM)
        if mine is not out:
            out[...] = self.xp.asarray(mine)

    def allgather(self, part, out):
        """--sequence-parallel: every rank's `part` (n, t / T, ...) into `out` (n, t, ...), in rank order."""
        self.calls += 1
        size = self.comm.Get_size()
        host = device.to_host(part) if self.xp is not np else part
        if not host.flags.c_contiguous:
            contiguous = self._buffer("part", host.shape, host.dtype)
            np.copyto(contiguous, host)
            host = contiguous
        got = self._buffer("got", (size, *host.shape), host.dtype)
        with waiting(self.watchdog, f"tensor-parallel allgather of {got.size} values over {size} tensor ranks"):
            self.comm.Allgather(host, got)
        by_rank = self.xp.asarray(got.swapaxes(0, 1))   # (n, T, t / T, ...): rank r's part at [:, r]
        if out.flags.c_contiguous:   # out seen as by_rank's shape: written without a temporary
            out.reshape(by_rank.shape)[...] = by_rank
        else:
            out[...] = by_rank.reshape(out.shape)

    def _allreduce(self, a, op, what):
        self.calls += 1
        host = a if self.xp is np else device.to_host(a)
        if not host.flags.c_contiguous:
            raise ValueError("a tensor-parallel allreduce takes a contiguous array")
        with waiting(self.watchdog, f"tensor-parallel allreduce ({what} of {host.size} values over "
                                    f"{self.comm.Get_size()} tensor ranks)"):
            self.comm.Allreduce(MPI.IN_PLACE, host, op=op)
        if host is not a:
            a[...] = self.xp.asarray(host)
