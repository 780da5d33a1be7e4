"""hpctrain.dist's collectives on host arrays (NumPy, PyTorch CPU tensors,
any buffer): allreduce, allgather, broadcast, reducescatter, alltoall,
barrier, each with an `_async` form returning a handle (engine.py),
in-place forms (`allreduce_`, `broadcast_`), and join().

Sum and Average go through hpctrain's own allreduce, the one the program's
data parallelism uses (comm/__init__.make_allreduce: the ring of
comm/ring_allreduce.py on one node, hier.py across nodes), and with
compression fp16/bf16 through its 16-bit ring (comm/compressed_exchange.py:
float32 sums, 16-bit words on the wire, fp16 divided by the ranks first).
The ring sums; Min, Max and Product are MPI's own MPI_Allreduce, and
allgather, broadcast, reducescatter and alltoall MPI's collectives
(MPI_Allgatherv, MPI_Bcast, MPI_Reduce_scatter, MPI_Alltoallv). Each call
is checked first (calls.py: one small allreduce of a fingerprint), and
every wait is bounded by the deadline (runtime.py).

    mpirun -n 3 python -m mpi4py -m pytest -q --only-mpi tests/test_dist.py
"""
import functools
import inspect

import numpy as np

from ..base.chunks import chunk_bounds
from .arrays import host_array, like
from .calls import COMPRESSIONS, OPS, Call, agree
from .errors import DistError
from .runtime import is_initialized, runtime

Average, Sum, Min, Max, Product = "Average", "Sum", "Min", "Max", "Product"


class PowerSGD:
    """Compression.powersgd's settings, the program's --powersgd-* flags
    and their defaults (comm/powersgd.py: each weight matrix sent as two
    rank-`rank` factors, error feedback per parameter, Q warm-started);
    float32 from `start` steps on only. For a DistributedOptimizer's
    gradients: it keeps state from step to step, which a lone allreduce has
    not. The same settings on every rank."""
    kind = "powersgd"

    def __init__(self, rank=4, start=100, min_rate=2.0, warm_start=True, epsilon=0.0, error_feedback=True,
                 seed=0):
        self.rank, self.start, self.min_rate, self.warm_start = int(rank), int(start), float(min_rate), warm_start
        self.epsilon, self.error_feedback, self.seed = float(epsilon), error_feedback, int(seed)


class Compression:
    """How allreduce's Sum/Average crosses the wire (Horovod's
    hvd.Compression.none/fp16; bf16 beside them): float32 summed, 16-bit
    words sent; powersgd (a DistributedOptimizer's only): PowerSGD's
    factors, `Compression.PowerSGD(rank=...)` for other settings."""
    none, fp16, bf16 = "none", "fp16", "bf16"
    PowerSGD = PowerSGD
    powersgd = PowerSGD()


def _op(op, what):
    if op not in OPS[1:]:
        raise DistError(f"{what}: op={op!r} is not one of Average, Sum, Min, Max, Product")
    return op


def _compression(compression, op, dtype, what):
    c = getattr(compression, "kind", compression)
    if c is None:
        c = "none"
    if c == "powersgd":
        raise DistError(f"{what}: compression=powersgd is for a DistributedOptimizer's gradients (its error "
                        f"feedback and Q go from step to step); a lone allreduce takes none, fp16 or bf16")
    if c not in COMPRESSIONS:
        raise DistError(f"{what}: compression={compression!r} is not one of none, fp16, bf16")
    if c != "none" and (op not in (Sum, Average) or np.dtype(dtype).kind != "f"):
        raise DistError(f"{what}: compression={c} compresses a floating-point Sum or Average, "
                        f"not {np.dtype(dtype)} {op}")
    return c


def _group(process_set):
    return runtime().group(process_set)


def _root(process_set, root_rank, what):
    """root_rank (a world rank) as a rank of process_set's communicator."""
    root_rank = int(root_rank)
    if process_set is None:
        if not 0 <= root_rank < runtime().world.size:
            raise DistError(f"{what}: root_rank={root_rank} is not a rank (0 to {runtime().world.size - 1})")
        return root_rank
    if root_rank not in process_set.ranks:
        raise DistError(f"{what}: root_rank={root_rank} is not in {process_set}")
    return process_set.ranks.index(root_rank)


def _flat(arr):
    """A contiguous 1-D view of arr, or None when that needs a copy."""
    return arr.reshape(-1) if arr.flags.c_contiguous else None


def _mpi_op(op):
    from mpi4py import MPI   # here, not at import: init() decides how MPI starts
    return {Sum: MPI.SUM, Average: MPI.SUM, Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD,
            "IN_PLACE": MPI.IN_PLACE}[op]


