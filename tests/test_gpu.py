"""GPU tests: CuPy against NumPy, and the device paths of the gradient
exchange. Every test here is marked `gpu` and skipped, with the reason, where
CuPy or a CUDA device is missing (CI, laptops).

    python -m pytest -q -m gpu tests/test_gpu.py
    mpirun -n 2 python -m mpi4py -m pytest -q --only-mpi -m gpu tests/test_gpu.py

The MPI-marked tests run on COMM_SELF and COMM_WORLD: ranks may share one GPU
(staged and direct paths allow it; NCCL does not, and says so).
tests/gpu/device_check.sh runs all of them on a GPU machine.
"""
import threading

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.base import device
from hpctrain.data import prefetch
from hpctrain.comm import allreduce_plan, make_allreduce
from hpctrain.comm.cuda_aware import cuda_aware
from hpctrain.comm.device_buffers import HostMirror, bcast
from hpctrain.comm.mpi import MpiAllreduce
from hpctrain.comm.records import allgather_bytes
from hpctrain.comm.ring_allreduce import RingAllreduce
from hpctrain.comm.staged import StagedAllreduce
from hpctrain.comm.topology import Topology
from hpctrain.base.errors import HpctrainError
from hpctrain.nn import mlp
from hpctrain.optim.optimizers import make_optimizer

cp, WHY = device._cupy_or_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason=f"needs CuPy and a CUDA GPU: {WHY}")]

COMMS = [pytest.param(MPI.COMM_SELF, id="self"), pytest.param(MPI.COMM_WORLD, id="world")]


# --- copies ------------------------------------------------------------------

def test_pinned_memory_and_async_copies_are_ordered_against_compute():
    c = device.copier(cp)
    assert isinstance(c, device.CudaCopier)
    n = 1 << 22
    host = c.host_empty(n, np.float32)
    assert isinstance(host, np.ndarray) and host.shape == (n,)
    dev = cp.zeros(n, np.float32)
    for value in (1.0, 2.0, 3.0):
        dev += 1.0    # queued on the compute stream, not waited for
        c.wait(c.to_host(dev, host, after=c.mark()))
        assert np.all(host == value)
    host[:] = 7
    c.use(c.to_device(host, dev, after=c.mark()))
    dev *= 2          # must run after the copy
    assert bool((dev == 14).all())


def test_staged_pipeline_with_cuda_streams_on_one_process():
    class Triple:   # a stand-in allreduce over "2 ranks": h = 3h
        size, name = 2, "triple"

        def allreduce(self, h):
            h *= 3
            return h

    for n, chunk in ((1, 4096), (1000, 4096), (3_000_001, 1 << 20)):
        staged = StagedAllreduce(Triple(), device.copier(cp), chunk_bytes=chunk)
        x = cp.arange(n, dtype=cp.float32)
        x += 1            # pending kernel: the first copy must wait for it
        staged.allreduce(x)
        x -= 1            # must run after the copies back
        expect = np.arange(n, dtype=np.float32) * 3 + 2
        np.testing.assert_array_equal(cp.asnumpy(x), expect)


# --- allreduce of CuPy buffers ---------------------------------------------------

