"""The GPU plumbing that runs without a GPU, beyond the comm strategies: the
CUDA copier (against a stand-in CuPy), the prefetcher's slots and positions,
GPU binding (with a stand-in CuPy), and the CPU fallbacks end to end. The
stand-ins are in tests/gpu_fakes.py; the staged strategy, HostMirror,
CUDA-aware detection and NCCL's id have their own files (test_staged.py,
test_device_buffers.py, test_cuda_aware.py, test_nccl.py).

    python -m pytest -q tests/test_gpu_on_cpu.py
    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_gpu_on_cpu.py
"""
import types

import numpy as np
import pytest
from mpi4py import MPI

from gpu_fakes import DevArray, LazyCopier, cudacopier  # noqa: F401 (a fixture)
from hpctrain.run import cluster
from hpctrain.base import device
from hpctrain.data import prefetch

NO_GPU = device._cupy_or_reason()[0] is None


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



# --- prefetching ---------------------------------------------------------------

def test_numpy_batches_come_straight_from_the_reader(bundled_shards):
    from hpctrain.data import ShardReader
    reader = ShardReader(bundled_shards, 0, 1, 16, 0)
    assert prefetch.device_batches(reader, np) is reader


@pytest.mark.parametrize("copier", ["host", "lazy", "cuda"])
def test_prefetched_batches_and_positions_equal_the_readers(bundled_shards, copier, cudacopier):
    from hpctrain.data import ShardReader
    plain = ShardReader(bundled_shards, 1, 2, 100, 3)
    c = {"host": device.HostCopier, "lazy": LazyCopier, "cuda": cudacopier}[copier]()
    fetched = prefetch.Prefetcher(ShardReader(bundled_shards, 1, 2, 100, 3), c)
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


@pytest.mark.parametrize("arrays", [("images",), ("labels",), ()])
def test_prefetched_batches_of_a_pipeline_stage_are_what_its_reader_reads(bundled_shards, arrays):
    """A reader of some arrays (a pipeline stage's, data/reader.py): the
    prefetcher hands out None for the rest and the same positions and draws."""
    from hpctrain.data import ShardReader
    plain = ShardReader(bundled_shards, 0, 2, 100, 3, arrays=arrays)
    fetched = prefetch.Prefetcher(ShardReader(bundled_shards, 0, 2, 100, 3, arrays=arrays), LazyCopier())
    for step in range(30):   # across an epoch's end
        got, want = fetched.next_batch(), plain.next_batch()
        for a, b in zip(got, want):
            assert (a is None and b is None) or np.array_equal(a, b), step
        assert fetched.position == plain.position and np.array_equal(fetched.last_draw[1], plain.last_draw[1])


def test_prefetcher_seek_right_after_construction_reads_nothing_first(bundled_shards):
    from hpctrain.data import ShardReader
    plain = ShardReader(bundled_shards, 0, 1, 50, 1)
    fetched = prefetch.Prefetcher(ShardReader(bundled_shards, 0, 1, 50, 1), LazyCopier())
    plain.seek(1, 100)
    fetched.seek(1, 100)
    assert np.array_equal(plain.next_batch()[0], fetched.next_batch()[0])


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
    assert "device cpu (--device auto: " in r.stdout and "pip install" not in r.stdout

