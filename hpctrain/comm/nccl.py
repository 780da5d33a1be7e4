"""--allreduce nccl: gradients summed on the GPUs by NCCL, through CuPy's
bindings (cupy.cuda.nccl), one GPU per rank.

MPI still starts the job: rank 0 makes NCCL's unique id and broadcasts it as
a raw buffer (no pickle), every rank joins the NCCL communicator with it (the
way ChainerMN's PureNcclCommunicator does), and from then on each allreduce
is one NCCL call on the current stream. NCCL refuses two ranks on one GPU, so
that is checked first, with an error that says what to do instead.
reduce_scatter and allgather (comm/strategy.py) are NCCL's own, in place; NCCL
needs equal parts, so they take lengths divisible by the number of ranks and
raise a clear HpctrainError for others.

    mpirun -n 2 python -m hpctrain.mnist --device gpu --allreduce nccl   # one GPU per rank
"""
import socket

import numpy as np
from mpi4py import MPI

from ..base import device
from ..base.errors import HpctrainError
from ..base.precision import FLOAT32
from .records import allgather_bytes
from .strategy import chunk_bounds, chunk_parts, waiting

UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
DEVICE_NAME_BYTES = 96  # bytes per rank in the host/GPU gather


def nccl_or_reason(xp):
    """(cupy.cuda.nccl, 'NCCL x.y.z') where NCCL can be used, else (None, why not)."""
    if not device.is_gpu(xp):
        return None, "NCCL needs a GPU (this run is on the CPU)"
    try:
        from cupy.cuda import nccl
    except Exception as exc:
        return None, f"CuPy's NCCL bindings failed to load ({exc})"
    if not getattr(nccl, "available", True) or not hasattr(nccl, "NcclCommunicator"):
        return None, ("CuPy cannot load the NCCL library (pip install nvidia-nccl-cu12 or -cu13 to match "
                      "your CuPy, or python -m cupyx.tools.install_library --library nccl --cuda 12.x)")
    try:
        code = nccl.get_version()
    except Exception:
        code = 0
    return nccl, f"NCCL {version_text(code)}"


def version_text(code):
    """NCCL_VERSION_CODE as text: 2.9 and later encode x*10000 + y*100 + z, older x*1000 + y*100 + z."""
    if not code:
        return "(version unknown)"
    if code >= 20900:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


# --- the unique id over MPI --------------------------------------------------

def encode_unique_id(uid):
    """NCCL's unique id (CuPy gives a tuple of 128 C chars as ints: signed
    -128..127 where char is signed, as on x86-64; 0..255 where it is not, as on
    aarch64) as an int16 record [1, id...], so it round-trips exactly as raw bytes."""
    values = np.asarray(tuple(uid), np.int64)
    if values.shape != (UNIQUE_ID_BYTES,) or values.min() < -128 or values.max() > 255:
        raise ValueError(f"not an NCCL unique id: {len(values)} values in [{values.min()}, {values.max()}]")
    record = np.empty(1 + UNIQUE_ID_BYTES, np.int16)
    record[0] = 1
    record[1:] = values
    return record


def decode_unique_id(record):
    return tuple(int(v) for v in record[1:])


def share_unique_id(comm, make_id, root=0):
    """Rank root calls make_id() (nccl.get_unique_id); every rank gets the id.
    If it fails on root, every rank raises (root with the message), so no rank
    waits for a communicator that will never form."""
    record = np.zeros(1 + UNIQUE_ID_BYTES, np.int16)
    error = None
    if comm.Get_rank() == root:
        try:
            record[:] = encode_unique_id(make_id())
        except Exception as exc:
            error = f"NCCL could not make its unique id ({exc.__class__.__name__}: {exc})"
            record[0] = 0
    comm.Bcast(record, root=root)
    if record[0] != 1:
        raise HpctrainError(error or "", collective=True, report=error is not None)
    return decode_unique_id(record)


# --- one GPU per rank ----------------------------------------------------------

def shared_devices(names):
    """{device name: [ranks]} for every device that more than one rank names."""
    ranks = {}
    for rank, name in enumerate(names):
        ranks.setdefault(name, []).append(rank)
    return {name: r for name, r in ranks.items() if len(r) > 1}


def _device_name(xp, device_id):
    try:
        bus = xp.cuda.Device(device_id).pci_bus_id
    except Exception:
        try:
            bus = xp.cuda.runtime.deviceGetPCIBusId(device_id)
        except Exception:
            bus = f"device {device_id}"
    return f"{socket.gethostname()} GPU {bus}"


