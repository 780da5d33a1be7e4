"""Allreduce (sum, in place) of one contiguous 1-D buffer: hpctrain's own ring,
or MPI's native Allreduce for comparison and as a fallback.

The ring is Baidu's/Horovod's bandwidth-optimal algorithm: the buffer is cut
into `size` chunks; a reduce-scatter (size-1 steps, each rank sends one chunk
to its right neighbour and adds the chunk arriving from its left) leaves every
rank owning one fully summed chunk; an allgather (size-1 more steps) passes the
summed chunks around. Each rank sends 2(N-1)/N of the buffer in all, whatever
the number of ranks. Chunks are slices of the buffer itself, so nothing is
copied except the incoming chunk that must be added.

The buffer may be NumPy or CuPy (the latter only with a CUDA-aware MPI, which
reads and writes device memory itself; comm/buffers.py decides, and stages
through host memory otherwise). For CuPy the scratch lives on the device, the
adds are kernels, and the stream is synchronized before MPI touches anything
a kernel wrote.

    mpirun -n 3 python -m hpctrain.comm.ring      # self-check: full(n, rank) sums
"""
import numpy as np
from mpi4py import MPI

from ..device import array_module

# Chunks are received and added in segments of this many bytes so the add of
# one segment overlaps the transfer of the next, and the scratch stays in cache.
SEGMENT_BYTES = 1 << 18


def chunk_bounds(n, parts):
    """Start offsets of `parts` near-equal chunks of n elements (parts+1 values)."""
    return [i * n // parts for i in range(parts + 1)]


class RingAllreduce:
    """Ring allreduce over `comm` (duplicated, so its messages never match anyone
    else's). Call with a contiguous 1-D array; it is summed in place."""

    name = "ring"

    def __init__(self, comm, watchdog=None):
        self.comm = comm.Dup()
        self.size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()
        self.right = (self.rank + 1) % self.size
        self.left = (self.rank - 1) % self.size
        self.watchdog = watchdog
        self._scratch = {}

    def _scratch_for(self, dtype, n, xp=np):
        key = (xp.__name__, dtype)
        buf = self._scratch.get(key)
        if buf is None or buf.size < n:
            buf = xp.empty(max(n, 1), dtype=dtype)
            self._scratch[key] = buf
        return buf

    def __call__(self, buf):
        if self.size == 1 or buf.size == 0:
            return buf
        if isinstance(buf, np.ndarray):
            xp, sync = np, None
        else:
            xp = array_module(buf)
            sync = xp.cuda.get_current_stream().synchronize
            sync()  # MPI reads what kernels wrote
        if self.watchdog is not None:
            # Sendrecv waits on both neighbours: the left one's data, the right one's receive.
            with self.watchdog.waiting("ring allreduce", peer=sorted({self.left, self.right})):
                self._ring(buf, xp, sync)
        else:
            self._ring(buf, xp, sync)
        return buf

    def _ring(self, buf, xp=np, sync=None):
        """sync: None for host memory; for device memory, waits for the adds
        (kernels) before MPI sends their result or receives over their input."""
        n, size, rank = buf.size, self.size, self.rank
        b = chunk_bounds(n, size)
        seg = max(1, SEGMENT_BYTES // buf.itemsize)
        scratch = self._scratch_for(buf.dtype, min(b[1] - b[0] + 1, seg), xp)
        add = xp.add
        comm, right, left = self.comm, self.right, self.left

        # Reduce-scatter: after step s, chunk (rank - s - 1) holds s+2 ranks' sum.
        for step in range(size - 1):
            send = (rank - step) % size
            recv = (rank - step - 1) % size
            s_lo, s_hi = b[send], b[send + 1]
            r_lo, r_hi = b[recv], b[recv + 1]
            if s_hi - s_lo <= seg and r_hi - r_lo <= seg:
                tmp = scratch[: r_hi - r_lo]
                comm.Sendrecv(buf[s_lo:s_hi], right, 0, tmp, left, 0)
                add(buf[r_lo:r_hi], tmp, out=buf[r_lo:r_hi])
                if sync is not None:
                    sync()
            else:
                self._sendrecv_add(buf, s_lo, s_hi, r_lo, r_hi, seg, xp, sync)

        # Allgather: pass the summed chunks around, straight into place.
        for step in range(size - 1):
            send = (rank + 1 - step) % size
            recv = (rank - step) % size
            comm.Sendrecv(buf[b[send]:b[send + 1]], right, 1, buf[b[recv]:b[recv + 1]], left, 1)

    def _sendrecv_add(self, buf, s_lo, s_hi, r_lo, r_hi, seg, xp=np, sync=None):
        """Large chunks travel as segments of `seg` elements (a chunk of at most
        one segment is one message, so both neighbours agree on the message
        count from the chunk's length alone); each received segment is added
        while the next is in flight, through a double-buffered scratch."""
        comm, right, left = self.comm, self.right, self.left
        scratch = self._scratch_for(buf.dtype, 2 * seg, xp)
        add = xp.add
        halves = (scratch[:seg], scratch[seg: 2 * seg])
        sends = [comm.Isend(buf[lo:min(lo + seg, s_hi)], right, 0) for lo in range(s_lo, s_hi, seg)]
        starts = list(range(r_lo, r_hi, seg))
        reqs = [None, None]
        if starts:
            reqs[0] = comm.Irecv(halves[0][: min(seg, r_hi - starts[0])], left, 0)
        for i, lo in enumerate(starts):
            hi = min(lo + seg, r_hi)
            if i + 1 < len(starts):
                nlo = starts[i + 1]
                reqs[(i + 1) % 2] = comm.Irecv(halves[(i + 1) % 2][: min(seg, r_hi - nlo)], left, 0)
            reqs[i % 2].Wait()
            add(buf[lo:hi], halves[i % 2][: hi - lo], out=buf[lo:hi])
            if sync is not None:
                sync()  # before the next Irecv into this half, and before buf[lo:hi] is sent on
        MPI.Request.Waitall(sends)


class MpiAllreduce:
    """MPI's own MPI_Allreduce, in place."""

    name = "mpi"

    def __init__(self, comm, watchdog=None):
        self.comm = comm.Dup()
        self.size = self.comm.Get_size()
        self.watchdog = watchdog

    def __call__(self, buf):
        if self.comm.Get_size() == 1 or buf.size == 0:
            return buf
        if not isinstance(buf, np.ndarray):
            array_module(buf).cuda.get_current_stream().synchronize()  # MPI reads what kernels wrote
        if self.watchdog is not None:
            with self.watchdog.waiting("MPI_Allreduce", peer=None):
                self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        else:
            self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        return buf


def make_allreduce(name, comm, watchdog=None):
    """The one factory: 'ring' or 'mpi' (GPU strategies register in comm/buffers.py)."""
    if name == "ring":
        return RingAllreduce(comm, watchdog)
    if name == "mpi":
        return MpiAllreduce(comm, watchdog)
    raise ValueError(f"unknown allreduce {name!r}")


if __name__ == "__main__":
    world = MPI.COMM_WORLD
    ring = RingAllreduce(world)
    expect = sum(range(world.size))
    for n in (0, 1, world.size - 1, 7, 1000, 1 << 20):
        x = np.full(n, world.rank, dtype=np.float32)
        ring(x)
        assert np.all(x == expect), (n, x[:5])
    if world.rank == 0:
        print(f"ring allreduce OK on {world.size} ranks")
