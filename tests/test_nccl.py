"""NCCL's pieces that run without a GPU (comm/nccl.py): the unique id over
MPI, ranks sharing a GPU found, one clear error on the CPU.

    python -m pytest -q tests/test_nccl.py
    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_nccl.py
"""
import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.comm import nccl
from hpctrain.comm.records import allgather_bytes
from hpctrain.base.errors import HpctrainError


def test_unique_id_round_trips_signed_and_unsigned_chars():
    rng = np.random.default_rng(0)
    for lo, hi in ((-128, 128), (0, 256)):
        uid = tuple(int(v) for v in rng.integers(lo, hi, nccl.UNIQUE_ID_BYTES))
        record = nccl.encode_unique_id(uid)
        assert record.dtype == np.int16 and record[0] == 1
        assert nccl.decode_unique_id(record) == uid
    with pytest.raises(ValueError):
        nccl.encode_unique_id((1, 2, 3))
    assert nccl.version_text(22105) == "2.21.5" and nccl.version_text(2804) == "2.8.4"


@pytest.mark.mpi(min_size=2)
def test_unique_id_reaches_every_rank_and_a_failure_stops_all():
    comm = MPI.COMM_WORLD
    uid = tuple(range(-64, 64))
    got = nccl.share_unique_id(comm, lambda: uid if comm.rank == 0 else 1 / 0)
    assert got == uid

    def broken():
        raise RuntimeError("no network interface")
    with pytest.raises(HpctrainError) as e:
        nccl.share_unique_id(comm, broken)
    assert e.value.collective and e.value.report == (comm.rank == 0)
    if comm.rank == 0:
        assert "no network interface" in str(e.value)


@pytest.mark.mpi(min_size=2)
def test_ranks_sharing_a_gpu_are_found():
    comm = MPI.COMM_WORLD
    names = allgather_bytes(comm, f"node GPU {comm.rank // 2}", nccl.DEVICE_NAME_BYTES)
    assert names == [f"node GPU {r // 2}" for r in range(comm.size)]
    shared = nccl.shared_devices(names)
    assert shared == {f"node GPU {g}": [2 * g, 2 * g + 1] for g in range(comm.size // 2)}
    assert nccl.shared_devices([f"GPU {r}" for r in range(comm.size)]) == {}