@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("algo", [RingAllreduce, MpiAllreduce])
def test_staged_allreduce_of_cupy_buffers(comm, algo):
    size, rank = comm.Get_size(), comm.Get_rank()
    staged = StagedAllreduce(algo(comm), device.copier(cp), chunk_bytes=1 << 16)
    for n in (1, size + 1, 1000, 100_003, 1 << 20):
        x = cp.full(n, rank, np.float32)
        staged.allreduce(x)
        assert bool((x == sum(range(size))).all()), n


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("algo", [RingAllreduce, MpiAllreduce])
def test_direct_allreduce_of_cupy_buffers(comm, algo):
    aware, why = cuda_aware("auto")
    if comm.Get_size() > 1 and not aware:
        pytest.skip(f"MPI is not CUDA-aware ({why}): device pointers would crash it")
    size, rank = comm.Get_size(), comm.Get_rank()
    reduce = algo(comm)
    for n in (1, size + 1, 1000, 100_003, 1 << 20):
        x = cp.full(n, rank, np.float32)
        reduce.allreduce(x)
        assert bool((x == sum(range(size))).all()), n


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("algo", ["ring", "mpi"])
def test_make_allreduce_from_another_thread_matches_the_host_ring(comm, algo):
    """The factory's path (staged here unless MPI is CUDA-aware), called from a
    thread as fusion's communication thread does, equals the host ring."""
    size, rank = comm.Get_size(), comm.Get_rank()
    with Topology(comm) as topology:
        strategy = make_allreduce(algo, topology, cp)
    assert strategy.size == size
    rng = np.random.default_rng(rank)
    host = rng.standard_normal(300_007).astype(np.float32)
    dev = cp.asarray(host)
    errors = []

    def run():
        try:
            strategy.allreduce(dev)
        except Exception as exc:  # reported below, on the main thread
            errors.append(exc)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, errors
    RingAllreduce(comm).allreduce(host)
    np.testing.assert_allclose(cp.asnumpy(dev), host, rtol=1e-5, atol=1e-5)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("algo", ["ring", "mpi"])
def test_reduce_scatter_then_allgather_of_cupy_buffers(comm, algo):
    """The factory's strategy (direct or staged) keeps the interface on the device."""
    size, rank = comm.Get_size(), comm.Get_rank()
    with Topology(comm) as topology:
        strategy = make_allreduce(algo, topology, cp)
    for n in (1, max(size - 1, 1), 1001, 300_007):
        x = cp.full(n, rank, np.float32)
        lo, hi = strategy.reduce_scatter(x)
        assert (lo, hi) == strategy.shard(n) and bool((x[lo:hi] == sum(range(size))).all()), n
        strategy.allgather(x)
        assert bool((x == sum(range(size))).all()), n


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("comm", COMMS)
def test_nccl_allreduce_or_a_clear_error(comm):
    from hpctrain.comm import nccl
    lib, why = nccl.nccl_or_reason(cp)
    if lib is None:
        with pytest.raises(HpctrainError, match="nccl"):
            allreduce_plan("nccl", cp)
        pytest.skip(f"no NCCL here ({why}); the error says so")
    names = allgather_bytes(comm, nccl._device_name(cp, cp.cuda.runtime.getDevice()), nccl.DEVICE_NAME_BYTES)
    if nccl.shared_devices(names):
        with pytest.raises(HpctrainError, match="one GPU per rank"):
            nccl.NcclAllreduce(comm, cp)
        pytest.skip("ranks share a GPU: NCCL refuses, and the error says so")
    reduce = nccl.NcclAllreduce(comm, cp)
    size, rank = comm.Get_size(), comm.Get_rank()
    x = cp.full(100_003, rank, np.float32)
    reduce.allreduce(x)
    assert bool((x == sum(range(size))).all())
    y = cp.full(1000 * size, rank, np.float32)
    lo, hi = reduce.reduce_scatter(y)
    assert (lo, hi) == (1000 * rank, 1000 * (rank + 1)) and bool((y[lo:hi] == sum(range(size))).all())
    reduce.allgather(y)
    assert bool((y == sum(range(size))).all())


@pytest.mark.mpi(min_size=2)
def test_bcast_and_host_mirror_of_cupy_arrays():
    comm = MPI.COMM_WORLD
    a = cp.full(1000, comm.rank, np.float32)
    bcast(comm, a, root=comm.size - 1)
    assert bool((a == comm.size - 1).all())
    m = HostMirror(cp.full((4, 5), comm.rank, np.float64))
    assert m.staged and isinstance(m.host, np.ndarray)
    if comm.rank == 0:
        comm.Send(m.to_host(), dest=1)
    elif comm.rank == 1:
        comm.Recv(m.recv_buffer(), source=0)
        m.to_device()
        assert bool((m.array == 0).all())


# --- model, optimizer, training: CuPy equals NumPy -------------------------------

