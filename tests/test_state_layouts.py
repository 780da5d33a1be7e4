"""Every layout's parts (hpctrain/state/layouts.py) against the whole model:
each rank's buffers (real RingStep objects at ZeRO stages 0-3, with and
without --tensor-parallel; pipeline stages, their optimizer sharded over
replicas or not; parameter servers) are filled with the whole model's
values as the layout holds them, and every rank's writer parts, put
together, must give each whole tensor back with each element written
exactly once (the optimizer's state and the non-trainable state too).
Then the consumers over parts (state/consumers.py): finiteness over every
rank, and a state written at one layout (the writers' parts to the chief)
read back at another (each rank its boxes, from an old flat checkpoint).

    mpirun -n 4 python -m mpi4py -m pytest -q --only-mpi tests/test_state_layouts.py
    python -m pytest -q tests/test_state_layouts.py
"""
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from collectives import take_local
from hpctrain.comm.ps.placement import place
from hpctrain.comm.ring_allreduce import RingAllreduce
from hpctrain.comm.tensor_group import TensorComm
from hpctrain.loops.ring_step import RingStep
from hpctrain.nn.gpt import gpt
from hpctrain.nn.tensor_parallel import TensorGroup
from hpctrain.nn.zoo import small_cnn
from hpctrain.optim.optimizers import make_optimizer
from hpctrain.pipeline.stage import Stage
from hpctrain.pipeline.stages import balanced
from hpctrain.state import layouts
from hpctrain.checkpoints.named import open_checkpoint, write_checkpoint
from hpctrain.state.consumers import FromChief, ToChief, finite, flat_read, parameters, restore
from hpctrain.state.parts import box_slices, range_boxes

KEYS = ("m", "v")   # adam's state, in the order the values below number them


def whole(full, k):
    """The whole model's k-th flat array (0: the parameters, 1 + i: KEYS[i]), every element its own value."""
    return np.arange(full.num_params, dtype=np.float64) + 1e6 * k


def compact(array, ranges):
    return np.concatenate([array[lo:hi] for lo, hi in ranges] or [array[:0]])


def expected(full):
    """name -> the whole tensor the parts must give back."""
    out = {}
    for k, prefix in enumerate([""] + [f"adam.{key}/" for key in KEYS]):
        flat = whole(full, k)
        out.update({prefix + name: flat[lo:hi].reshape(shape) for name, shape, lo, hi in full.tensors})
    state = np.arange(full.num_state, dtype=np.float64) + 0.5
    out.update({name: state[lo:hi].reshape(shape) for name, shape, lo, hi in full.state})
    return out


def check(parts, full, comm=MPI.COMM_WORLD):
    """Every rank's writer parts tile each whole tensor once, with its values."""
    mine = [(p.name, p.box, np.array(p.view)) for p in parts if p.writer]
    want = expected(full)
    got = {name: np.full(a.shape, np.nan) for name, a in want.items()}
    count = {name: np.zeros(a.shape, np.int64) for name, a in want.items()}
    for name, box, values in (q for rank in comm.allgather(mine) for q in rank):
        got[name][box_slices(box)] = values
        count[name][box_slices(box)] += 1
    for name in want:
        assert (count[name] == 1).all(), (name, count[name].min(), count[name].max())
        assert np.array_equal(got[name], want[name]), name


def test_a_flat_range_is_boxes_back_to_back():
    shape = (3, 4, 5)
    values = np.arange(60).reshape(shape)
    for lo, hi in [(0, 60), (7, 53), (20, 40), (3, 4), (19, 21)]:
        at = lo
        for box, a, b in range_boxes(shape, lo, hi):
            assert a == at and np.array_equal(values[box_slices(box)].reshape(-1), np.arange(a, b))
            at = b
        assert at == hi


def fill_state(model_state, replica, t=0):
    """The non-trainable state: the whole model's on replica 0's tensor rank 0, others apart."""
    model_state[...] = np.arange(model_state.size) + 0.5 + 1000 * replica + 100 * t


