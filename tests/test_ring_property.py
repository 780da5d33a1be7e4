"""Property: the ring allreduce equals np.sum, for random lengths and world
sizes (sub-communicators of COMM_WORLD made with Split), with Hypothesis
(issue 10 §5) when it is installed; a fixed sweep through the same check
runs either way.

    mpirun -n 4 python -m mpi4py -m pytest --only-mpi tests/test_ring_property.py

Under MPI every rank must draw the same examples, or the ranks would call
Split and the ring with different arguments and wait for each other forever:
derandomize=True (examples from a fixed seed, no example database) makes
every rank's Hypothesis produce the same sequence, and the check's verdict is
agreed by all ranks (an Allreduce) before anything is asserted, so a failure
shrinks the same way everywhere. Values are integer-valued floats: every
summation order gives the same, exact sum.
"""
import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.comm.ring_allreduce import RingAllreduce

try:
    from hypothesis import given, settings, strategies as st
except ImportError:  # not a dependency: the property test skips, the sweep runs
    given = None


def ring_matches_sum(n, ranks, seed, dtype=np.float32):
    """On a sub-communicator of min(ranks, world size) ranks: the ring's result
    == np.sum of every rank's contribution (all contributions are drawn from
    `seed` on every rank). Collective over COMM_WORLD; the same verdict on all
    ranks."""
    world = MPI.COMM_WORLD
    size = min(ranks, world.size)
    sub = world.Split(0 if world.rank < size else MPI.UNDEFINED, world.rank)
    everyone = np.random.default_rng(seed).integers(-1000, 1001, (size, n)).astype(dtype)
    ok = 1
    if sub != MPI.COMM_NULL:
        ring = RingAllreduce(sub)
        x = everyone[sub.Get_rank()].copy()
        ring.allreduce(x)
        ok = int(np.array_equal(x, everyone.sum(axis=0)))
        ring.free()
        sub.Free()
    verdict = np.array([ok], np.int64)
    world.Allreduce(MPI.IN_PLACE, verdict, op=MPI.MIN)
    return bool(verdict[0])


@pytest.mark.mpi(min_size=1)
def test_ring_equals_np_sum_on_a_fixed_sweep():
    world = MPI.COMM_WORLD
    for ranks in range(1, world.size + 1):
        for n in (0, 1, ranks - 1, ranks + 1, 2 * ranks + 3, 999):
            assert ring_matches_sum(n, ranks, seed=1000 * ranks + n), (n, ranks)


if given is not None:
    @pytest.mark.mpi(min_size=1)
    @settings(max_examples=50, deadline=None, derandomize=True, database=None)
    @given(n=st.integers(min_value=0, max_value=5000), ranks=st.integers(min_value=1, max_value=8),
           seed=st.integers(min_value=0, max_value=2**32 - 1))
    def test_ring_equals_np_sum_for_random_lengths_and_world_sizes(n, ranks, seed):
        assert ring_matches_sum(n, ranks, seed), (n, ranks, seed)
else:
    @pytest.mark.mpi(min_size=1)
    def test_ring_equals_np_sum_for_random_lengths_and_world_sizes():
        pytest.importorskip("hypothesis")