def test_forward_backward_equals_numpy():
    rng = np.random.default_rng(0)
    x = rng.random((64, 784)).astype(np.float32)
    y = rng.integers(0, 10, 64)
    cpu, gpu = mlp(hidden=(500, 500)).build(), mlp(hidden=(500, 500)).build(cp)
    cpu.init(3)
    gpu.init(3)
    assert np.array_equal(cpu.params, cp.asnumpy(gpu.params))
    lc = float(cpu.forward_backward(x, y))
    lg = float(gpu.forward_backward(cp.asarray(x), cp.asarray(y)))
    assert abs(lc - lg) < 1e-5 * max(1.0, abs(lc))
    np.testing.assert_allclose(cp.asnumpy(gpu.grads), cpu.grads, rtol=1e-4, atol=1e-6)
    lc, cc = (cpu.evaluate(x, y)[k] for k in ("loss", "correct"))
    lg, cg = (gpu.evaluate(cp.asarray(x), cp.asarray(y))[k] for k in ("loss", "correct"))
    assert cc == cg and abs(lc - lg) < 1e-4 * max(1.0, abs(lc))


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_optimizer_steps_equal_numpy(name):
    n = 100_003
    rng = np.random.default_rng(1)
    p = rng.standard_normal(n).astype(np.float32)
    pc, pg = p.copy(), cp.asarray(p)
    oc, og = make_optimizer(name, n), make_optimizer(name, n, cp)
    for step in range(60):   # past Adam's flush at step 50
        g = (rng.standard_normal(n) * (1e-3 if step % 7 else 1e-32)).astype(np.float32)
        oc.step(pc, g, 1e-2, 0.5)
        og.step(pg, cp.asarray(g), 1e-2, 0.5)
    np.testing.assert_allclose(cp.asnumpy(pg), pc, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_optimizer_kernel_gives_the_numpy_blocks_bits(name):
    """One CuPy kernel per range (NVRTC with --fmad=false) does the NumPy
    blocks' float32 operations in their order: the same bits, flush included."""
    n = 100_003
    rng = np.random.default_rng(2)
    p = rng.standard_normal(n).astype(np.float32)
    pc, pg = p.copy(), cp.asarray(p)
    oc = make_optimizer(name, n, weight_decay=0.01, fused=False)
    og = make_optimizer(name, n, cp, weight_decay=0.01)
    assert og._kernel is not None
    for step in range(60):
        g = (rng.standard_normal(n) * (1e-3 if step % 7 else 1e-32)).astype(np.float32)
        oc.begin(1e-2, 0.5)
        og.begin(1e-2, 0.5)
        for lo, hi in ((0, 777), (777, n)):
            oc.update(pc, g, lo, hi)
            og.update(pg, cp.asarray(g), lo, hi)
    assert np.array_equal(cp.asnumpy(pg).view(np.uint32), pc.view(np.uint32))
    for k, v in oc.state().items():
        assert np.array_equal(cp.asnumpy(og.state()[k]).view(np.uint32), v.view(np.uint32)), k


def test_prefetcher_yields_the_readers_batches(bundled_shards):
    from hpctrain.data import ShardReader
    plain = ShardReader(bundled_shards, 0, 1, 128, 5)
    fetched = prefetch.device_batches(ShardReader(bundled_shards, 0, 1, 128, 5), cp)
    assert isinstance(fetched, prefetch.Prefetcher)
    for step in range(100):
        x, y = plain.next_batch()
        dx, dy = fetched.next_batch()
        dx *= 1.0   # compute on the batch, queued behind its copy
        assert isinstance(dx, cp.ndarray) and dx.dtype == np.float32 and dy.dtype == np.int64
        np.testing.assert_array_equal(cp.asnumpy(dx), x)
        np.testing.assert_array_equal(cp.asnumpy(dy), y)
        assert fetched.position == plain.position, step
    plain.seek(1, 256)
    fetched.seek(1, 256)
    np.testing.assert_array_equal(cp.asnumpy(fetched.next_batch()[0]), plain.next_batch()[0])


def test_sgd_training_on_gpu_ends_where_cpu_training_ends(bundled_shards):
    """One rank, 50 SGD steps, the real batches: parameters within 1e-5."""
    from hpctrain.data import ShardReader
    out = {}
    for xp in (np, cp):
        model = mlp(hidden=(500, 500)).build(xp)
        model.init(0)
        opt = make_optimizer("sgd", model.num_params, xp)
        batches = prefetch.device_batches(ShardReader(bundled_shards, 0, 1, 32, 0), xp)
        for _ in range(50):
            x, y = batches.next_batch()
            model.forward_backward(xp.asarray(x), xp.asarray(y))
            opt.step(model.params, model.grads, 0.05)
        out[xp.__name__] = device.to_host(model.params)
    diff = float(np.abs(out["cupy"] - out["numpy"]).max())
    assert diff < 1e-5, diff


def test_use_device_binds_a_new_thread_to_the_callers_gpu():
    mine = device.current_device(cp)
    seen = []
    t = threading.Thread(target=lambda: (device.use_device(cp, mine), seen.append(device.current_device(cp))))
    t.start()
    t.join()
    assert seen == [mine]


# --- fusion's events and the ps worker's device buffers -----------------------------

@pytest.mark.parametrize("path", ["staged", "direct"])
def test_fusion_events_order_a_non_blocking_main_stream_and_the_comm_thread(path):
    """The main thread computes on a non-blocking stream, which CUDA's legacy
    default stream (the communication thread's) does not wait for, nor it
    for that: only fusion's events order backprop -> reduce -> update ->
    next forward. The 'backprop' is slow (a chain of matmuls) so a missing
    event shows as stale gradients or parameters."""
    from gpu_fakes import KernelUpdate, Scale
    from hpctrain.comm.fusion import FusedAllreduce, bucket_bounds

    class Direct:   # 'MPI' reading and writing device memory once the stream is synchronized
        size, rank, name = 2, 0, "direct"

        def shard(self, n):
            return 0, n

        def allreduce(self, buf):
            cp.cuda.get_current_stream().synchronize()
            host = cp.asnumpy(buf) * 2 + 1
            buf.set(host)
            cp.cuda.get_current_stream().synchronize()   # as MPI: written when the call returns
            return buf

    n, cuts = 3 << 20, [0, 1 << 20, 2 << 20]
    strategy, reduce = (Direct(), lambda v: v * 2 + 1) if path == "direct" else \
        (StagedAllreduce(Scale(), device.copier(cp)), lambda v: v * 3 + 1)
    wire, params = cp.zeros(n, np.float32), cp.zeros(n, np.float32)
    update = KernelUpdate(strategy, wire, bucket_bounds(wire.size, 1 << 20, cuts),
                          lambda lo, hi: params.__setitem__(slice(lo, hi), params[lo:hi] - wire[lo:hi]))
    fused = FusedAllreduce(update, cuts, marks=device.stream_marks(cp))
    assert fused.overlap and len(fused.buckets) == 3
    a = cp.full((2048, 2048), 1.0 / 2048, np.float32)
    expect = np.zeros(n, np.float32)
    with cp.cuda.Stream(non_blocking=True):
        for step in range(3):
            grads = np.random.default_rng(step).random(n, dtype=np.float32)
            for i in reversed(range(3)):
                for _ in range(50):   # slow, so the copy or MPI would overtake it without the event
                    a = a @ a * 2048 / 2048
                lo, hi = cuts[i], cuts[i + 1] if i < 2 else n
                wire[lo:hi] = cp.asarray(grads[lo:hi]) + (a[0, 0] - a[0, 0])
                fused.layer_done(i)
            fused.wait()
            seen = cp.asnumpy(params)   # the next 'forward' reads the parameters on this stream
            summed = reduce(grads)
            expect -= summed
            assert np.array_equal(seen, expect), step
    fused.close()


def test_ps_slices_pack_and_unpack_on_the_device():
    from hpctrain.comm.ps.placement import Slice
    flat = cp.arange(100, dtype=cp.float32)
    piece = Slice(flat, [(3, 10), (50, 61)])
    assert piece.packed and isinstance(piece.buf, cp.ndarray)
    piece.pack()
    want = np.r_[np.arange(3, 10), np.arange(50, 61)].astype(np.float32)
    assert np.array_equal(cp.asnumpy(piece.buf), want)
    piece.buf[...] = -1
    piece.unpack()
    host = cp.asnumpy(flat)
    assert (host[3:10] == -1).all() and (host[50:61] == -1).all() and host[10] == 10
