"""The ring's loss and stop flag travel in their own small allreduce
(comm/loss_and_stop.py), so the buffer the buckets exchange is the model's
gradient and nothing else; every rank reads the same summed loss and stop
flag after every step, whoever asked to stop, sharded or not, staged or not,
and from a 'device' whose copies run as late as allowed.

    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_loss_and_stop.py
"""
import numpy as np
import pytest
from mpi4py import MPI

from collectives import ring_step
from gpu_fakes import LazyCopier
from hpctrain import device
from hpctrain.comm.loss_and_stop import LossAndStop
from hpctrain.comm.ring_allreduce import RingAllreduce
from hpctrain.comm.staged import StagedAllreduce
from hpctrain.loops.ring_step import RingStep
from hpctrain.nn import mlp


def test_the_buckets_exchange_the_gradients_only():
    spec = mlp(hidden=(64, 32))
    ring = RingStep(spec, RingAllreduce(MPI.COMM_SELF), MPI.COMM_SELF, np, ("adam", {}), 3000)
    part = ring.update.parts[0]   # the buckets' one buffer: the model's gradient, nothing in front
    assert part.grads is ring.model.grads and part.grads.size == spec.num_params
    assert ring.buckets[0][1] == spec.num_params and ring.buckets[-1][0] == 0
    assert {lo for lo, _ in ring.buckets} <= {lo for lo, _ in ring.model.layer_ranges}
    ring.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("copier", [device.HostCopier, LazyCopier])
def test_every_rank_reads_the_sums_and_a_late_copy_is_waited_for(copier):
    comm = MPI.COMM_WORLD
    sums = LossAndStop(comm, copier())
    loss = np.zeros(1, np.float32)
    for step in range(4):
        sums.begin(comm.rank == 1 and step == 2)
        loss[0] = 0.5 * comm.rank + step
        sums.loss_ready(loss)   # LazyCopier's copy runs when waited for: summed() must wait for it
        assert sums.summed() == (sum(0.5 * r + step for r in range(comm.size)), step == 2)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("staged", [False, True])
def test_every_rank_stops_after_the_same_step_whoever_asked(sharded, staged):
    comm = MPI.COMM_WORLD
    ring = RingAllreduce(comm)
    # staged: LazyCopier (NaN-filled, lazy copies) standing in for the device; small chunks
    strategy = StagedAllreduce(ring, LazyCopier(), chunk_bytes=256) if staged else ring
    rng = np.random.default_rng(comm.rank)
    for who in range(comm.size):
        step = RingStep(mlp(hidden=(64, 32)), strategy, comm, np, ("sgd", {}), 3000, sharded=sharded)
        assert len(step.buckets) > 1
        # [first step whose summed stop flag was set, steps whose summed loss was wrong]:
        # every step runs on every rank (communicate first, assert after).
        seen = np.zeros(2, np.int64)
        for k in range(1, 6):
            x, y = rng.random((4, 784)).astype(np.float32), rng.integers(0, 10, 4)
            step.begin(1e-3, comm.rank == who and k == 3)
            loss, stop = ring_step(step, x, y, comm.rank + k)
            seen[1] += loss != sum(r + k for r in range(comm.size))
            if stop and not seen[0]:
                seen[0] = k
        step.close()
        everyone = np.zeros((comm.size, 2), np.int64)
        comm.Allgather(seen, everyone)
        assert everyone.tolist() == [[3, 0]] * comm.size, (who, everyone)
    ring.free()
