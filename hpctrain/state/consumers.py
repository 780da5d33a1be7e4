"""What reads or writes the run's state, written once over parts (the
contract in state/__init__.py; the layouts' parts: state/layouts.py),
whatever the layout:

- `finite(parts, ...)`: every value held finite, known on every rank of a
  communicator (one Allreduce) or on this rank alone;
- `ToChief`: the writers' parts to the chief, tensor by tensor, in the
  order its file takes them (the --save file, report/params.py): each rank
  sends its own boxes as the chief asks for them, so no rank holds more
  than one box beyond its own, and the chief receives the others' a block
  of rows at a time into one small buffer;
- `restore(parts, read)`: every part's box from `read(name, box)` (host
  values) into its view; `FromChief`: that read, where the chief alone has
  the file, each rank's boxes read on the chief and sent to it;
- `flat_read(ckpt, spec, optimizer)`: such a read over an old flat
  checkpoint (checkpoints/read_back.Checkpoint: `params`,
  `optimizer_state`, `model_state`, arrays or lazily read datasets laid out
  by the whole model's spec), so old checkpoints resume at any layout.

Boxes travel as raw arrays (mpi4py's buffer calls) and what describes them
as JSON bytes: no pickle. Every blocking wait goes through `waiting(what,
peer)` (run/world.World.waiting: the watchdog, naming the peer).

    mpirun -n 4 python -m mpi4py -m pytest -q --only-mpi tests/test_state_layouts.py
"""
import json

import numpy as np

from ..base import device
from .parts import box_shape, box_slices

TAG = 32000   # the parts' boxes between the chief and the others


def parameters(parts, spec):
    """The parts of the model's parameters (not its state, not the optimizer's)."""
    names = {name for name, _, _, _ in spec.full.tensors}
    return [p for p in parts if p.name in names]


def finite(parts, comm=None, waiting=None):
    """Every part's values finite; over comm (one Allreduce: every rank the
    same answer), or this rank's alone (comm None)."""
    ok = np.array([1 if all(device.all_finite(p.view) for p in parts) else 0], np.int64)
    if comm is not None:
        # MPI imported only here: `generate`, `evaluate` and `export` restore a
        # model in one process, and importing mpi4py.MPI starts MPI, whose
        # handlers replace the commands' SIGHUP and SIGTERM stops
        from mpi4py import MPI
        with waiting("parameter finiteness allreduce", None):
            comm.Allreduce(MPI.IN_PLACE, ok, op=MPI.MIN)
    return bool(ok[0])


def _described(p):
    return [p.name, [list(b) for b in p.box], np.dtype(p.view.dtype).str]


def gather_json(comm, root, value, waiting, what):
    """Every rank's JSON-able `value`, as a list in rank order, on root (None elsewhere)."""
    raw = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.zeros(comm.Get_size(), np.int64) if comm.Get_rank() == root else None
    with waiting(f"{what}: sizes to the chief", None):
        comm.Gather(np.array([raw.size], np.int64), sizes, root=root)
    buf = np.empty(int(sizes.sum()), np.uint8) if sizes is not None else None
    with waiting(f"{what}: descriptions to the chief", None):
        comm.Gatherv(raw, [buf, sizes] if buf is not None else None, root=root)
    if buf is None:
        return None
    ends = np.cumsum(sizes)
    return [json.loads(bytes(buf[e - s:e]).decode()) for s, e in zip(sizes, ends)]


class ToChief:
    """The writers' parts of every rank of comm to `root` (the chief),
    tensor by tensor in the order of `names`; host values. The chief asks
    `tensors()`: (name, box, values) of every writer's part, its own or as
    it arrives; the others `send()`; a chief whose write failed `drain()`s
    what is still to come. Collective to make (the descriptions gathered)."""

    def __init__(self, comm, root, parts, names, waiting):
        self.comm, self.root, self.waiting = comm, root, waiting
        order = {name: i for i, name in enumerate(names)}
        self.mine = sorted((p for p in parts if p.writer), key=lambda p: order[p.name])
        described = gather_json(comm, root, [_described(p) for p in self.mine], waiting, "the parts to write")
        self.plan = None
        if described is not None:   # the chief: every piece (name order, then rank), where it comes from
            pieces = [(order[name], rank, k, name, tuple(map(tuple, box)), dtype)
                      for rank, listed in enumerate(described) for k, (name, box, dtype) in enumerate(listed)]
            self.plan = sorted(pieces)
        self._next = 0
        # the chief receives the others' boxes a few rows at a time (`rows`), each into one small
        # buffer, and hands on each block: a whole box a fresh array would hold 1/N of the largest
        # tensor, two at the hand-over (a --zero 3 --save of a 4096 x 4096 layer at N = 4: 32 MiB)
        self._inbox = None

    def tensors(self):
        """(name, box, values) tiling every writer's part (another rank's a
        block of rows at a time); values received from another rank are good
        until the next block is asked for (its buffer takes the next): write
        each before going on."""
        while self._next < len(self.plan):
            _, rank, k, name, box, dtype = self.plan[self._next]
            self._next += 1
            if rank == self.root:
                yield name, box, device.to_host(self.mine[k].view)
                continue
            for block in rows(box, np.dtype(dtype).itemsize):
                yield name, block, self._receive(rank, block, dtype, name)

    def _receive(self, rank, box, dtype, name):
        if self._inbox is None:
            self._inbox = np.empty(BLOCK_BYTES, np.uint8)
        n = int(np.prod(box_shape(box), dtype=np.int64)) * np.dtype(dtype).itemsize
        inbox = self._inbox if n <= self._inbox.nbytes else np.empty(n, np.uint8)   # a row above BLOCK_BYTES
        values = inbox[:n].view(np.dtype(dtype)).reshape(box_shape(box))
        with self.waiting(f"{name} from rank {rank} to the chief", rank):
            self.comm.Recv(values, source=rank, tag=TAG)
        return values

    def drain(self):
        for _ in self.tensors():
            pass

    def send(self):
        for p in self.mine:
            host = device.to_host(p.view)
            for block in rows(p.box, host.itemsize):
                values = np.ascontiguousarray(host[_within(block, p.box)])
                with self.waiting(f"{p.name} to the chief", self.root):
                    self.comm.Send(values, dest=self.root, tag=TAG)


