"""Gradient averaging: N ranks with batch B give the update one process
computes over the same N*B samples.

    mpirun -n 4 python -m mpi4py -m pytest --only-mpi tests/test_averaging.py
"""
import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.comm.ring_allreduce import RingAllreduce
from hpctrain.nn import mlp
from hpctrain.optim.sgd import SGD


@pytest.mark.mpi(min_size=2)
def test_averaged_update_equals_single_process_over_all_samples():
    comm = MPI.COMM_WORLD
    size, rank, batch = comm.size, comm.rank, 8
    rng = np.random.default_rng(42)  # same on every rank: everyone knows all samples
    x_all = rng.random((size * batch, 784)).astype(np.float32)
    y_all = rng.integers(0, 10, size * batch)

    dist = mlp(hidden=(32, 16)).build()
    dist.init(0)
    dist.forward_backward(x_all[rank * batch:(rank + 1) * batch], y_all[rank * batch:(rank + 1) * batch])
    RingAllreduce(comm).allreduce(dist.grads)
    SGD(dist.num_params).step(dist.params, dist.grads, 0.1, grad_scale=1.0 / size)

    single = mlp(hidden=(32, 16)).build()
    single.init(0)
    single.forward_backward(x_all, y_all)
    SGD(single.num_params).step(single.params, single.grads, 0.1)

    np.testing.assert_allclose(dist.params, single.params, rtol=0, atol=1e-6)
