"""Staged strategy (comm/staged.py): device buffers through pinned host
memory, chunked and pipelined, with NumPy arrays standing in for device
arrays (tests/gpu_fakes.py).

    python -m pytest -q tests/test_staged.py
    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_staged.py
"""
import types

import numpy as np
import pytest
from mpi4py import MPI

from collectives import COMMS, fives_around_a_view, rank0_copy
from gpu_fakes import DevArray, LazyCopier, Scale, cudacopier  # noqa: F401 (a fixture)
from hpctrain.base import device
from hpctrain.comm.mpi import MpiAllreduce
from hpctrain.comm.ring_allreduce import RingAllreduce
from hpctrain.comm.staged import StagedAllreduce


@pytest.mark.parametrize("copier", ["host", "lazy", "cuda"])
@pytest.mark.parametrize("n,chunk_elems", [(1, 4), (7, 4), (8, 4), (1000, 1000), (1001, 1000), (10_000, 333)])
def test_staged_chunks_cover_the_buffer_and_every_copy_is_waited_for(copier, n, chunk_elems, cudacopier):
    c = {"host": device.HostCopier, "lazy": LazyCopier, "cuda": cudacopier}[copier]()
    inner = Scale()
    staged = StagedAllreduce(inner, c, chunk_bytes=chunk_elems * 4)
    x = np.arange(n, dtype=np.float32).view(DevArray)
    staged.allreduce(x)
    np.testing.assert_array_equal(x, np.arange(n, dtype=np.float32) * 3 + 1)
    assert sum(inner.lengths) == n and max(inner.lengths) <= chunk_elems
    assert len(inner.lengths) == -(-n // chunk_elems)
    if isinstance(c, LazyCopier):
        assert c.idle() and c.copies == 2 * len(inner.lengths)
    # The host buffer is kept: a second call of the same size allocates nothing.
    host = staged._host
    staged.allreduce(x)
    assert staged._host is host


def test_staged_single_rank_or_empty_does_nothing():
    c = LazyCopier()
    one = types.SimpleNamespace(size=1, name="one", __call__=None)
    staged = StagedAllreduce(one, c)
    x = np.ones(10, np.float32)
    assert staged.allreduce(x) is x and c.copies == 0
    assert StagedAllreduce(Scale(), c).allreduce(np.ones(0, np.float32)).size == 0 and c.copies == 0


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("algo", [RingAllreduce, MpiAllreduce])
@pytest.mark.parametrize("copier", [device.HostCopier, LazyCopier])
def test_staged_full_rank_sums_to_triangle_number(comm, algo, copier):
    size, rank = comm.Get_size(), comm.Get_rank()
    staged = StagedAllreduce(algo(comm), copier(), chunk_bytes=4 * 1000)
    for n in (1, size - 1, size + 1, 999, 1000, 1001, 7 * 1000 + 3, 100_003):
        x = np.full(n, rank, np.float32)
        staged.allreduce(x)
        assert np.all(x == sum(range(size))), f"n={n}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("chunk_elems", [1, 5, 4096, 1 << 20])
def test_staged_equals_the_ring_per_chunk_bit_for_bit(chunk_elems):
    """Same bits as the plain ring applied chunk by chunk (so the same on
    every rank), and within rounding of one ring over the whole buffer."""
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(comm.rank)
    # tiny chunks: 60 of them and a tail of one element (30,011 elements in
    # chunks of 5 were some 12,000 ring allreduces, minutes at 4 ranks on 2 cores)
    n = 30_011 if chunk_elems > 5 else 60 * chunk_elems + 1
    x = rng.standard_normal(n).astype(np.float32)
    staged, per_chunk, whole = x.copy(), x.copy(), x.copy()
    StagedAllreduce(RingAllreduce(comm), LazyCopier(), chunk_bytes=4 * chunk_elems).allreduce(staged)
    ring = RingAllreduce(comm)
    for lo in range(0, n, chunk_elems):
        ring.allreduce(per_chunk[lo:lo + chunk_elems])
    ring.allreduce(whole)
    assert np.array_equal(staged, per_chunk)
    np.testing.assert_allclose(staged, whole, rtol=1e-5, atol=1e-5)
    assert np.array_equal(staged, rank0_copy(comm, staged))


@pytest.mark.mpi(min_size=2)
def test_staged_on_a_view_leaves_the_rest_alone():
    comm = MPI.COMM_WORLD
    buf, view = fives_around_a_view(comm, 5000, 100, 4900)
    StagedAllreduce(RingAllreduce(comm), LazyCopier(), chunk_bytes=4 * 700).allreduce(view)
    assert np.all(view == sum(range(1, comm.size + 1)))
    assert np.all(buf[:100] == 5) and np.all(buf[4900:] == 5)


