"""The GPU plumbing that runs without a GPU: staged allreduce (chunking and
pipelining, with NumPy arrays standing in for device arrays), CUDA-aware
detection, HostMirror, the prefetcher's slots and positions, NCCL's unique id
over MPI, GPU binding (with a stand-in CuPy), and the CPU fallbacks end to end.

    python -m pytest -q tests/test_buffers.py
    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_buffers.py

LazyCopier models CUDA streams on NumPy: a copy runs only when something
waits for it (or for a later copy on its stream), and fresh buffers are NaN,
so a missing wait or use() shows up as wrong numbers, not as luck. FakeCupy
goes one level lower: device.CudaCopier itself runs against it, its raw
memcpyAsync calls deferred per stream until an event or stream says so.
These check hpctrain's ordering logic and pointer arithmetic, not CUDA:
tests/test_gpu.py does that on a GPU.
"""
import argparse
import ctypes
import sys
import types

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain import cluster, device, prefetch
from hpctrain.comm import buffers, nccl
from hpctrain.comm.ring import MpiAllreduce, RingAllreduce
from hpctrain.errors import HpctrainError

COMMS = [pytest.param(MPI.COMM_SELF, id="self"), pytest.param(MPI.COMM_WORLD, id="world")]
NO_GPU = device._cupy_or_reason()[0] is None


class LazyCopier(device.HostCopier):
    """device.HostCopier with CUDA's freedom: each direction is a stream whose
    copies run as late as allowed (when waited for, or when a later copy on
    the same stream is)."""

    def __init__(self):
        self.queues = {"d2h": [], "h2d": []}
        self.copies = 0

    def host_empty(self, shape, dtype):
        return np.full(shape, np.nan, dtype) if np.dtype(dtype).kind == "f" else np.full(shape, -7, dtype)

    device_empty = host_empty

    def _enqueue(self, stream, dst, src):
        token = (stream, object())
        self.queues[stream].append((token, dst, src))
        return token

    def to_host(self, dev, host, after=None):
        return self._enqueue("d2h", host, dev)

    def to_device(self, host, dev, after=None):
        return self._enqueue("h2d", dev, host)

    def wait(self, token):
        if token is None:
            return
        queue = self.queues[token[0]]
        while queue:
            tok, dst, src = queue.pop(0)
            np.copyto(dst, src)
            self.copies += 1
            if tok is token:
                return

    use = wait  # NumPy 'compute' is synchronous: waiting in the stream = waiting now

    def idle(self):
        return not any(self.queues.values())


class Scale:
    """A stand-in allreduce of 'size' 2 for serial tests: h = 3h + 1, chunk lengths recorded."""
    size = 2
    name = "scale"

    def __init__(self):
        self.lengths = []

    def __call__(self, h):
        self.lengths.append(h.size)
        h *= 3
        h += 1
        return h


class FakeStream:
    """A CUDA stream whose work (copies) runs only when someone waits for it.
    The null stream stands for compute, which NumPy does at once."""
    registry = {}

    def __init__(self, null=False, non_blocking=False):
        self.null, self.queue, self.done = null, [], 0
        self.ptr = 0 if null else id(self)
        FakeStream.registry[self.ptr] = self

    def run_until(self, n):
        while self.done < n:
            op = self.queue[self.done]
            self.done += 1
            op()

    def synchronize(self):
        self.run_until(len(self.queue))

    def wait_event(self, event):
        if self.null:
            event.synchronize()
        else:  # later work on this stream waits for the event's work
            self.queue.append(event.synchronize)


class FakeEvent:
    def __init__(self, block=False, disable_timing=False):
        self.stream, self.pos = None, 0

    def record(self, stream=None):
        self.stream, self.pos = stream, len(stream.queue)

    def synchronize(self):
        if self.stream is not None:
            self.stream.run_until(self.pos)