def _neutral(op, dtype):
    """What a joined rank contributes: it changes no result."""
    if op in (Sum, Average):
        return 0
    if op == Product:
        return 1
    if dtype.kind == "f":
        return np.inf if op == Min else -np.inf
    if dtype.kind == "b":
        return op == Min
    info = np.iinfo(dtype)
    return info.max if op == Min else info.min


# --- the work the engine's thread runs (g: runtime.Group, buffers 1-D contiguous) ---------------

def _reduce(g, buf, op, compression, active):
    if op in (Sum, Average):
        if compression != "none":
            work = buf if buf.dtype == np.float32 else buf.astype(np.float32)
            g.half(compression).allreduce(work)
            if work is not buf:
                buf[...] = work
        else:
            g.strategy.allreduce(buf)
        if op == Average and len(active) > 1:
            if buf.dtype.kind in "fc":
                buf /= buf.dtype.type(len(active))
            else:
                buf //= len(active)
    elif g.size > 1:
        with g.watchdog.waiting(f"hpctrain.dist allreduce ({op})", peer=None):
            g.comm.Allreduce(_mpi_op("IN_PLACE"), buf, op=_mpi_op(op))
    return buf


def _reduce_scatter(g, flat, rows, row_elems, op, active):
    bounds = chunk_bounds(rows, g.size)
    counts = [(bounds[i + 1] - bounds[i]) * row_elems for i in range(g.size)]
    out = np.empty(counts[g.rank], flat.dtype)
    with g.watchdog.waiting("hpctrain.dist reducescatter", peer=None):
        g.comm.Reduce_scatter(flat, out, recvcounts=counts, op=_mpi_op(op))
    if op == Average and len(active) > 1:
        if out.dtype.kind in "fc":
            out /= out.dtype.type(len(active))
        else:
            out //= len(active)
    return out, bounds[g.rank + 1] - bounds[g.rank]


def _allgatherv(g, flat, rows, row_elems, dtype):
    counts = [r * row_elems for r in rows]
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
    out = np.empty(sum(counts), dtype)
    with g.watchdog.waiting("hpctrain.dist allgather", peer=None):
        g.comm.Allgatherv(flat, [out, (counts, displs)])
    return out


def _bcast(g, buf, root):
    if g.size > 1:
        with g.watchdog.waiting("hpctrain.dist broadcast", peer=g.world_ranks[root]):
            g.comm.Bcast(buf, root=root)
    return buf


