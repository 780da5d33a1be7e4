"""Set-ups shared by the allreduce tests (test_ring.py, test_staged.py): the
communicators they run on, a buffer whose middle view is reduced, and rank
0's copy of a result (every rank must end with the same bits); and how the
tests of the ring loop's Wire (test_wire.py, test_shard_optimizer.py) read
its stop slot after the allreduce.
"""
import numpy as np
import pytest
from mpi4py import MPI

COMMS = [pytest.param(MPI.COMM_SELF, id="self"), pytest.param(MPI.COMM_WORLD, id="world")]


def fives_around_a_view(comm, n, lo, hi):
    """(buf, view): n float32 fives, buf[lo:hi] set to rank + 1 (what an
    allreduce of the view sums; the fives around it must stay)."""
    buf = np.full(n, 5.0, np.float32)
    view = buf[lo:hi]
    view[:] = comm.rank + 1
    return buf, view


def rank0_copy(comm, a):
    """Rank 0's copy of a (collective)."""
    first = a.copy()
    comm.Bcast(first, root=0)
    return first


def stop_requested(wire):
    """After the allreduce: did any rank ask to stop (a comm.wire.Wire's stop
    slot summed above 0)? The loop reads the same slot from fusion's head."""
    return float(wire.stop[0]) > 0
