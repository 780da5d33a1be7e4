"""Bucket fusion with overlap gives the same bits as reducing the same buckets
one after another, and buckets end on layer boundaries.

    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_fusion.py
"""
import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.comm.fusion import FusedAllreduce, bucket_bounds
from hpctrain.comm.ring import RingAllreduce
from hpctrain.comm.wire import Wire
from hpctrain.model import MLP
from hpctrain.optim import Adam


def test_buckets_cover_the_buffer_in_ready_order_on_layer_boundaries():
    cuts = [0, 392502, 643502]
    n = 648012
    assert bucket_bounds(n, 0, cuts) == [(0, n)]
    assert bucket_bounds(n, 1 << 30, cuts) == [(0, n)]
    assert bucket_bounds(n, (1 << 20) // 4, cuts) == [(392502, n), (0, 392502)]
    assert bucket_bounds(n, 1000, cuts) == [(643502, n), (392502, 643502), (0, 392502)]
    for elems in (1, 10, 5000, 300000):
        b = bucket_bounds(n, elems, cuts)
        assert b[0][1] == n and b[-1][0] == 0
        assert all(b[i][0] == b[i + 1][1] for i in range(len(b) - 1))
        assert all(lo in cuts for lo, _ in b)


def train_steps(comm, overlap, fusion_elems, steps=5):
    """A few steps of the real loop's arithmetic: wire = [loss, stop, grads]."""
    rng = np.random.default_rng(comm.rank)
    n = MLP((64, 32)).num_params
    wire = Wire(n)
    model = MLP((64, 32), grads=wire.grads)
    model.init(0)
    opt = Adam(n)
    fused = FusedAllreduce(RingAllreduce(comm), wire.buffer, wire.ready_from(model.layer_ranges), fusion_elems,
                           overlap=overlap,
                           on_reduced=lambda lo, hi: opt.update(model.params, model.grads, *wire.grads_range(lo, hi)))
    for _ in range(steps):
        x = rng.random((16, 784)).astype(np.float32)
        y = rng.integers(0, 10, 16)
        opt.begin(1e-3, 1.0 / comm.size)
        model.forward_backward(x, y, on_layer_done=fused.layer_done, loss_out=wire.loss)
        fused.wait()
    fused.close()
    return model.params.copy(), len(fused.buckets), float(wire.loss[0])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("fusion_elems", [100, 20000])
def test_overlap_is_bit_identical_to_the_same_buckets_in_sequence(fusion_elems):
    comm = MPI.COMM_WORLD
    a, buckets, loss_a = train_steps(comm, overlap=True, fusion_elems=fusion_elems)
    b, _, loss_b = train_steps(comm, overlap=False, fusion_elems=fusion_elems)
    assert buckets > 1
    assert np.array_equal(a, b) and loss_a == loss_b
    # and the same on every rank
    first = a.copy()
    comm.Bcast(first, root=0)
    assert np.array_equal(a, first)


@pytest.mark.mpi(min_size=2)
def test_fused_buckets_equal_one_allreduce_up_to_rounding():
    comm = MPI.COMM_WORLD
    a, _, _ = train_steps(comm, overlap=True, fusion_elems=100)
    b, buckets, _ = train_steps(comm, overlap=False, fusion_elems=0)
    assert buckets == 1
    np.testing.assert_allclose(a, b, atol=1e-5)