def _serve(g, ag):
    """A joined rank's part in the others' call (calls.Agreement ag)."""
    kind, dtype = ag.kind, ag.dtype
    if kind == "allreduce":
        _reduce(g, np.full(ag.count, _neutral(ag.op, dtype), dtype), ag.op, ag.compression, ag.active)
    elif kind == "reducescatter":   # its rows travel in the root field
        _reduce_scatter(g, np.full(ag.count, _neutral(ag.op, dtype), dtype), ag.root,
                        ag.count // max(ag.root, 1), ag.op, ag.active)
    elif kind in ("allgather", "allgather_object"):
        _allgatherv(g, np.empty(0, dtype), ag.rows, ag.count, dtype)
    elif kind == "broadcast":
        _bcast(g, np.empty(ag.count, dtype), ag.root)
    elif kind == "broadcast_object":
        _bcast(g, np.empty(ag.rows[ag.root], np.uint8), ag.root)


def refused_together(fn):
    """fn, a collective call, whose refusal on this rank (a DistError of its
    own arguments: a bad op, dtype, root, splits...) is still made in
    fn's process set, as a refusal (calls.agree): every rank of the set
    raises the same line, printed once, and none waits for this one's call."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DistError as e:
            if e.collective or not is_initialized():
                raise
            process_set = signature.bind(*args, **kwargs).arguments.get("process_set")
            if process_set is not None and not process_set.included():
                raise
            refuse(e, fn.__name__, process_set)
    return call


def refuse(error, what, process_set=None):
    """This rank's DistError `error` made in process_set's next call check
    (calls.agree), where the other ranks meet it with their call (or their
    own refusal): raises the same line on every rank, said once."""
    synchronize(_call(lambda g: agree(g, None, 0, refused=error), f"{what} (refused)", process_set, now=True))
    raise error   # (not reached: agree raised)


def _call(work, what, process_set, now=False):
    """Submit work(g) to the engine for process_set's group; a Handle.
    now: the caller waits for it at once (engine.Engine.now: on its thread
    when nothing is pending)."""
    rt = runtime()
    return (rt.engine.now if now else rt.engine.submit)(lambda: work(rt.group(process_set)), what)


# --- allreduce ---------------------------------------------------------------------------------

@refused_together
def allreduce_async_(tensor, op=Average, compression=Compression.none, name=None, process_set=None,
                     prescale_factor=1.0, postscale_factor=1.0, _now=False):
    """In place: tensor becomes the reduction over the ranks; the handle's
    result is tensor. prescale_factor / postscale_factor: each rank's tensor
    is multiplied by the one before the reduction, the result by the other
    after it (Horovod's; a floating-point Sum or Average)."""
    arr = host_array(tensor, "allreduce_", writable=True)
    op = _op(op, "allreduce_")
    scale = (float(prescale_factor), float(postscale_factor))
    if scale != (1.0, 1.0) and (op not in (Sum, Average) or arr.dtype.kind not in "fc"):
        raise DistError(f"allreduce_: prescale_factor and postscale_factor scale a floating-point Sum or Average, "
                        f"not {arr.dtype} {op}")
    comp = _compression(compression, op, arr.dtype, "allreduce_")
    call = Call("allreduce", arr.dtype, arr.shape, op, comp, name=name)
    flat = _flat(arr)

    def work(g):
        ag = agree(g, call, 0)
        buf = flat if flat is not None else np.ascontiguousarray(arr).reshape(-1)
        if scale[0] != 1.0:
            buf *= buf.dtype.type(scale[0])
        _reduce(g, buf, op, comp, ag.active)
        if scale[1] != 1.0:
            buf *= buf.dtype.type(scale[1])
        if flat is None:
            arr[...] = buf.reshape(arr.shape)
        return tensor
    return _call(work, call.describe(), process_set, _now)


@refused_together
def allreduce_async(tensor, op=Average, compression=Compression.none, name=None, process_set=None,
                    prescale_factor=1.0, postscale_factor=1.0, _now=False):
    """The reduction over the ranks as a new array (tensor unchanged)."""
    arr = np.array(host_array(tensor, "allreduce"), copy=True, order="C")
    handle = allreduce_async_(arr, op, compression, name, process_set, prescale_factor, postscale_factor, _now)
    return _then(handle, lambda out: like(tensor, out))


def allreduce(tensor, op=Average, compression=Compression.none, name=None, process_set=None,
              prescale_factor=1.0, postscale_factor=1.0):
    return synchronize(allreduce_async(tensor, op, compression, name, process_set, prescale_factor,
                                       postscale_factor, True))


def allreduce_(tensor, op=Average, compression=Compression.none, name=None, process_set=None,
               prescale_factor=1.0, postscale_factor=1.0):
    return synchronize(allreduce_async_(tensor, op, compression, name, process_set, prescale_factor,
                                        postscale_factor, True))


# --- allgather, broadcast, reducescatter, alltoall, barrier -------------------------------------

@refused_together
def allgather_async(tensor, name=None, process_set=None, _now=False):
    """Every rank's tensor concatenated along the first dimension (which may differ between ranks)."""
    arr = np.ascontiguousarray(host_array(tensor, "allgather"))
    if arr.ndim == 0:
        arr = arr.reshape(1)
    call = Call("allgather", arr.dtype, arr.shape, name=name)

    def work(g):
        ag = agree(g, call, 0)
        out = _allgatherv(g, arr.reshape(-1), ag.rows, ag.count, arr.dtype)
        return like(tensor, out.reshape((sum(ag.rows),) + arr.shape[1:]))
    return _call(work, call.describe(), process_set, _now)


def allgather(tensor, name=None, process_set=None):
    return synchronize(allgather_async(tensor, name, process_set, True))


@refused_together
def broadcast_async_(tensor, root_rank, name=None, process_set=None, _now=False):
    """In place: tensor becomes root_rank's (a world rank)."""
    arr = host_array(tensor, "broadcast_", writable=True)
    root = _root(process_set, root_rank, "broadcast")
    call = Call("broadcast", arr.dtype, arr.shape, root=root, name=name)
    flat = _flat(arr)

    def work(g):
        agree(g, call, 0)
        buf = flat if flat is not None else np.ascontiguousarray(arr).reshape(-1)
        _bcast(g, buf, root)
        if flat is None:
            arr[...] = buf.reshape(arr.shape)
        return tensor
    return _call(work, call.describe(), process_set, _now)


@refused_together
def broadcast_async(tensor, root_rank, name=None, process_set=None, _now=False):
    arr = np.array(host_array(tensor, "broadcast"), copy=True, order="C")
    return _then(broadcast_async_(arr, root_rank, name, process_set, _now), lambda out: like(tensor, out))


def broadcast(tensor, root_rank, name=None, process_set=None):
    return synchronize(broadcast_async(tensor, root_rank, name, process_set, True))


def broadcast_(tensor, root_rank, name=None, process_set=None):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set, True))


