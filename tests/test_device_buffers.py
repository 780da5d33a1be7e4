"""Device arrays through MPI outside the allreduce (comm/device_buffers.py):
HostMirror and bcast, with NumPy standing in for the device
(tests/gpu_fakes.py), and BoundToDevice.

    python -m pytest -q tests/test_device_buffers.py
    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_device_buffers.py
"""
import numpy as np
import pytest
from mpi4py import MPI

from gpu_fakes import DevArray, LazyCopier, cudacopier  # noqa: F401 (a fixture)
from hpctrain.comm.device_buffers import BoundToDevice, HostMirror, bcast


def test_host_mirror_of_a_numpy_array_is_the_array():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    m = HostMirror(a)
    assert not m.staged and m.to_host() is a and m.recv_buffer() is a and m.to_device() is a
    with pytest.raises(ValueError):
        HostMirror(np.arange(10.0)[::2])


@pytest.mark.parametrize("copier", ["lazy", "cuda"])
def test_host_mirror_staging_logic_round_trips(copier, cudacopier):
    dev = np.arange(12, dtype=np.float32).reshape(3, 4).view(DevArray)
    c = LazyCopier() if copier == "lazy" else cudacopier()
    m = HostMirror(dev, copier=c)  # staged, NumPy standing in for the device
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
    bcast(comm, a, root=comm.size - 1)
    assert np.all(a == comm.size - 1)
    m = HostMirror(np.full(10, comm.rank, np.float64))
    if comm.rank == 0:
        comm.Send(m.to_host(), dest=1)
    elif comm.rank == 1:
        comm.Recv(m.recv_buffer(), source=0)
        m.to_device()
        assert np.all(m.array == 0)




def test_bound_to_device_passes_every_call_through():
    class Stand:
        size, rank, name = 2, 1, "stand"

        def __init__(self):
            self.calls = []

        def shard(self, n):
            return 0, n // 2

        def allreduce(self, buf):
            self.calls.append("allreduce")
            return buf

        def reduce_scatter(self, buf):
            self.calls.append("reduce_scatter")
            return 0, 1

        def allgather(self, buf):
            self.calls.append("allgather")
            return buf

    inner = Stand()
    bound = BoundToDevice(inner, np, "why")
    x = np.zeros(4)
    assert (bound.size, bound.rank, bound.name, bound.path) == (2, 1, "stand", "why")
    assert bound.allreduce(x) is x and bound.reduce_scatter(x) == (0, 1) and bound.allgather(x) is x
    assert bound.shard(10) == (0, 5) and inner.calls == ["allreduce", "reduce_scatter", "allgather"]


def test_both_wrapping_strategies_partition_as_the_inner_one():
    from hpctrain.base import device
    from hpctrain.comm.ring_allreduce import RingAllreduce
    from hpctrain.comm.staged import StagedAllreduce
    inner = RingAllreduce(MPI.COMM_WORLD)
    try:
        for wrapped in (BoundToDevice(inner, np), StagedAllreduce(inner, device.HostCopier())):
            assert (wrapped.size, wrapped.rank) == (inner.size, inner.rank)
            assert wrapped.shard(10) == inner.shard(10) and wrapped.parts(10) == inner.parts(10)
    finally:
        inner.free()
