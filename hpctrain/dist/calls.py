"""Every rank makes the same call: the cheap check that comes first in
each of hpctrain.dist's collectives, and what join() learns from it.

Before a collective moves any data, the ranks of its process set add up a
fingerprint of the call in ONE small MPI_Allreduce (MAX) of int64s: the
call's fields (kind, dtype, op, compression, root, elements, a CRC of the
shape, dimensions) and their negatives (so MAX gives both the largest and
the smallest of each field: equal everywhere or not), and one slot per
rank for whether it has joined and for its first dimension (an allgather's
rows: the counts the allgather needs, so they cost no second message),
and one slot per rank for whether it refused its call (its own arguments
were wrong: a bad op, dtype, root...). A refused call is still made, as a
refusal, so that the others do not wait for it: every rank of the set
then raises the lowest refusing rank's one line (that rank prints it),
the job's one line instead of one per rank.
PyTorch's TORCH_DISTRIBUTED_DEBUG=DETAIL and Horovod's coordinator check
the same thing with a gather of descriptions on every call; here the
descriptions travel only when the fields differ: then every rank knows it
from the same sum, gathers them as fixed-width byte records (no pickle),
and raises the same DistError, one line naming both ranks and both calls,
exit 2 (the lowest rank prints it).

A rank inside join() takes part with neutral fields (they never win a MAX)
and learns the call from the others' fields: it then contributes zeros
(allreduce, reducescatter), nothing (allgather) or receives (broadcast).

    mpirun -n 2 python -m mpi4py -m pytest -q --only-mpi tests/test_dist.py
"""
import zlib

import numpy as np

from ..comm.records import allgather_bytes
from .errors import DistError

# The collectives, as the fingerprint names them. ROWS: the first dimension
# may differ between ranks (each rank's is in its slot).
KINDS = ("allreduce", "allgather", "broadcast", "reducescatter", "alltoall", "barrier",
         "broadcast_object", "allgather_object")
ROWS = {"allgather", "alltoall", "allgather_object", "broadcast_object"}
# The dtypes MPI moves (mpi4py maps each to a datatype); a code each.
DTYPES = tuple(np.dtype(t) for t in ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
                                     "uint64", "float16", "float32", "float64", "complex64", "complex128"))
OPS = ("", "Average", "Sum", "Min", "Max", "Product")
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
NEUTRAL = -(1 << 62)          # a joined rank's field: never the MAX
FIELDS = 8


def dtype_code(dtype, what):
    dtype = np.dtype(dtype)
    for i, d in enumerate(DTYPES):
        if d == dtype:
            return i
    raise DistError(f"{what}: dtype {dtype} is not one MPI moves (one of {', '.join(map(str, DTYPES))})")


class Call:
    """One collective call as this rank makes it. rows: the first dimension
    (ROWS kinds; a broadcast_object's byte count on its root), else -1."""
    __slots__ = ("kind", "dtype", "shape", "op", "compression", "root", "name")

    def __init__(self, kind, dtype=None, shape=(), op="", compression="none", root=0, name=None):
        self.kind, self.shape, self.op, self.compression, self.root, self.name = \
            kind, tuple(int(s) for s in shape), op, compression, int(root), name
        self.dtype = np.dtype(dtype) if dtype is not None else np.dtype("uint8")
        dtype_code(self.dtype, self.describe())

    @property
    def rows(self):
        return self.shape[0] if self.kind in ROWS and self.shape else -1

    @property
    def row_shape(self):
        """The shape the ranks must share: all of it, or all but the first dimension (ROWS)."""
        return self.shape[1:] if self.kind in ROWS else self.shape

    def fields(self):
        rest = self.row_shape
        return np.array([KINDS.index(self.kind), dtype_code(self.dtype, self.kind), OPS.index(self.op),
                         COMPRESSIONS.index(self.compression), self.root, int(np.prod(rest, dtype=np.int64)),
                         zlib.crc32(repr(rest).encode()), len(self.shape)], np.int64)

    def describe(self):
        """The call in words, as the mismatch line names it."""
        what = [f"{self.dtype} {list(self.shape)}"] if self.kind not in ("barrier",) else []
        if self.op:
            what.append(f"op={self.op}")
        if self.compression != "none":
            what.append(f"compression={self.compression}")
        if self.kind in ("broadcast", "broadcast_object"):
            what.append(f"root_rank={self.root}")
        if self.name:
            what.append(f"name={self.name!r}")
        return f"{self.kind}({', '.join(what)})"


class Agreement:
    """What the fingerprint's MAX says: `kind`, `dtype`, `op`, `compression`,
    `root`, `count` (elements, per row for ROWS kinds), `ndim`; `rows`:
    every rank's first dimension (joined ranks 0); `joined`: who has joined;
    `active`: the ranks that have not."""

    def __init__(self, top, rows, joined):
        self.joined = [bool(j) for j in joined]
        self.fresh = [r for r, j in enumerate(joined) if j == 2]   # joined in this very call
        self.active = [r for r, j in enumerate(self.joined) if not j]
        self.rows = [max(int(r), 0) for r in rows]
        self.all_joined = not self.active
        if not self.all_joined:
            kind, dtype, op, comp, self.root, self.count, _, self.ndim = (int(v) for v in top)
            self.kind, self.dtype, self.op, self.compression = KINDS[kind], DTYPES[dtype], OPS[op], \
                COMPRESSIONS[comp]


