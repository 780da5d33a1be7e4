"""Fixed-width byte records gathered across ranks (comm/records.py).

    python -m pytest -q tests/test_records.py
    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_records.py
"""
import pytest
from mpi4py import MPI

from hpctrain.comm.records import allgather_bytes, gather_bytes

COMMS = [pytest.param(MPI.COMM_SELF, id="self"), pytest.param(MPI.COMM_WORLD, id="world")]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("comm", COMMS)
def test_every_rank_gets_every_ranks_text_in_rank_order(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    assert allgather_bytes(comm, f"rank {rank} é", 16) == [f"rank {r} é" for r in range(size)]
    assert allgather_bytes(comm, b"\x01" * rank, 8) == [b"\x01" * min(r, 8) for r in range(size)]
    fields = allgather_bytes(comm, [str(rank), "same", "x" * 100], 10)
    assert fields == [[str(r), "same", "x" * 10] for r in range(size)]
    assert allgather_bytes(comm, [], 4) == [[] for _ in range(size)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("comm", COMMS)
def test_gather_reaches_the_root_only(comm):
    size, rank = comm.Get_size(), comm.Get_rank()
    root = size - 1
    got = gather_bytes(comm, f"host{rank}", 64, root=root)
    if rank == root:
        assert got == [f"host{r}" for r in range(size)]
    else:
        assert got is None


def test_text_cut_inside_a_character_is_replaced_not_an_error():
    assert allgather_bytes(MPI.COMM_SELF, "aé", 2) == ["a\ufffd"]