class RingLayout:
    """Ring mode's step at ZeRO `stage` with T = `tensor` (RingStep over this
    rank's replicas), its buffers filled with the whole model's values as
    the layout holds them (`fill`) and its parts (`parts`)."""

    def __init__(self, full, stage, tensor):
        world = MPI.COMM_WORLD
        self.full, self.stage = full, stage
        self.t, self.replica = world.Get_rank() % tensor, world.Get_rank() // tensor
        self.data = world.Split(self.t, self.replica)
        self.spec = full
        if tensor > 1:
            group = TensorGroup(tensor, self.t, comm=TensorComm(world.Split(self.replica, self.t)))
            self.spec = full.split_tensor(group)
        self.strategy = RingAllreduce(self.data)
        self.ring = RingStep(self.spec, self.strategy, self.data, np, ("adam", {}), 200, zero=stage, overlap=False,
                             dtype=np.float64)

    def fill(self):
        full, ring, t = self.full, self.ring, self.t
        local = [take_local(full, self.spec.cuts, whole(full, k), t) if self.spec.cuts else whole(full, k)
                 for k in range(3)]
        if ring.param_shard is not None:
            ring.param_shard.buf[...] = compact(local[0], ring.param_shard.ranges)
        else:
            ring.model.params[...] = local[0]
        state = ring.optimizer.state()
        for k, key in enumerate(KEYS):
            state[key][...] = compact(local[1 + k], ring.optimizer.ranges) if self.stage else local[1 + k]
        fill_state(ring.model.state, self.replica, t)

    def parts(self, spread=True):
        ring = self.ring
        return layouts.ring(self.spec, None if self.stage == 3 else ring.model.params, ring.model.state,
                            ring.optimizer, "adam", self.replica, self.data.Get_size(), ring.param_shard, spread)

    def close(self):
        self.ring.close()
        self.strategy.free()


@pytest.mark.mpi
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("name, tensor", [("gpt", 1), ("gpt", 2), ("small_cnn", 1)])
def test_ring_parts_put_together_are_the_whole_model(stage, name, tensor):
    """Ring mode at ZeRO stage 0-3, tensor-parallel or not: the GPT (its head
    tied to the embedding, held once; the vocabulary and heads cut) and a
    CNN (batch-norm state)."""
    if MPI.COMM_WORLD.Get_size() % tensor:
        pytest.skip("the ranks do not divide by T")
    layout = RingLayout(gpt(13, 8, 4, 2, 12) if name == "gpt" else small_cnn((12, 12), 10), stage, tensor)
    try:
        layout.fill()
        parts = layout.parts()
        check(parts, layout.full)
        if stage == 0 and tensor == 1 and layout.data.Get_size() > 1:   # the writing spread over the replicas
            assert 0 < sum(p.writer for p in parts) < len(parts)
        gathered = layout.parts(spread=False)   # the --save file's: the chief's replica writes what it holds
        check(gathered, layout.full)
        if stage == 0 and tensor == 1:
            assert all(p.writer == (layout.replica == 0) for p in gathered)
    finally:
        layout.close()


