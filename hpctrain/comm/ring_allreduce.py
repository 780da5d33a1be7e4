"""hpctrain's own ring allreduce (sum, in place) of one contiguous 1-D buffer.

The ring is Baidu's/Horovod's bandwidth-optimal algorithm: the buffer is cut
into `size` chunks; a reduce-scatter (size-1 steps, each rank sends one chunk
to its right neighbour and adds the chunk arriving from its left) leaves every
rank owning one fully summed chunk; an allgather (size-1 more steps) passes the
summed chunks around. Each rank sends 2(N-1)/N of the buffer in all, whatever
the number of ranks. Chunks are slices of the buffer itself, so nothing is
copied except the incoming chunk that must be added. The two halves are
exposed on their own (comm/strategy.py has the interface): after
reduce_scatter, rank r owns chunk r+1 (mod size).

The buffer may be NumPy or CuPy (the latter only with a CUDA-aware MPI, which
reads and writes device memory itself; the factory in comm/__init__.py
decides, and stages through host memory otherwise, comm/staged.py). For CuPy
the scratch lives on the device, the adds are kernels, and the stream is
synchronized before MPI touches anything a kernel wrote.

`waits` (comm/waits.Waits), given only by hpctrain.dist where ranks
outnumber cores: each exchange is an Irecv and an Isend whose wait naps
instead of MPI's busy-polling Sendrecv, the same messages and adds (the
same bits). There the ring runs on a communication thread beside the
user's backward on shared cores, so a spinning wait takes the core from
the neighbour it waits for. The program's ring (no `waits`) keeps
Sendrecv: its exchanges are latency-bound (comm/waits.py says why).

    mpirun -n 3 python -m hpctrain.comm.ring_allreduce      # self-check: full(n, rank) sums
"""
import numpy as np
from mpi4py import MPI

from ..base.device import Scratch, array_module
from .strategy import FlatStrategy, chunk_bounds
from .waits import Waits

__all__ = ["RingAllreduce", "chunk_bounds", "SEGMENT_BYTES"]

# Chunks are received and added in segments of this many bytes so the add of
# one segment overlaps the transfer of the next, and the scratch stays in cache.
SEGMENT_BYTES = 1 << 18


def _device_sync(buf):
    """(xp, sync) for buf: sync is None for host memory; for device memory it
    waits for the stream, so MPI reads what kernels wrote (called once now)."""
    if isinstance(buf, np.ndarray):
        return np, None
    xp = array_module(buf)
    sync = xp.cuda.get_current_stream().synchronize
    sync()
    return xp, sync


class RingAllreduce(FlatStrategy):
    """Ring allreduce over `comm` (duplicated), in comm's rank order.
    Contiguous 1-D arrays, summed in place. `label` starts the watchdog's
    description of each wait (hier.py's two rings say which is which).
    waits: a napping comm/waits.Waits for the exchanges (see above), or
    None: MPI's blocking calls (a Waits that does not nap waits as they do)."""

    name = "ring"

    def __init__(self, comm, watchdog=None, label="ring", waits=None):
        super().__init__(comm, watchdog)
        self.label = label
        self.waits = waits if waits is not None else Waits(nap=False)
        self.right = (self.rank + 1) % self.size
        self.left = (self.rank - 1) % self.size
        self._scratch = Scratch()

    def owned_chunk(self):
        # After size-1 reduce-scatter steps, chunk (rank - (size-1)) mod size is complete.
        return (self.rank + 1) % self.size

    def _waiting(self, what):
        # Sendrecv waits on both neighbours: the left one's data, the right one's receive.
        return self.waiting(what, peer=sorted({self.left, self.right}))

    def allreduce(self, buf):
        if self.size == 1 or buf.size == 0:
            return buf
        xp, sync = _device_sync(buf)
        with self._waiting(f"{self.label} allreduce"):
            self._reduce_scatter(buf, xp, sync)
            self._allgather(buf)
        return buf

    def reduce_scatter(self, buf):
        if self.size > 1 and buf.size > 0:
            xp, sync = _device_sync(buf)
            with self._waiting(f"{self.label} reduce-scatter"):
                self._reduce_scatter(buf, xp, sync)
        return self.shard(buf.size)

    def allgather(self, buf):
        if self.size > 1 and buf.size > 0:
            _device_sync(buf)
            with self._waiting(f"{self.label} allgather"):
                self._allgather(buf)
        return buf

    def _reduce_scatter(self, buf, xp=np, sync=None):
        """sync: None for host memory; for device memory, waits for the adds
        (kernels) before MPI sends their result or receives over their input."""
        n, size, rank = buf.size, self.size, self.rank
        bounds = chunk_bounds(n, size)
        seg = max(1, SEGMENT_BYTES // buf.itemsize)
        scratch = self._scratch.get(buf.dtype, xp, buf.dtype, min(bounds[1] - bounds[0] + 1, seg))
        # After step s, chunk (rank - s - 1) holds s+2 ranks' sum.
        for step in range(size - 1):
            send = (rank - step) % size
            recv = (rank - step - 1) % size
            s_lo, s_hi = bounds[send], bounds[send + 1]
            r_lo, r_hi = bounds[recv], bounds[recv + 1]
            if s_hi - s_lo <= seg and r_hi - r_lo <= seg:
                incoming = scratch[: r_hi - r_lo]
                self._sendrecv(buf[s_lo:s_hi], incoming, 0)
                xp.add(buf[r_lo:r_hi], incoming, out=buf[r_lo:r_hi])
                if sync is not None:
                    sync()
            else:
                self._sendrecv_add(buf, s_lo, s_hi, r_lo, r_hi, seg, xp, sync)

    def _allgather(self, buf):
        """Pass the summed chunks around, straight into place (rank r starts with chunk r+1)."""
        size, rank = self.size, self.rank
        bounds = chunk_bounds(buf.size, size)
        for step in range(size - 1):
            send = (rank + 1 - step) % size
            recv = (rank - step) % size
            self._sendrecv(buf[bounds[send]:bounds[send + 1]], buf[bounds[recv]:bounds[recv + 1]], 1)

    def _sendrecv(self, send, recv, tag):
        """send to the right neighbour, recv from the left one."""
        if not self.waits.nap:
            self.comm.Sendrecv(send, self.right, tag, recv, self.left, tag)
        else:
            self.waits.all([self.comm.Irecv(recv, self.left, tag), self.comm.Isend(send, self.right, tag)])

    def _sendrecv_add(self, buf, s_lo, s_hi, r_lo, r_hi, seg, xp=np, sync=None):
        """Large chunks travel as segments of `seg` elements (a chunk of at most
        one segment is one message, so both neighbours agree on the message
        count from the chunk's length alone); each received segment is added
        while the next is in flight, through a double-buffered scratch."""
        comm, right, left = self.comm, self.right, self.left
        scratch = self._scratch.get(buf.dtype, xp, buf.dtype, 2 * seg)
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
            self.waits.one(reqs[i % 2])
            xp.add(buf[lo:hi], halves[i % 2][: hi - lo], out=buf[lo:hi])
            if sync is not None:
                sync()  # before the next Irecv into this half, and before buf[lo:hi] is sent on
        self.waits.all(sends)



if __name__ == "__main__":
    from .strategy import self_check
    self_check(RingAllreduce(MPI.COMM_WORLD), "ring allreduce")
