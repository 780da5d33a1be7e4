"""MPI's own collectives as a strategy: MPI_Allreduce, and MPI_Reduce_scatter
+ MPI_Allgatherv for the two halves. For comparison with hpctrain's ring
(`--allreduce mpi`), and as the fallback where the library's tuned algorithms
win. Same interface as the ring (comm/strategy.py); rank r owns chunk r.

CuPy buffers only with a CUDA-aware MPI (the factory decides); the stream is
synchronized first, since MPI reads what kernels wrote.

    mpirun -n 3 python -m hpctrain.comm.mpi       # self-check: full(n, rank) sums
"""
import numpy as np
from mpi4py import MPI

from ..base.device import Scratch, array_module
from .strategy import FlatStrategy, chunk_bounds


def _sync(buf):
    if not isinstance(buf, np.ndarray):
        array_module(buf).cuda.get_current_stream().synchronize()  # MPI reads what kernels wrote


class MpiAllreduce(FlatStrategy):
    """MPI's own collectives over `comm` (duplicated), in place."""

    name = "mpi"

    def __init__(self, comm, watchdog=None):
        super().__init__(comm, watchdog)
        self._scratch = Scratch()

    def allreduce(self, buf):
        if self.size == 1 or buf.size == 0:
            return buf
        _sync(buf)
        with self.waiting("MPI_Allreduce"):
            self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        return buf

    def _counts(self, n):
        bounds = chunk_bounds(n, self.size)
        return [bounds[i + 1] - bounds[i] for i in range(self.size)], bounds[:-1]

    def reduce_scatter(self, buf):
        lo, hi = self.shard(buf.size)
        if self.size == 1 or buf.size == 0:
            return lo, hi
        _sync(buf)
        counts, _ = self._counts(buf.size)
        # MPI_IN_PLACE would leave the result at the front of buf, not at
        # [lo, hi): receive into scratch and copy it into place.
        xp = array_module(buf)
        scratch = self._scratch.get(buf.dtype, xp, buf.dtype, hi - lo)
        with self.waiting("MPI_Reduce_scatter"):
            self.comm.Reduce_scatter(buf, scratch[: hi - lo], recvcounts=counts, op=MPI.SUM)
        buf[lo:hi] = scratch[: hi - lo]
        return lo, hi

    def allgather(self, buf):
        if self.size == 1 or buf.size == 0:
            return buf
        _sync(buf)
        counts, displs = self._counts(buf.size)
        with self.waiting("MPI_Allgatherv"):
            self.comm.Allgatherv(MPI.IN_PLACE, [buf, (counts, displs)])
        return buf



if __name__ == "__main__":
    from .strategy import self_check
    self_check(MpiAllreduce(MPI.COMM_WORLD), "MPI allreduce")
