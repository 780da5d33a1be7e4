"""Bucket fusion with overlap gives the same bits as reducing the same buckets
one after another, and buckets end on layer boundaries; every rank reads the
same summed stop flag and loss from fused.head; on a GPU (stand-in streams,
one per host thread) events order backprop, the communication thread and
the next forward without a host synchronization.

    python -m pytest -q tests/test_fusion.py
    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_fusion.py
"""
import numpy as np
import pytest
from mpi4py import MPI

from gpu_fakes import DevArray, LazyCopier, Scale, launch, threadstreams  # noqa: F401 (a fixture)
from hpctrain import device
from hpctrain.comm.fusion import FusedAllreduce, bucket_bounds
from hpctrain.comm.ring_allreduce import RingAllreduce
from hpctrain.comm.staged import StagedAllreduce
from hpctrain.comm.wire import LOSS, STOP, Wire
from hpctrain.nn import mlp
from hpctrain.optim.optimizers import Adam


def test_buckets_cover_the_buffer_in_ready_order_on_layer_boundaries():
    cuts = [0, 392502, 643502]
    n = 648012
    assert bucket_bounds(n, 0, cuts) == [(0, n)]
    assert bucket_bounds(n, 1 << 30, cuts) == [(0, n)]
    assert bucket_bounds(n, (1 << 20) // 4, cuts) == [(392502, n), (0, 392502)]
    assert bucket_bounds(n, 1000, cuts) == [(643502, n), (392502, 643502), (0, 392502)]
    for elems in (1, 10, 5000, 300000):
        b = bucket_bounds(n, elems, cuts)
        assert b[0][1] == n and b[-1][0] == 0
        assert all(b[i][0] == b[i + 1][1] for i in range(len(b) - 1))
        assert all(lo in cuts for lo, _ in b)


def train_steps(comm, overlap, fusion_elems, steps=5):
    """A few steps of the real loop's arithmetic: wire = [loss, stop, grads]."""
    rng = np.random.default_rng(comm.rank)
    n = mlp(hidden=(64, 32)).num_params
    wire = Wire(n)
    model = mlp(hidden=(64, 32)).build(grads=wire.body)
    model.init(0)
    opt = Adam(n)
    ready_from = wire.ready_from(model.layer_ranges)
    fused = FusedAllreduce(RingAllreduce(comm), wire.buffer, ready_from, bucket_bounds(wire.size, fusion_elems, ready_from),
                           overlap=overlap,
                           on_reduced=lambda lo, hi: opt.update(model.params, model.grads, *wire.body_range(lo, hi)))
    for _ in range(steps):
        x = rng.random((16, 784)).astype(np.float32)
        y = rng.integers(0, 10, 16)
        opt.begin(1e-3, 1.0 / comm.size)
        model.forward_backward(x, y, on_layer_done=fused.layer_done, loss_out=wire.loss)
        fused.wait()
    fused.close()
    return model.params.copy(), len(fused.buckets), float(wire.loss[0])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fusion_elems", [100, 20000])
def test_overlap_is_bit_identical_to_the_same_buckets_in_sequence(fusion_elems):
    comm = MPI.COMM_WORLD
    a, buckets, loss_a = train_steps(comm, overlap=True, fusion_elems=fusion_elems)
    b, _, loss_b = train_steps(comm, overlap=False, fusion_elems=fusion_elems)
    assert buckets > 1
    assert np.array_equal(a, b) and loss_a == loss_b
    # and the same on every rank
    first = a.copy()
    comm.Bcast(first, root=0)
    assert np.array_equal(a, first)


@pytest.mark.mpi(min_size=2)
def test_fused_buckets_equal_one_allreduce_up_to_rounding():
    comm = MPI.COMM_WORLD
    a, _, _ = train_steps(comm, overlap=True, fusion_elems=100)
    b, buckets, _ = train_steps(comm, overlap=False, fusion_elems=0)
    assert buckets == 1
    np.testing.assert_allclose(a, b, atol=1e-5)


# --- the summed loss and stop flag (fused.head) -------------------------------------

@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("staged", [False, True])
def test_every_rank_stops_after_the_same_step_whoever_asked(sharded, staged):
    """fused.head is read by the loop instead of the device: it must hold the
    sums (of the gathered buffer when sharded: the wire's head is partial
    there on most ranks) on every rank, so all break after the same step."""
    comm = MPI.COMM_WORLD
    ring = RingAllreduce(comm)
    # staged: LazyCopier (NaN-filled, lazy copies) standing in for the device; small chunks
    strategy = StagedAllreduce(ring, LazyCopier(), chunk_bytes=256) if staged else ring
    layers = mlp(hidden=(64, 32)).layer_ranges
    n = layers[-1][1]
    wire, pwire = Wire(n), Wire(n)
    rng = np.random.default_rng(comm.rank)
    for who in range(comm.size):
        fused = FusedAllreduce(strategy, wire.buffer, wire.ready_from(layers),
                               bucket_bounds(wire.size, 3000, wire.ready_from(layers)), overlap=True,
                               on_reduced=(lambda lo, hi: wire.pass_head(pwire, lo, hi)) if sharded else None,
                               gather=pwire.buffer if sharded else None)
        assert len(fused.buckets) > 1
        # [first step whose summed stop flag was set, steps whose summed loss was wrong]:
        # every step runs on every rank (communicate first, assert after).
        seen = np.zeros(2, np.int64)
        for step in range(1, 6):
            wire.body[...] = rng.random(n, dtype=np.float32)
            wire.loss[0] = comm.rank + step
            wire.set_stop(comm.rank == who and step == 3)
            for i in reversed(range(len(layers))):
                fused.layer_done(i)
            fused.wait()
            seen[1] += fused.head[LOSS] != sum(r + step for r in range(comm.size))
            if fused.head[STOP] > 0 and not seen[0]:
                seen[0] = step
        fused.close()
        everyone = np.zeros((comm.size, 2), np.int64)
        comm.Allgather(seen, everyone)
        assert everyone.tolist() == [[3, 0]] * comm.size, (who, everyone)


# --- GPU streams, on CPU: a stream per host thread (tests/gpu_fakes.py) ---------------

class DirectStandIn:
    """A CUDA-aware 'allreduce' of size 2 (x -> 2x + 1): it synchronizes the
    calling thread's stream, as the ring and MPI strategies do, then 'MPI'
    writes the device memory from the host."""
    size, rank, name = 2, 0, "direct"

    def __init__(self, cupy):
        self.cp = cupy

    def shard(self, n):
        return 0, n

    def allreduce(self, buf):
        self.cp.cuda.get_current_stream().synchronize()
        buf *= 2
        buf += 1
        return buf


@pytest.mark.parametrize("path", ["direct", "staged"])
def test_events_order_backprop_the_comm_thread_and_the_next_forward(path, threadstreams):
    """Per-thread streams: only the events fusion hands over order the comm
    thread after backprop's kernels and the next forward after the comm
    thread's updates; the main thread never synchronizes its stream, and
    fused.head has the sums without anyone waiting for the device."""
    cp = threadstreams
    layers = [(0, 10), (10, 24), (24, 38)]
    ready_from = Wire(38).ready_from(layers)
    buf = np.full(40, np.nan, np.float32).view(DevArray)     # the wire, on the 'device'
    params = np.zeros(40, np.float32).view(DevArray)
    if path == "direct":
        strategy, reduce = DirectStandIn(cp), (lambda v: v * 2 + 1)
    else:
        strategy, reduce = StagedAllreduce(Scale(), device.CudaCopier(cp), chunk_bytes=48), (lambda v: v * 3 + 1)

    def on_reduced(lo, hi):   # the optimizer's kernel, queued on the comm thread's stream
        launch(cp, lambda: np.subtract(params[lo:hi], buf[lo:hi], out=params[lo:hi]))

    fused = FusedAllreduce(strategy, buf, ready_from, bucket_bounds(buf.size, 1, ready_from), marks=device.CudaMarks(cp), on_reduced=on_reduced)
    assert fused.overlap and len(fused.buckets) == 3
    main = cp.cuda.get_current_stream()
    expect = np.zeros(40, np.float32)
    for step in range(4):
        seen = []
        launch(cp, lambda: seen.append(params.copy()))   # the forward reads the parameters
        main.synchronize()                               # (the test looks at what it read)
        assert np.array_equal(seen[0], expect), step
        syncs = len(main.synced_by)
        grads = np.arange(40, dtype=np.float32) * (step + 1) / 7
        grads[1] = step == 2                             # one step asks to stop
        launch(cp, lambda: np.copyto(buf[:2], grads[:2]))   # loss and stop, before backprop
        for i in reversed(range(3)):
            lo, hi = ready_from[i] if i else 2, ready_from[i + 1] if i < 2 else 40
            launch(cp, lambda lo=lo, hi=hi: np.copyto(buf[lo:hi], grads[lo:hi]))   # backprop of layer i
            fused.layer_done(i)
        fused.wait()
        assert main.synced_by[syncs:] == [], "the main thread waited for its stream"
        summed = reduce(grads)
        assert np.array_equal(fused.head, summed[:2]), (step, fused.head)
        expect -= summed
    fused.close()