class PipeLayout:
    """Two pipeline stages (the GPT's tied head on the last: a copy there,
    not a part), each of size / 2 replicas (an odd rank out holds nothing),
    the optimizer sharded over them or not."""

    def __init__(self, full, sharded, stages=2):
        world = MPI.COMM_WORLD
        self.full, self.sharded = full, sharded
        self.s, self.replica, self.replicas = world.Get_rank() % stages, world.Get_rank() // stages, \
            world.Get_size() // stages
        if world.Get_rank() >= stages * self.replicas:
            self.replica = -1
        self.chunk = Stage(full, balanced(full, stages), self.s, 1, np, np.float64)
        n = self.chunk.hi - self.chunk.lo
        r, R = max(self.replica, 0), self.replicas
        self.owned = [(r * n // R, (r + 1) * n // R)] if sharded else None
        self.optimizer = make_optimizer("adam", n, np, np.float64, owned=self.owned)

    def fill(self):
        chunk = self.chunk
        chunk.params[...] = whole(self.full, 0)[chunk.lo:chunk.hi]
        for k, key in enumerate(KEYS):
            values = whole(self.full, 1 + k)[chunk.lo:chunk.hi]
            self.optimizer.state()[key][...] = compact(values, self.owned) if self.sharded else values
        fill_state(chunk.state, self.replica)

    def parts(self):
        return [] if self.replica < 0 else \
            layouts.pipeline(self.full, [self.chunk], [self.optimizer], "adam", self.replica, self.replicas)

    def close(self):
        pass


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sharded", [False, True])
def test_pipeline_parts_put_together_are_the_whole_model(sharded):
    layout = PipeLayout(gpt(13, 8, 4, 2, 12), sharded)
    layout.fill()
    check(layout.parts(), layout.full)


@pytest.mark.mpi
@pytest.mark.parametrize("placement", ["even", "round-robin"])
def test_ps_parts_put_together_are_the_whole_model(placement):
    """Servers (every rank but the last, or the one rank) hold their placed
    ranges of the parameters and the optimizer state; a worker (the last)
    its copy, written by no one, and the state."""
    world = MPI.COMM_WORLD
    full = small_cnn((12, 12), 10)
    servers = max(1, world.Get_size() - 1)
    rank = world.Get_rank()
    owned = place(full.tensor_ranges(), servers, placement)
    parts = []
    if rank < servers:
        ranges = owned[rank]
        parts += layouts.ps_server(full, ranges, compact(whole(full, 0), ranges),
                                   {key: compact(whole(full, 1 + k), ranges) for k, key in enumerate(KEYS)}, "adam")
    if rank == world.Get_size() - 1:
        state = np.zeros(full.num_state)
        fill_state(state, 0)
        parts += layouts.ps_worker(full, whole(full, 0) + 1, state, chief=True)
    check(parts, full)


# --- the consumers over parts (state/consumers.py) ------------------------------------

def waiting(what, peer):
    return nullcontext()


@pytest.mark.mpi
def test_finite_is_every_ranks_parts_on_every_rank():
    comm = MPI.COMM_WORLD
    full = gpt(13, 8, 4, 2, 12)
    layout = RingLayout(full, 3, 1)
    try:
        layout.fill()
        params = parameters(layout.parts(), full)
        assert finite(params, comm, waiting)
        if comm.Get_rank() == comm.Get_size() - 1:
            params[-1].view.reshape(-1)[-1] = np.inf
        assert not finite(params, comm, waiting)
        assert finite(params) == (comm.Get_rank() != comm.Get_size() - 1)   # this rank's alone
    finally:
        layout.close()


def flat_checkpoint(full, tensors):
    """An old flat checkpoint (checkpoints/read_back.Checkpoint's arrays) from whole tensors {name: array}."""
    def flat(prefix, layout, n):
        out = np.full(n, np.nan)
        for name, _, lo, hi in layout:
            out[lo:hi] = tensors[prefix + name].reshape(-1)
        return out
    return SimpleNamespace(params=flat("", full.tensors, full.num_params),
                           optimizer_state={key: flat(f"adam.{key}/", full.tensors, full.num_params) for key in KEYS},
                           model_state=flat("", full.state, full.num_state))


LAYOUTS = {"ring": lambda full: RingLayout(full, 0, 1), "zero1": lambda full: RingLayout(full, 1, 1),
           "zero3": lambda full: RingLayout(full, 3, 1), "tp2": lambda full: RingLayout(full, 0, 2),
           "tp2-zero2": lambda full: RingLayout(full, 2, 2), "tp2-zero3": lambda full: RingLayout(full, 3, 2),
           "pipe": lambda full: PipeLayout(full, False), "pipe-sharded": lambda full: PipeLayout(full, True)}


def shared_dir(comm, tmp_path):
    """Rank 0's tmp_path on every rank (as UTF-8 bytes)."""
    raw = np.zeros(4096, np.uint8)
    if comm.Get_rank() == 0:
        raw[:len(str(tmp_path).encode())] = np.frombuffer(str(tmp_path).encode(), np.uint8)
    comm.Bcast(raw, root=0)
    return bytes(raw).rstrip(b"\0").decode()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("first, then", [("zero3", "tp2"), ("tp2-zero3", "pipe-sharded"), ("pipe", "zero1"),
                                         ("ring", "tp2-zero2")])
def test_a_checkpoint_of_named_tensors_written_at_one_layout_resumes_at_another(first, then, tmp_path):
    """Every rank writes its writer parts (checkpoints/named.py), every rank
    of the other layout reads its own boxes back: the whole model's values."""
    comm = MPI.COMM_WORLD
    if comm.Get_size() % 2 and "tp2" in first + then:
        pytest.skip("the ranks do not divide by T")
    full = gpt(13, 8, 4, 2, 12)
    want = expected(full)
    a = LAYOUTS[first](full)
    try:
        a.fill()
        pieces = [(p.name, p.box, np.ascontiguousarray(p.view, np.float64)) for p in a.parts() if p.writer]
        path = write_checkpoint(shared_dir(comm, tmp_path), 7, comm, 0, pieces,
                                {name: (w.shape, "<f8", []) for name, w in want.items()}, {}, waiting=waiting)
    finally:
        a.close()
    b = LAYOUTS[then](full)
    try:
        parts = b.parts()
        with open_checkpoint(path) as ckpt:
            restore(parts, ckpt.read)
        for p in parts:
            assert np.array_equal(p.view, want[p.name][box_slices(p.box)]), p.name
    finally:
        b.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("first, then", [("ring", "tp2-zero3"), ("zero3", "pipe-sharded"), ("tp2-zero3", "zero1"),
                                         ("pipe-sharded", "tp2"), ("tp2-zero2", "pipe"), ("pipe", "zero3")])
def test_a_state_written_at_one_layout_restores_at_another(first, then):
    """The writers' parts of layout `first` to the chief tensor by tensor
    (ToChief, what --save writes), as an old flat checkpoint, read back
    into every part of layout `then` (FromChief over flat_read): each
    rank's buffers hold the whole model's values at their places."""
    comm = MPI.COMM_WORLD
    if comm.Get_size() % 2 and "tp2" in first + then:
        pytest.skip("the ranks do not divide by T")
    full = gpt(13, 8, 4, 2, 12)
    a = LAYOUTS[first](full)
    try:
        a.fill()
        names = [f"adam.{key}/{name}" for key in KEYS for name, _, _, _ in full.tensors] + \
            [name for name, _, _, _ in full.tensors + full.state]
        own = a.parts()
        stream = ToChief(comm, 0, own, names, waiting)
        ckpt = None
        if comm.Get_rank() == 0:
            tensors = {name: np.full(shape, np.nan) for name, shape in
                       ((name, expected(full)[name].shape) for name in names)}
            received = []
            for name, box, values in stream.tensors():
                tensors[name][box_slices(box)] = values
                if values.size and not any(np.shares_memory(values, p.view) for p in own):
                    received.append(values)
            ckpt = flat_checkpoint(full, tensors)
        else:
            stream.send()
    finally:
        a.close()
    b = LAYOUTS[then](full)
    try:
        parts = b.parts()
        for p in parts:
            p.view[...] = np.nan
        FromChief(comm, 0, flat_read(ckpt, full, "adam") if ckpt else None, waiting).restore(parts)
        want = expected(full)
        for p in parts:
            assert np.array_equal(p.view, want[p.name][box_slices(p.box)]), p.name
        check(parts, full)
    finally:
        b.close()
    if comm.Get_rank() == 0:   # the others' pieces all arrived in one buffer (the chief holds one, not one a piece)
        assert received and all(np.shares_memory(v, received[0]) for v in received)
