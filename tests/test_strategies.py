"""Every allreduce strategy keeps the one interface (comm/strategy.py):
reduce_scatter then allgather equals allreduce, each rank owns shard(n) and
the shards tile the buffer; and the factory (comm/__init__.py) picks and
wraps as the flags say, with the start-up line that explains it.

    python -m pytest -q tests/test_strategies.py
    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_strategies.py   # also -n 2, 4

Data are integer-valued floats, so every summation order gives the same
bits, and expectations are computed from rank and size: the tests pass at
any world size, on COMM_SELF (size 1) and COMM_WORLD.
"""
import numpy as np
import pytest
from mpi4py import MPI

from gpu_fakes import LazyCopier
from hpctrain.base import device
from hpctrain.comm import allreduce_plan, make_allreduce, nccl
from hpctrain.comm.device_buffers import BoundToDevice
from hpctrain.comm.mpi import MpiAllreduce
from hpctrain.comm.ring_allreduce import SEGMENT_BYTES, RingAllreduce
from hpctrain.comm.staged import StagedAllreduce
from hpctrain.comm.topology import Topology
from hpctrain.base.errors import HpctrainError

COMMS = [pytest.param(MPI.COMM_SELF, id="self"), pytest.param(MPI.COMM_WORLD, id="world")]

BUILD = {
    "ring": lambda comm: RingAllreduce(comm),
    "mpi": lambda comm: MpiAllreduce(comm),
    # small chunks: the staged allreduce runs several pipelined chunks
    "staged ring": lambda comm: StagedAllreduce(RingAllreduce(comm), LazyCopier(), chunk_bytes=4 * 7),
    "staged mpi": lambda comm: StagedAllreduce(MpiAllreduce(comm), device.HostCopier(), chunk_bytes=4 * 7),
    "bound ring": lambda comm: BoundToDevice(RingAllreduce(comm), np),
}


def lengths(size, name):
    """Odd lengths, lengths below the world size, and for the flat strategies
    one past the ring's segments (the staged ones would run thousands of
    7-element chunks on it: their inner strategy is tested here already)."""
    big = {SEGMENT_BYTES // 4 * size + 5} if "staged" not in name else set()
    return sorted({0, 1, max(size - 1, 0), size, size + 1, 7, 2 * size + 1, 1001} | big)


def contribution(n, rank, dtype):
    return (rank * 1000 + np.arange(n) % 97).astype(dtype)


def expected(n, size, dtype):
    return (1000 * sum(range(size)) + size * (np.arange(n) % 97)).astype(dtype)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("name", list(BUILD))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reduce_scatter_then_allgather_equals_allreduce(comm, name, dtype):
    strategy = BUILD[name](comm)
    size, rank = comm.Get_size(), comm.Get_rank()
    assert strategy.size == size
    for n in lengths(size, name):
        whole = contribution(n, rank, dtype)
        halves = whole.copy()
        strategy.allreduce(whole)
        lo, hi = strategy.reduce_scatter(halves)
        owned_ok = np.array_equal(halves[lo:hi], expected(n, size, dtype)[lo:hi])
        shards = np.empty((size, 2), np.int64)
        comm.Allgather(np.array([lo, hi], np.int64), shards)
        strategy.allgather(halves)
        assert np.array_equal(whole, expected(n, size, dtype)), (name, n)
        assert (lo, hi) == strategy.shard(n) and owned_ok, (name, n, lo, hi)
        # The shards tile [0, n): every element is owned by exactly one rank.
        tiles = sorted(map(tuple, shards.tolist()))
        assert tiles[0][0] == 0 and tiles[-1][1] == n, (name, n, tiles)
        assert all(tiles[i][1] == tiles[i + 1][0] for i in range(size - 1)), (name, n, tiles)
        assert np.array_equal(halves, whole), (name, n)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["ring", "mpi"])
