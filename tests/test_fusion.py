"""Bucket fusion with overlap gives the same bits as reducing the same buckets
one after another, and buckets end on layer boundaries; on a GPU (stand-in
streams, one per host thread) events order backprop, the communication
thread and the next forward without a host synchronization.

    python -m pytest -q tests/test_fusion.py
    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_fusion.py
"""
import numpy as np
import pytest
from mpi4py import MPI

from gpu_fakes import DevArray, KernelUpdate, Scale, launch, threadstreams  # noqa: F401 (a fixture)
from hpctrain.base import device
from hpctrain.comm.data_parallel import DataParallelUpdate, Part, model_buckets
from hpctrain.comm.fusion import FusedAllreduce, bucket_bounds, ready_from
from hpctrain.comm.ring_allreduce import RingAllreduce
from hpctrain.comm.staged import StagedAllreduce
from hpctrain.nn import mlp


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
    """A few steps of the real loop's arithmetic: the gradient buffer in buckets."""
    rng = np.random.default_rng(comm.rank)
    model = mlp(hidden=(64, 32)).build()
    model.init(0)
    update = DataParallelUpdate([Part(model.params, model.grads)],
                                model_buckets(model.layer_ranges, model.num_params, fusion_elems),
                                RingAllreduce(comm), ("adam", {}), np, 1.0 / comm.size)
    fused = FusedAllreduce(update, ready_from(model.layer_ranges), overlap=overlap)
    loss = np.zeros(1, np.float32)
    for _ in range(steps):
        x = rng.random((16, 784)).astype(np.float32)
        y = rng.integers(0, 10, 16)
        update.begin(1e-3)
        model.forward_backward(x, y, on_layer_done=fused.layer_done, loss_out=loss)
        fused.wait()
    fused.close()
    return model.params.copy(), len(fused.buckets), float(loss[0])


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
    the sums are right."""
    cp = threadstreams
    layers = [(0, 12), (12, 26), (26, 40)]
    starts = ready_from(layers)
    buf = np.full(40, np.nan, np.float32).view(DevArray)     # the gradients, on the 'device'
    params = np.zeros(40, np.float32).view(DevArray)
    if path == "direct":
        strategy, reduce = DirectStandIn(cp), (lambda v: v * 2 + 1)
    else:
        strategy, reduce = StagedAllreduce(Scale(), device.CudaCopier(cp), chunk_bytes=48), (lambda v: v * 3 + 1)

    def on_reduced(lo, hi):   # the optimizer's kernel, queued on the comm thread's stream
        launch(cp, lambda: np.subtract(params[lo:hi], buf[lo:hi], out=params[lo:hi]))

    fused = FusedAllreduce(KernelUpdate(strategy, buf, bucket_bounds(buf.size, 1, starts), on_reduced), starts,
                           marks=device.CudaMarks(cp))
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
        for i in reversed(range(3)):
            lo, hi = layers[i]
            launch(cp, lambda lo=lo, hi=hi: np.copyto(buf[lo:hi], grads[lo:hi]))   # backprop of layer i
            fused.layer_done(i)
        fused.wait()
        assert main.synced_by[syncs:] == [], "the main thread waited for its stream"
        expect -= reduce(grads)
    fused.close()