BLOCK_BYTES = 1 << 20   # what the chief receives at once of another rank's box (whole rows; at least one)


def rows(box, itemsize):
    """`box` cut along its first axis into blocks of whole rows of at most
    BLOCK_BYTES (one row at least; a 0-d box whole): how a box travels to
    the chief, the same cut on both sides."""
    if not box:
        return [box]
    (lo, hi), rest = box[0], tuple(box[1:])
    row = int(np.prod(box_shape(rest), dtype=np.int64)) * itemsize
    step = max(1, BLOCK_BYTES // row) if row else max(1, hi - lo)
    return [((a, min(a + step, hi)), *rest) for a in range(lo, hi, step)] or [box]


def _within(block, box):
    """block (a box inside `box`) as slices of box's own array."""
    return tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(block, box))


def restore(parts, read, xp=np):
    """Every part's box of its tensor, `read(name, box)` (host values), into its view."""
    for p in parts:
        p.view[...] = xp.asarray(np.asarray(read(p.name, p.box)).astype(p.view.dtype, copy=False))


class FromChief:
    """`restore`'s read where the chief alone reads the file: every rank's
    parts' boxes (all it holds, writer or not) are read on the chief by
    `read` (None elsewhere) and sent to it, rank after rank, one box in
    flight. Collective over comm: `restore(parts, xp)` on every rank."""

    def __init__(self, comm, root, read, waiting):
        self.comm, self.root, self.read, self.waiting = comm, root, read, waiting

    def restore(self, parts, xp=np):
        comm, root = self.comm, self.root
        described = gather_json(comm, root, [_described(p) for p in parts], self.waiting, "the parts to read")
        if comm.Get_rank() != root:
            for p in parts:
                values = np.empty(box_shape(p.box), p.view.dtype)
                with self.waiting(f"{p.name} from the chief (resume)", root):
                    comm.Recv(values, source=root, tag=TAG + 1)
                p.view[...] = xp.asarray(values)
            return
        restore(parts, self.read, xp)
        for rank, listed in enumerate(described):
            if rank == root:
                continue
            for name, box, dtype in listed:
                values = np.ascontiguousarray(self.read(name, tuple(map(tuple, box))), np.dtype(dtype))
                with self.waiting(f"{name} to rank {rank} (resume)", rank):
                    comm.Send(values, dest=rank, tag=TAG + 1)


def flat_read(ckpt, spec, optimizer):
    """read(name, box) over an old flat checkpoint (checkpoints/read_back.Checkpoint:
    `params`, `optimizer_state` {key: ...}, `model_state`, each a host array or
    a lazily read dataset with `read(lo, hi)`) laid out by the whole model's
    spec; optimizer: the name its state goes by (`adam`: `adam.m/layer0/W`)."""
    spec = spec.full
    where = {name: (shape, lo, hi, "params") for name, shape, lo, hi in spec.tensors}
    where.update({name: (shape, lo, hi, "state") for name, shape, lo, hi in spec.state})

    def flat(name):
        head, _, rest = name.partition("/")
        if name in where:
            shape, lo, hi, of = where[name]
            return (ckpt.params if of == "params" else ckpt.model_state), shape, lo, hi
        prefix, _, key = head.partition(".")
        if prefix != optimizer or rest not in where:
            raise KeyError(f"{name} is not a tensor of this model's state")
        shape, lo, hi, _ = where[rest]
        return ckpt.optimizer_state[key], shape, lo, hi

    def read(name, box):
        source, shape, lo, hi = flat(name)
        # the box's rows, read as one range of the flat array, then cut
        first, last = (box[0] if box else (0, 1))
        inner = int(np.prod(shape[1:], dtype=np.int64)) if shape else 1
        a, b = lo + first * inner, lo + last * inner if shape else hi
        rows = source.read(a, b) if hasattr(source, "read") else source[a:b]
        rows = np.asarray(rows).reshape((last - first,) + tuple(shape[1:]) if shape else ())
        return rows[(slice(None),) + box_slices(box[1:])] if shape else rows
    return read