class DevArray(np.ndarray):
    """NumPy memory posing as device memory: .data.ptr, as CuPy has."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


def fake_cupy():
    null = FakeStream(null=True)

    def memcpy_async(dst, src, size, kind, stream_ptr):
        assert kind in (1, 2) and size > 0
        FakeStream.registry[stream_ptr].queue.append(lambda: ctypes.memmove(dst, src, size))
        if stream_ptr == 0:
            FakeStream.registry[0].synchronize()

    runtime = types.SimpleNamespace(memcpyAsync=memcpy_async, memcpyHostToDevice=1, memcpyDeviceToHost=2)
    cuda = types.SimpleNamespace(Stream=FakeStream, Event=FakeEvent, runtime=runtime,
                                 get_current_stream=lambda: null,
                                 alloc_pinned_memory=lambda nbytes: bytearray(nbytes))

    def empty(shape, dtype):
        return np.full(shape, np.nan if np.dtype(dtype).kind == "f" else -7, dtype).view(DevArray)
    return types.SimpleNamespace(cuda=cuda, empty=empty, __name__="cupy")


@pytest.fixture
def cudacopier(monkeypatch):
    fake = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)  # device.pinned_empty imports it
    return lambda: device.CudaCopier(fake)


def test_cuda_copier_defers_copies_until_waited_for(cudacopier):
    c = cudacopier()
    dev = np.arange(10, dtype=np.float32).view(DevArray)
    host = c.host_empty(10, np.float32)
    assert isinstance(host, np.ndarray) and host.shape == (10,)
    token = c.to_host(dev[2:7], host[2:7], after=c.mark())
    assert not np.array_equal(host[2:7], dev[2:7])   # still "in flight"
    c.wait(token)
    assert np.array_equal(host[2:7], dev[2:7])
    host[:] = -1
    c.use(c.to_device(host[:4], dev[:4]))
    assert np.all(dev[:4] == -1) and np.all(dev[4:] == np.arange(4, 10))
    with pytest.raises(ValueError):
        c.to_host(dev[:3], host[:4])


# --- staged allreduce ------------------------------------------------------

@pytest.mark.parametrize("copier", ["host", "lazy", "cuda"])
@pytest.mark.parametrize("n,chunk_elems", [(1, 4), (7, 4), (8, 4), (1000, 1000), (1001, 1000), (10_000, 333)])
def test_staged_chunks_cover_the_buffer_and_every_copy_is_waited_for(copier, n, chunk_elems, cudacopier):
    c = {"host": device.HostCopier, "lazy": LazyCopier, "cuda": cudacopier}[copier]()
    inner = Scale()
    staged = buffers.StagedAllreduce(inner, c, chunk_bytes=chunk_elems * 4)
    x = np.arange(n, dtype=np.float32).view(DevArray)
    staged(x)
    np.testing.assert_array_equal(x, np.arange(n, dtype=np.float32) * 3 + 1)
    assert sum(inner.lengths) == n and max(inner.lengths) <= chunk_elems
    assert len(inner.lengths) == -(-n // chunk_elems)
    if isinstance(c, LazyCopier):
        assert c.idle() and c.copies == 2 * len(inner.lengths)
    # The host buffer is kept: a second call of the same size allocates nothing.
    host = staged._host
    staged(x)
    assert staged._host is host


def test_staged_single_rank_or_empty_does_nothing():
    c = LazyCopier()
    one = types.SimpleNamespace(size=1, name="one", __call__=None)
    staged = buffers.StagedAllreduce(one, c)
    x = np.ones(10, np.float32)
    assert staged(x) is x and c.copies == 0
    assert buffers.StagedAllreduce(Scale(), c)(np.ones(0, np.float32)).size == 0 and c.copies == 0


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("algo", [RingAllreduce, MpiAllreduce])
@pytest.mark.parametrize("copier", [device.HostCopier, LazyCopier])
def test_staged_full_rank_sums_to_triangle_number(comm, algo, copier):
    size, rank = comm.Get_size(), comm.Get_rank()
    staged = buffers.StagedAllreduce(algo(comm), copier(), chunk_bytes=4 * 1000)
    for n in (1, size - 1, size + 1, 999, 1000, 1001, 7 * 1000 + 3, 100_003):
        x = np.full(n, rank, np.float32)
        staged(x)
        assert np.all(x == sum(range(size))), f"n={n}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("chunk_elems", [1, 5, 4096, 1 << 20])
def test_staged_equals_the_ring_per_chunk_bit_for_bit(chunk_elems):
    """Same bits as the plain ring applied chunk by chunk (so the same on
    every rank), and within rounding of one ring over the whole buffer."""
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(comm.rank)
    n = 30_011 if chunk_elems > 1 else 301
    x = rng.standard_normal(n).astype(np.float32)
    staged, per_chunk, whole = x.copy(), x.copy(), x.copy()
    buffers.StagedAllreduce(RingAllreduce(comm), LazyCopier(), chunk_bytes=4 * chunk_elems)(staged)
    ring = RingAllreduce(comm)
    for lo in range(0, n, chunk_elems):
        ring(per_chunk[lo:lo + chunk_elems])
    ring(whole)
    assert np.array_equal(staged, per_chunk)
    np.testing.assert_allclose(staged, whole, rtol=1e-5, atol=1e-5)
    first = staged.copy()
    comm.Bcast(first, root=0)
    assert np.array_equal(staged, first)


@pytest.mark.mpi(min_size=2)
def test_staged_on_a_view_leaves_the_rest_alone():
    comm = MPI.COMM_WORLD
    buf = np.full(5000, 5.0, np.float32)
    view = buf[100:4900]
    view[:] = comm.rank + 1
    buffers.StagedAllreduce(RingAllreduce(comm), LazyCopier(), chunk_bytes=4 * 700)(view)
    assert np.all(view == sum(range(1, comm.size + 1)))
    assert np.all(buf[:100] == 5) and np.all(buf[4900:] == 5)


# --- the factory and the plan --------------------------------------------------

def flags(**kw):
    base = dict(allreduce="ring", cuda_aware="auto", mode="ring", device="auto")
    base.update(kw)
    return argparse.Namespace(**base)


def test_numpy_exchange_is_the_plain_allreduce():
    ring = buffers.make_exchange(flags(), MPI.COMM_SELF, np)
    mpi = buffers.make_exchange(flags(allreduce="mpi"), MPI.COMM_SELF, np)
    assert type(ring) is RingAllreduce and type(mpi) is MpiAllreduce
    assert buffers.exchange_plan(flags(), np) == ""
    assert buffers.wrap_for_device(ring, np) is ring


def test_nccl_on_the_cpu_is_one_clear_error():
    for f in (flags(allreduce="nccl"), flags(allreduce="nccl", device="cpu")):
        with pytest.raises(HpctrainError) as e:
            buffers.exchange_plan(f, np)
        assert "--allreduce nccl needs a GPU" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(HpctrainError):
        buffers.make_exchange(flags(allreduce="nccl"), MPI.COMM_SELF, np)
    with pytest.raises(HpctrainError, match="NCCL"):
        nccl.NcclAllreduce(MPI.COMM_SELF, np)
    assert nccl.nccl_or_reason(np)[0] is None


# --- CUDA-aware detection ------------------------------------------------------

def test_this_mpi_is_asked_and_answers():
    aware, why = buffers.query_cuda_support()
    assert isinstance(aware, bool) and why
    assert buffers._loaded_libmpi(), "libmpi is mapped into this process"
    if "MPICH" in MPI.Get_library_version():
        # the PyPI mpich wheel is built without CUDA
        assert "MPIX_GPU_query_support(CUDA) = 0" in why and not aware
    assert buffers.cuda_aware("yes") == (True, "--cuda-aware yes")
    assert buffers.cuda_aware("no") == (False, "--cuda-aware no")
    assert buffers.cuda_aware("auto") == (aware, why)


def fake_lib(**functions):
    lib = types.SimpleNamespace()
    for name, fn in functions.items():
        setattr(lib, name, fn)
    return lib


def test_detection_reads_each_librarys_own_query():
    def mpich_query(kind, flag_ref):
        assert kind == 0  # MPIX_GPU_SUPPORT_CUDA
        flag_ref._obj.value = 1
        return 0
    aware, why = buffers.query_cuda_support([fake_lib(MPIX_GPU_query_support=mpich_query)])
    assert aware and "MPIX_GPU_query_support(CUDA) = 1" in why
    aware, why = buffers.query_cuda_support([fake_lib(MPIX_Query_cuda_support=lambda: 1)])
    assert aware and "MPIX_Query_cuda_support() = 1" in why
    aware, why = buffers.query_cuda_support([fake_lib(MPIX_Query_cuda_support=lambda: 0)])
    assert not aware
    aware, why = buffers.query_cuda_support([fake_lib(), fake_lib()])
    assert not aware and "not CUDA-aware" in why


@pytest.mark.mpi(min_size=2)
def test_ranks_agree_on_one_path(capsys):
    comm = MPI.COMM_WORLD
    assert buffers._agree(comm, True) is True
    assert buffers._agree(comm, False) is False
    assert buffers._agree(comm, comm.rank != comm.size - 1) is False


# --- HostMirror and bcast ---------------------------------------------------------

def test_host_mirror_of_a_numpy_array_is_the_array():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    m = buffers.HostMirror(a)
    assert not m.staged and m.to_host() is a and m.recv_buffer() is a and m.to_device() is a
    with pytest.raises(ValueError):
        buffers.HostMirror(np.arange(10.0)[::2])


@pytest.mark.parametrize("copier", ["lazy", "cuda"])
def test_host_mirror_staging_logic_round_trips(copier, cudacopier):
    dev = np.arange(12, dtype=np.float32).reshape(3, 4).view(DevArray)
    c = LazyCopier() if copier == "lazy" else cudacopier()
    m = buffers.HostMirror(dev, copier=c)  # staged, NumPy standing in for the device
    assert m.staged and m.host is not dev and m.host.shape == (3, 4)
    assert np.array_equal(m.to_host(), dev)
    m.recv_buffer()[...] = -1
    m.to_device()
    assert np.all(dev == -1)
    m.recv_buffer()[...] = -2   # the copy back has read the host buffer before it is reused
    assert np.all(dev == -1)


@pytest.mark.mpi(min_size=2)
def test_bcast_and_mirrored_send_recv():
    comm = MPI.COMM_WORLD
    a = np.full(1000, comm.rank, np.float32)
    buffers.bcast(comm, a, root=comm.size - 1)
    assert np.all(a == comm.size - 1)
    m = buffers.HostMirror(np.full(10, comm.rank, np.float64))
    if comm.rank == 0:
        comm.Send(m.to_host(), dest=1)
    elif comm.rank == 1:
        comm.Recv(m.recv_buffer(), source=0)
        m.to_device()
        assert np.all(m.array == 0)


# --- prefetching ---------------------------------------------------------------

@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from hpctrain import data
    out = tmp_path_factory.mktemp("shards") / "mnist"
    data.prepare(data.bundled_sample_dir(), str(out), shards=2, log=lambda *a, **k: None)
    return str(out)


def test_numpy_batches_come_straight_from_the_reader(shards):
    from hpctrain.data import ShardReader
    reader = ShardReader(shards, 0, 1, 16, 0)
    assert prefetch.device_batches(reader, np) is reader


@pytest.mark.parametrize("copier", ["host", "lazy", "cuda"])
def test_prefetched_batches_and_positions_equal_the_readers(shards, copier, cudacopier):
    from hpctrain.data import ShardReader
    plain = ShardReader(shards, 1, 2, 100, 3)
    c = {"host": device.HostCopier, "lazy": LazyCopier, "cuda": cudacopier}[copier]()
    fetched = prefetch.device_batches(ShardReader(shards, 1, 2, 100, 3), np, c)
    assert isinstance(fetched, prefetch.Prefetcher) and fetched.batch_size == 100
    assert fetched.position == plain.position
    for step in range(60):  # several epochs of this worker's ~2250 samples
        x, y = plain.next_batch()
        dx, dy = fetched.next_batch()
        assert np.array_equal(x, dx) and np.array_equal(y, dy), step
        assert fetched.position == plain.position, step
    # Resume elsewhere: the batch read ahead is dropped.
    plain.seek(2, 400)
    fetched.seek(2, 400)
    assert fetched.position == (2, 400)
    for _ in range(5):
        x, _ = plain.next_batch()
        dx, _ = fetched.next_batch()
        assert np.array_equal(x, dx) and fetched.position == plain.position


def test_prefetcher_seek_right_after_construction_reads_nothing_first(shards):
    from hpctrain.data import ShardReader
    plain = ShardReader(shards, 0, 1, 50, 1)
    fetched = prefetch.Prefetcher(ShardReader(shards, 0, 1, 50, 1), LazyCopier())
    plain.seek(1, 100)
    fetched.seek(1, 100)
    assert np.array_equal(plain.next_batch()[0], fetched.next_batch()[0])


# --- NCCL id over MPI ------------------------------------------------------------

def test_unique_id_round_trips_signed_and_unsigned_chars():
    rng = np.random.default_rng(0)
    for lo, hi in ((-128, 128), (0, 256)):
        uid = tuple(int(v) for v in rng.integers(lo, hi, nccl.UNIQUE_ID_BYTES))
        record = nccl.encode_unique_id(uid)
        assert record.dtype == np.int16 and record[0] == 1
        assert nccl.decode_unique_id(record) == uid
    with pytest.raises(ValueError):
        nccl.encode_unique_id((1, 2, 3))
    assert nccl.version_text(22105) == "2.21.5" and nccl.version_text(2804) == "2.8.4"


@pytest.mark.mpi(min_size=2)
def test_unique_id_reaches_every_rank_and_a_failure_stops_all():
    comm = MPI.COMM_WORLD
    uid = tuple(range(-64, 64))
    got = nccl.share_unique_id(comm, lambda: uid if comm.rank == 0 else 1 / 0)
    assert got == uid

    def broken():
        raise RuntimeError("no network interface")
    with pytest.raises(HpctrainError) as e:
        nccl.share_unique_id(comm, broken)
    assert e.value.collective and e.value.report == (comm.rank == 0)
    if comm.rank == 0:
        assert "no network interface" in str(e.value)


@pytest.mark.mpi(min_size=2)
def test_ranks_sharing_a_gpu_are_found():
    comm = MPI.COMM_WORLD
    names = nccl.gather_text(comm, f"node GPU {comm.rank // 2}")
    assert names == [f"node GPU {r // 2}" for r in range(comm.size)]
    shared = nccl.shared_devices(names)
    assert shared == {f"node GPU {g}": [2 * g, 2 * g + 1] for g in range(comm.size // 2)}
    assert nccl.shared_devices([f"GPU {r}" for r in range(comm.size)]) == {}


# --- GPU binding ------------------------------------------------------------------

class FakeCupy:
    """Just enough of CuPy for binding: device count and Device(i).use()."""

    def __init__(self, count):
        self.used = []
        used = self.used
        current = [0]

        class Device:
            def __init__(self, i):
                self.i = i

            def use(self):
                used.append(self.i)
                current[0] = self.i

        runtime = types.SimpleNamespace(getDeviceCount=lambda: count, getDevice=lambda: current[0])
        self.cuda = types.SimpleNamespace(runtime=runtime, Device=Device)


@pytest.fixture
def binding(monkeypatch):
    monkeypatch.setattr(cluster, "_GPU_BINDING", {"device": None, "local_rank": None, "count": 0})
    return cluster._GPU_BINDING


@pytest.mark.parametrize("env,gpu", [
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "3"}, 1),
    ({"PMI_RANK": "2", "MPI_LOCALRANKID": "2"}, 0),
    ({"PMIX_RANK": "9", "PMIX_LOCAL_RANK": "1"}, 1),
    ({"SLURM_PROCID": "7", "SLURM_LOCALID": "4"}, 0),
])
def test_bind_gpu_deals_local_ranks_over_the_gpus(binding, env, gpu):
    fake = FakeCupy(2)
    note = cluster.bind_gpu("auto", env, cupy=fake)
    assert fake.used == [gpu] and binding["device"] == gpu and binding["count"] == 2
    assert note.startswith(f"GPU {gpu} of 2")


def test_bind_gpu_leaves_cpu_runs_and_unknown_launchers_alone(binding):
    fake = FakeCupy(4)
    assert cluster.bind_gpu("cpu", {"PMI_RANK": "1", "MPI_LOCALRANKID": "1"}, cupy=fake) == ""
    assert cluster.bind_gpu("gpu", {}, cupy=fake) == ""
    assert fake.used == [] and binding["count"] == 4 and binding["local_rank"] is None
    assert cluster.bind_gpu("auto", {"PMI_RANK": "0", "MPI_LOCALRANKID": "0"}, cupy=FakeCupy(0)) == ""
    assert cluster.gpu_for(5, 4) == 1 and cluster.gpu_for(0, 1) == 0


def test_configure_process_without_cupy_says_nothing_about_gpus(binding):
    env = {"PMI_RANK": "0", "PMI_SIZE": "1", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"}
    note = cluster.configure_process(env, device="cpu")
    assert "GPU" not in note and "BLAS threads" in note


@pytest.mark.mpi(min_size=2)
def test_confirm_rebinds_where_the_launcher_disagreed_and_the_chief_warns(binding, capsys):
    comm = MPI.COMM_WORLD
    c = cluster.Cluster(comm)
    fake = FakeCupy(2)
    # Pretend the launcher gave rank 0 the wrong local rank before MPI_Init.
    launcher = c.local_rank + 1 if comm.rank == 0 else c.local_rank
    binding.update(local_rank=launcher, device=cluster.gpu_for(launcher, 2), count=2)
    fake.cuda.Device(binding["device"]).use()   # what bind_gpu did
    fake.used.clear()
    note = c.confirm_gpu_binding("auto", cupy=fake)
    want = cluster.gpu_for(c.local_rank, 2)
    assert fake.cuda.runtime.getDevice() == want and binding["device"] == want
    assert fake.used == ([want] if comm.rank == 0 else [])
    assert note.startswith(f"GPU {want} of 2 by node-local rank {c.local_rank}/")
    err = capsys.readouterr().err
    if comm.rank == 0:
        assert "warning: on 1 of " in err and "rebound" in err
    assert c.confirm_gpu_binding("cpu", cupy=fake) == ""


# --- the CPU fallbacks, end to end ------------------------------------------------

@pytest.mark.skipif(not NO_GPU, reason="a GPU is usable here: --device gpu would not fail")
def test_device_gpu_without_a_gpu_is_one_line_and_exit_2(job, tmp_path):
    r = job(2, "--device", "gpu", "--steps", "2", "--save", tmp_path / "p.h5")
    assert r.returncode == 2, r.stderr
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert len(lines) == 1 and lines[0].startswith("hpctrain: error: --device gpu: "), r.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(not NO_GPU, reason="a GPU is usable here: auto would not fall back")
def test_auto_nccl_on_the_cpu_is_one_line_and_auto_falls_back(job, tmp_path):
    r = job(2, "--device", "auto", "--allreduce", "nccl", "--steps", "2")
    assert r.returncode == 2, r.stderr
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert len(lines) == 1 and "--allreduce nccl needs a GPU" in lines[0], r.stderr
    r = job(2, "--device", "auto", "--steps", "3", "--log-every", "3")
    assert r.returncode == 0, r.stderr
    assert "device cpu (--device auto fell back to CPU: " in r.stdout