def agree(g, call, joined, refused=None):
    """The fingerprint's one Allreduce over the group g's communicator
    (runtime.Group; this rank's `call`, or None inside join(); `joined` 0,
    or 2 in join()'s first call, 1 after; `refused`: this rank's own error
    instead of a call), the ranks' meeting napping where g's waits nap;
    raises the same DistError on every rank when a rank refused its call or
    the active ranks' calls differ."""
    comm, world_ranks = g.comm, g.world_ranks
    size, rank = comm.Get_size(), comm.Get_rank()
    vec = np.empty(2 * FIELDS + 3 * size, np.int64)
    if call is None:
        vec[:2 * FIELDS] = NEUTRAL
    else:
        f = call.fields()
        vec[:FIELDS], vec[FIELDS:2 * FIELDS] = f, -f
    vec[2 * FIELDS:2 * FIELDS + size] = 0
    vec[2 * FIELDS + rank] = int(joined)   # 2: joins in this call, 1: had joined before
    vec[2 * FIELDS + size:2 * FIELDS + 2 * size] = -1
    vec[2 * FIELDS + size + rank] = 0 if call is None else call.rows
    vec[2 * FIELDS + 2 * size:] = 0
    vec[2 * FIELDS + 2 * size + rank] = refused is not None
    from mpi4py import MPI   # here, not at import: init() decides how MPI starts
    what = call.describe() if call is not None else "join()" if refused is None else "a refused call"
    with g.watchdog.waiting(f"hpctrain.dist {what}: every rank's call", peer=None):
        if g.waits.nap:
            # The ranks decided together (runtime._nap): every rank makes this same nonblocking
            # call, and its wait naps. One Iallreduce, where Waits.allreduce's Ibarrier then
            # Allreduce (for ranks that may differ) takes twice the rounds, each a wait for a
            # rank that may be off its shared core.
            g.waits.one(comm.Iallreduce(MPI.IN_PLACE, vec, op=MPI.MAX))
        else:
            comm.Allreduce(MPI.IN_PLACE, vec, op=MPI.MAX)
    if vec[2 * FIELDS + 2 * size:].any():
        _refusal(g, refused, vec[2 * FIELDS + 2 * size:])
    top, low = vec[:FIELDS], -vec[FIELDS:2 * FIELDS]
    agreement = Agreement(top, vec[2 * FIELDS + size:2 * FIELDS + 2 * size], vec[2 * FIELDS:2 * FIELDS + size])
    if not agreement.all_joined and not np.array_equal(top, low):
        _mismatch(g, what, agreement, world_ranks)
    if not agreement.all_joined and any(agreement.joined):
        _joined_cannot(g, agreement, world_ranks, rank)
    return agreement


def _refusal(g, refused, who):
    """Every rank of g raises the lowest refusing rank's line (naming it
    where some ranks did not refuse); that rank prints it."""
    said = allgather_bytes(g.comm, str(refused) if refused is not None else "", 1000)
    first = int(np.flatnonzero(who)[0])
    line = said[first] if who.all() else f"rank {g.world_ranks[first]}: {said[first]}"
    raise DistError(line, exit_code=refused.exit_code if refused is not None else 2, collective=True,
                    report=g.rank == first, world=g.whole)


def _mismatch(g, what, agreement, world_ranks):
    comm = g.comm
    said = allgather_bytes(comm, what, 240)
    a = agreement.active[0]
    b = next((r for r in agreement.active if said[r] != said[a]), agreement.active[-1])
    raise DistError(f"rank {world_ranks[a]} called {said[a]} but rank {world_ranks[b]} called {said[b]}: every "
                    f"rank must make the same collective calls, in the same order, with the same shapes and dtypes",
                    collective=True, report=comm.Get_rank() == 0, world=g.whole)


def _joined_cannot(g, agreement, world_ranks, rank):
    joined = [world_ranks[r] for r, j in enumerate(agreement.joined) if j]
    names = ", ".join(map(str, joined))
    if agreement.kind == "alltoall":
        why = "alltoall after join(): a joined rank has no rows to send"
    elif agreement.compression == "powersgd":
        why = "a PowerSGD DistributedOptimizer after join(): a joined rank has no factors to send"
    elif agreement.kind in ("broadcast", "broadcast_object") and agreement.joined[agreement.root]:
        why = f"{agreement.kind} from rank {world_ranks[agreement.root]}, which has joined"
    else:
        return
    raise DistError(f"{why} (joined: rank{'s' if len(joined) > 1 else ''} {names})", collective=True,
                    report=rank == agreement.active[0], world=g.whole)