def test_allgather_spreads_each_ranks_own_part(name):
    """allgather alone: each rank writes only its shard; everyone gets all shards."""
    comm = MPI.COMM_WORLD
    strategy = BUILD[name](comm)
    for n in (1, comm.size - 1, 2 * comm.size + 1, 1001):
        buf = np.full(n, -1.0, np.float32)
        lo, hi = strategy.shard(n)
        buf[lo:hi] = np.arange(lo, hi)
        strategy.allgather(buf)
        assert np.array_equal(buf, np.arange(n, dtype=np.float32)), n


def test_nccl_parts_must_be_equal():
    """NCCL's reduce_scatter/allgather take equal parts: another length is one
    clear error, before any NCCL call (a stand-in strategy, no GPU needed)."""
    strategy = object.__new__(nccl.NcclAllreduce)
    strategy.size, strategy.rank = 3, 1
    assert strategy.shard(9) == (3, 6) and strategy.shard(10) == (3, 6)
    for method in (strategy.reduce_scatter, strategy.allgather):
        with pytest.raises(HpctrainError, match="divisible by the number of ranks"):
            method(np.zeros(10, np.float32))


# --- the factory and the plan --------------------------------------------------

def test_numpy_strategy_is_the_plain_one():
    with Topology(MPI.COMM_SELF) as topology:
        ring = make_allreduce("ring", topology, np)
        mpi = make_allreduce("mpi", topology, np)
    assert type(ring) is RingAllreduce and type(mpi) is MpiAllreduce
    assert allreduce_plan("ring", np) == ""
    with pytest.raises(ValueError, match="unknown allreduce"):
        make_allreduce("tree", topology, np)


def test_nccl_on_the_cpu_is_one_clear_error():
    for mode in ("ring", "ps"):
        with pytest.raises(HpctrainError) as e:
            allreduce_plan("nccl", np, mode=mode)
        assert "--allreduce nccl needs a GPU" in str(e.value) and "\n" not in str(e.value)
    with Topology(MPI.COMM_SELF) as topology, pytest.raises(HpctrainError):
        make_allreduce("nccl", topology, np)
    with pytest.raises(HpctrainError, match="NCCL"):
        nccl.NcclAllreduce(MPI.COMM_SELF, np)
    assert nccl.nccl_or_reason(np)[0] is None


class FakeXp:
    """An array module the factory takes for a GPU one; its arrays are NumPy's."""
    __name__ = "fakecupy"


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(device, "is_gpu", lambda xp: xp is not np)
    monkeypatch.setattr(device, "copier", lambda xp: LazyCopier())
    monkeypatch.setattr(device, "current_device", lambda xp: None if xp is np else 0)
    monkeypatch.setattr(device, "use_device", lambda xp, device_id: None)
    return FakeXp()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("name", ["ring", "mpi"])
def test_device_buffers_take_the_path_the_flag_says(comm, name, fake_gpu):
    """The factory's GPU wiring on CPU: --cuda-aware no stages (and the staged
    strategy sums), yes passes the buffers straight on; both bound to the device."""
    size, rank = comm.Get_size(), comm.Get_rank()
    with Topology(comm) as topology:
        staged = make_allreduce(name, topology, fake_gpu, cuda_aware="no")
        direct = make_allreduce(name, topology, fake_gpu, cuda_aware="yes")
    assert isinstance(staged, BoundToDevice) and isinstance(staged.inner, StagedAllreduce)
    assert staged.path == "staged through pinned host memory (--cuda-aware no)"
    assert isinstance(direct, BoundToDevice) and type(direct.inner).name == name
    assert direct.path == "device buffers straight to MPI (--cuda-aware yes)"
    assert staged.size == direct.size == size
    for strategy in (staged, direct):
        x = np.full(1001, rank, np.float32)
        strategy.allreduce(x)
        assert np.all(x == sum(range(size)))
    assert allreduce_plan(name, fake_gpu, cuda_aware="no") == \
        f"gradients: {name} allreduce, staged through pinned host memory (--cuda-aware no)"
    assert allreduce_plan(name, fake_gpu, mode="ps", cuda_aware="yes") == \
        "ps workers: the model's device buffers straight to MPI (--cuda-aware yes)"
