"""Ring allreduce against the definition and against MPI's own Allreduce.

    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_ring.py

Each test runs on COMM_WORLD and on COMM_SELF (size 1), and expectations are
computed from rank and size, so the file passes at any world size.
"""
import numpy as np
import pytest
from mpi4py import MPI

from collectives import COMMS, fives_around_a_view, rank0_copy
from hpctrain.comm import ring_allreduce as ring
from hpctrain.comm.mpi import MpiAllreduce
from hpctrain.comm.ring_allreduce import RingAllreduce, chunk_bounds


def lengths(size):
    seg = ring.SEGMENT_BYTES // 4
    return sorted({0, 1, max(size - 1, 0), size, size + 1, 7 * size + 3, 1000,
                   seg * size - 1, seg * size + 5, 3 * seg * size + 17})


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("cls", [RingAllreduce, MpiAllreduce])
def test_full_rank_sums_to_triangle_number(comm, cls):
    reduce = cls(comm)
    size, rank = comm.Get_size(), comm.Get_rank()
    for n in lengths(size):
        x = np.full(n, rank, dtype=np.float32)
        reduce.allreduce(x)
        assert np.all(x == sum(range(size))), f"n={n}"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ring_equals_mpi_allreduce_on_random_data(dtype):
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(comm.rank)
    for n in (5, 4099, 1 << 18):
        x = rng.standard_normal(n).astype(dtype)
        a, b = x.copy(), x.copy()
        RingAllreduce(comm).allreduce(a)
        MpiAllreduce(comm).allreduce(b)
        # Different summation orders: equal up to rounding.
        np.testing.assert_allclose(a, b, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-6)
        # Every rank ends with the same bits.
        assert np.array_equal(a, rank0_copy(comm, a))


@pytest.mark.mpi(min_size=2)
def test_ring_on_a_view_leaves_the_rest_of_the_buffer_alone():
    comm = MPI.COMM_WORLD
    buf, view = fives_around_a_view(comm, 1000, 100, 900)
    RingAllreduce(comm).allreduce(view)
    assert np.all(view == sum(range(1, comm.size + 1)))
    assert np.all(buf[:100] == 5) and np.all(buf[900:] == 5)


def test_chunk_bounds_cover_everything():
    for n in (0, 1, 5, 17, 1000):
        for parts in (1, 2, 3, 7):
            b = chunk_bounds(n, parts)
            assert b[0] == 0 and b[-1] == n and len(b) == parts + 1
            assert all(0 <= b[i + 1] - b[i] <= n // parts + 1 for i in range(parts))