class NcclAllreduce:
    """In-place sum of a CuPy buffer over comm's ranks with NCCL. Collective to
    construct. Returns when the sum is complete (the stream is synchronized,
    under the deadline), like the MPI allreduces."""

    name = "nccl"

    def __init__(self, comm, xp, watchdog=None):
        nccl, why = nccl_or_reason(xp)
        if nccl is None:
            raise HpctrainError(f"--allreduce nccl: {why}")
        self.nccl, self.xp, self.watchdog = nccl, xp, watchdog
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.device_id = device.current_device(xp)
        shared = shared_devices(allgather_bytes(comm, _device_name(xp, self.device_id), DEVICE_NAME_BYTES))
        if shared:
            name, ranks = next(iter(shared.items()))
            raise HpctrainError(
                f"--allreduce nccl needs one GPU per rank, but ranks {','.join(map(str, ranks))} share "
                f"{name}; use --allreduce ring or mpi to share GPUs", collective=True, report=self.rank == 0)
        uid = share_unique_id(comm, nccl.get_unique_id)
        try:
            with waiting(watchdog, "NCCL communicator set-up"):
                self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        except Exception as exc:
            raise HpctrainError(f"NCCL could not set up its communicator ({exc})") from None
        # NCCL's names for the dtypes it may be handed: a table of every float, not the run's choice
        self._types = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
                       np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.int32): nccl.NCCL_INT32,
                       np.dtype(np.int64): nccl.NCCL_INT64}

    def shard(self, n):
        bounds = chunk_bounds(n, self.size)
        return bounds[self.rank], bounds[self.rank + 1]

    def parts(self, n):
        return chunk_parts(n, self.size)

    def _begin(self, buf, what):
        """The stream to run on; NCCL's calls go on the stream of the kernels
        that wrote buf, so they start after them."""
        if not buf.flags.c_contiguous:
            raise ValueError(f"NCCL {what} needs a contiguous buffer")
        device.use_device(self.xp, self.device_id)
        return self.xp.cuda.get_current_stream()

    def _finish(self, stream, what):
        # Return when the result is complete, under the deadline, like the MPI strategies.
        with waiting(self.watchdog, f"NCCL {what}"):
            stream.synchronize()

    def _equal_parts(self, buf, what):
        if buf.size % self.size:
            raise HpctrainError(
                f"NCCL {what} needs a length divisible by the number of ranks ({buf.size} elements, "
                f"{self.size} ranks); use allreduce, or the ring or mpi strategy")
        return buf.size // self.size

    def allreduce(self, buf):
        if buf.size == 0:
            return buf
        stream = self._begin(buf, "allreduce")
        self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._types[buf.dtype],
                            self.nccl.NCCL_SUM, stream.ptr)
        self._finish(stream, "allreduce")
        return buf

    def reduce_scatter(self, buf):
        """In place: NCCL's reduceScatter with recvbuff = sendbuff + rank * part."""
        lo, hi = self.shard(buf.size)
        if buf.size == 0 or self.size == 1:
            return lo, hi
        part = self._equal_parts(buf, "reduce_scatter")
        stream = self._begin(buf, "reduce_scatter")
        self.comm.reduceScatter(buf.data.ptr, buf[lo:hi].data.ptr, part, self._types[buf.dtype],
                                self.nccl.NCCL_SUM, stream.ptr)
        self._finish(stream, "reduce_scatter")
        return lo, hi

    def allgather(self, buf):
        """In place: NCCL's allGather with sendbuff = recvbuff + rank * part."""
        if buf.size == 0 or self.size == 1:
            return buf
        part = self._equal_parts(buf, "allgather")
        lo, _ = self.shard(buf.size)
        stream = self._begin(buf, "allgather")
        self.comm.allGather(buf[lo:lo + part].data.ptr, buf.data.ptr, part, self._types[buf.dtype],
                            stream.ptr)
        self._finish(stream, "allgather")
        return buf


if __name__ == "__main__":
    from ..base import device as dev
    xp, name, note = dev.select("gpu")
    world = MPI.COMM_WORLD
    strategy = NcclAllreduce(world, xp)
    x = xp.full(1000, world.rank, FLOAT32.grads)
    strategy.allreduce(x)
    assert bool((x == sum(range(world.size))).all())
    if world.rank == 0:
        print(f"NCCL allreduce OK on {world.size} ranks")
