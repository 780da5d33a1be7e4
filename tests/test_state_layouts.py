"""Every layout's parts (hpctrain/state/layouts.py) against the whole model:
each rank's buffers (real RingStep objects at ZeRO stages 0-3, with and
without --tensor-parallel; pipeline stages, their optimizer sharded over
replicas or not; parameter servers) are filled with the whole model's
values as the layout holds them, and every rank's writer parts, put
together, must give each whole tensor back with each element written
exactly once (the optimizer's state and the non-trainable state too).

    mpirun -n 4 python -m mpi4py -m pytest -q --only-mpi tests/test_state_layouts.py
    python -m pytest -q tests/test_state_layouts.py
"""
import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.comm.ps.placement import place
from hpctrain.comm.ring_allreduce import RingAllreduce
from hpctrain.comm.tensor_group import TensorComm
from hpctrain.loops.ring_step import RingStep
from hpctrain.nn.gpt import gpt
from hpctrain.nn.tensor_parallel import TensorGroup, take_local
from hpctrain.nn.zoo import small_cnn
from hpctrain.optim.optimizers import make_optimizer
from hpctrain.pipeline.stage import Stage
from hpctrain.pipeline.stages import balanced
from hpctrain.state import layouts
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


@pytest.mark.mpi
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("name, tensor", [("gpt", 1), ("gpt", 2), ("small_cnn", 1)])
def test_ring_parts_put_together_are_the_whole_model(stage, name, tensor):
    """Ring mode at ZeRO stage 0-3, tensor-parallel or not: the GPT (its head
    tied to the embedding, held once; the vocabulary and heads cut) and a
    CNN (batch-norm state)."""
    world = MPI.COMM_WORLD
    if world.Get_size() % tensor:
        pytest.skip("the ranks do not divide by T")
    full = gpt(13, 8, 4, 2, 12) if name == "gpt" else small_cnn((12, 12), 10)
    t, replica = world.Get_rank() % tensor, world.Get_rank() // tensor
    data = world.Split(t, replica)
    spec = full
    if tensor > 1:
        group = TensorGroup(tensor, t)
        group.comm = TensorComm(world.Split(replica, t))
        spec = full.split_tensor(group)
    strategy = RingAllreduce(data)
    ring = RingStep(spec, strategy, data, np, ("adam", {}), 200, sharded=stage >= 1, shard_grads=stage >= 2,
                    shard_params=stage == 3, overlap=False, dtype=np.float64)
    try:
        local = [take_local(full, spec.cuts, whole(full, k), t) if tensor > 1 else whole(full, k) for k in range(3)]
        if ring.param_shard is not None:
            ring.param_shard.buf[...] = compact(local[0], ring.param_shard.ranges)
        else:
            ring.model.params[...] = local[0]
        state = ring.optimizer.state()
        for k, key in enumerate(KEYS):
            state[key][...] = compact(local[1 + k], ring.optimizer.ranges) if stage else local[1 + k]
        fill_state(ring.model.state, replica, t)
        parts = layouts.ring(spec, None if stage == 3 else ring.model.params, ring.model.state, ring.optimizer,
                             "adam", replica, data.Get_size(), ring.param_shard)
        check(parts, full)
        if stage == 0 and tensor == 1 and data.Get_size() > 1:   # the writing spread over the replicas
            assert 0 < sum(p.writer for p in parts) < len(parts)
    finally:
        ring.close()
        strategy.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sharded", [False, True])
def test_pipeline_parts_put_together_are_the_whole_model(sharded):
    """Two stages (the GPT's tied head on the last: a copy there, not a part),
    each of size / 2 replicas, the optimizer sharded over them or not."""
    world = MPI.COMM_WORLD
    stages = 2
    full = gpt(13, 8, 4, 2, 12)
    s, replica, replicas = world.Get_rank() % stages, world.Get_rank() // stages, world.Get_size() // stages
    if world.Get_rank() >= stages * replicas:
        replica = -1   # an odd rank out: holds nothing (the check's allgather still needs it)
    cuts = balanced(full, stages)
    chunk = Stage(full, cuts, s, 1, np, np.float64)
    n = chunk.hi - chunk.lo
    owned = [(replica * n // replicas, (replica + 1) * n // replicas)] if sharded else None
    optimizer = make_optimizer("adam", n, np, np.float64, owned=owned)
    chunk.params[...] = whole(full, 0)[chunk.lo:chunk.hi]
    for k, key in enumerate(KEYS):
        values = whole(full, 1 + k)[chunk.lo:chunk.hi]
        optimizer.state()[key][...] = compact(values, owned) if sharded else values
    fill_state(chunk.state, replica)
    parts = [] if replica < 0 else layouts.pipeline(full, [chunk], [optimizer], "adam", replica, replicas)
    check(parts, full)


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