@refused_together
def reducescatter_async(tensor, op=Average, name=None, process_set=None, _now=False):
    """The reduction over the ranks, cut along the first dimension: this
    rank's near-equal share of the rows (base/chunks.py's partition: the
    later ranks get the extra rows)."""
    arr = np.ascontiguousarray(host_array(tensor, "reducescatter"))
    if arr.ndim == 0:
        raise DistError("reducescatter: a tensor of at least one dimension")
    op = _op(op, "reducescatter")
    call = Call("reducescatter", arr.dtype, arr.shape, op, root=arr.shape[0], name=name)
    row_elems = int(np.prod(arr.shape[1:], dtype=np.int64))

    def work(g):
        ag = agree(g, call, 0)
        out, rows = _reduce_scatter(g, arr.reshape(-1), arr.shape[0], row_elems, op, ag.active)
        return like(tensor, out.reshape((rows,) + arr.shape[1:]))
    return _call(work, call.describe(), process_set, _now)


def reducescatter(tensor, op=Average, name=None, process_set=None):
    return synchronize(reducescatter_async(tensor, op, name, process_set, True))


@refused_together
def alltoall_async(tensor, splits=None, name=None, process_set=None, received_splits=False, _now=False):
    """Rows splits[i] of tensor (in order) to rank i of the set; the rows
    every rank sent this one, in rank order. splits None: equal parts.
    received_splits=True: (output, the rows from each rank)."""
    arr = np.ascontiguousarray(host_array(tensor, "alltoall"))
    if arr.ndim == 0:
        raise DistError("alltoall: a tensor of at least one dimension")
    call = Call("alltoall", arr.dtype, arr.shape, name=name)
    row_elems = int(np.prod(arr.shape[1:], dtype=np.int64))
    size = runtime().world.size if process_set is None else process_set.size()
    if splits is None:
        if arr.shape[0] % size:
            raise DistError(f"alltoall: {arr.shape[0]} rows do not split evenly over {size} ranks: give splits")
        send = np.full(size, arr.shape[0] // size, np.int64)
    else:
        send = np.asarray(host_array(splits, "alltoall splits"), np.int64).reshape(-1)
    if send.size != size or send.sum() != arr.shape[0] or (send < 0).any():
        raise DistError(f"alltoall: splits {send.tolist()} must be {size} counts adding up to the "
                        f"{arr.shape[0]} rows")

    def work(g):
        agree(g, call, 0)
        recv = np.empty(g.size, np.int64)
        with g.watchdog.waiting("hpctrain.dist alltoall (splits)", peer=None):
            g.comm.Alltoall(send, recv)
        scounts, rcounts = (send * row_elems).tolist(), (recv * row_elems).tolist()
        sdispls = [0] + np.cumsum(scounts)[:-1].tolist()
        rdispls = [0] + np.cumsum(rcounts)[:-1].tolist()
        out = np.empty(sum(rcounts), arr.dtype)
        with g.watchdog.waiting("hpctrain.dist alltoall", peer=None):
            g.comm.Alltoallv([arr.reshape(-1), (scounts, sdispls)], [out, (rcounts, rdispls)])
        out = like(tensor, out.reshape((int(recv.sum()),) + arr.shape[1:]))
        return (out, like(splits if splits is not None else tensor, recv)) if received_splits else out
    return _call(work, call.describe(), process_set, _now)


def alltoall(tensor, splits=None, name=None, process_set=None, received_splits=False):
    return synchronize(alltoall_async(tensor, splits, name, process_set, received_splits, True))


def barrier_async(process_set=None, _now=False):
    call = Call("barrier")
    return _call(lambda g: agree(g, call, 0) and None,
                 "barrier()", process_set, _now)


def barrier(process_set=None):
    """Every rank of the set got here (the fingerprint's allreduce is the barrier)."""
    synchronize(barrier_async(process_set, True))


def join(process_set=None):
    """This rank has no more batches: until every rank of the set has joined,
    it takes part in the others' collectives with zeros (allreduce; not
    counted in Average's divisor), no rows (allgather) or as a receiver
    (broadcast). Returns the rank (world) that joined last."""
    def work(g):
        joined = 2   # calls.agree: joining in this call, then 1
        while True:
            ag = agree(g, None, joined)
            joined = 1
            if ag.all_joined:
                return g.world_ranks[max(ag.fresh)]
            _serve(g, ag)
    return synchronize(_call(work, "join()", process_set, now=True))


# --- handles -------------------------------------------------------------------------------------

class _Then:
    """A handle whose result is fn(the inner handle's result)."""
    __slots__ = ("inner", "fn")

    def __init__(self, inner, fn):
        self.inner, self.fn = inner, fn


def _then(handle, fn):
    return _Then(handle, fn)


def poll(handle):
    """Whether the call is done (synchronize will not wait)."""
    inner = handle.inner if isinstance(handle, _Then) else handle
    return inner.done.is_set()


def synchronize(handle):
    """Wait for an `_async` call; its result (its error raised here)."""
    if isinstance(handle, _Then):
        return handle.fn(synchronize(handle.inner))
    return runtime().engine.wait(handle)
