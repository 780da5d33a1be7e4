"""Does this MPI take device pointers (comm/cuda_aware.py)? This library is
asked, stand-in libraries are asked, and ranks agree on one path.

    python -m pytest -q tests/test_cuda_aware.py
    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_cuda_aware.py
"""
import types

import pytest
from mpi4py import MPI

from hpctrain.comm import cuda_aware


def test_this_mpi_is_asked_and_answers():
    aware, why = cuda_aware.query_cuda_support()
    assert isinstance(aware, bool) and why
    assert cuda_aware.loaded_libmpi(), "libmpi is mapped into this process"
    if "MPICH" in MPI.Get_library_version():
        # the PyPI mpich wheel is built without CUDA
        assert "MPIX_GPU_query_support(CUDA) = 0" in why and not aware
    assert cuda_aware.cuda_aware("yes") == (True, "--cuda-aware yes")
    assert cuda_aware.cuda_aware("no") == (False, "--cuda-aware no")
    assert cuda_aware.cuda_aware("auto") == (aware, why)


def fake_lib(**functions):
    lib = types.SimpleNamespace()
    for name, fn in functions.items():
        setattr(lib, name, fn)
    return lib


def test_detection_reads_each_librarys_own_query():
    def mpich_query(kind, flag_ref):
        assert kind == 0  # MPIX_GPU_SUPPORT_CUDA
        flag_ref._obj.value = 1
        return 0
    aware, why = cuda_aware.query_cuda_support([fake_lib(MPIX_GPU_query_support=mpich_query)])
    assert aware and "MPIX_GPU_query_support(CUDA) = 1" in why
    aware, why = cuda_aware.query_cuda_support([fake_lib(MPIX_Query_cuda_support=lambda: 1)])
    assert aware and "MPIX_Query_cuda_support() = 1" in why
    aware, why = cuda_aware.query_cuda_support([fake_lib(MPIX_Query_cuda_support=lambda: 0)])
    assert not aware
    aware, why = cuda_aware.query_cuda_support([fake_lib(), fake_lib()])
    assert not aware and "not CUDA-aware" in why


@pytest.mark.mpi(min_size=2)
def test_ranks_agree_on_one_path(capsys):
    comm = MPI.COMM_WORLD
    assert cuda_aware.agree(comm, True) is True
    assert cuda_aware.agree(comm, False) is False
    assert cuda_aware.agree(comm, comm.rank != comm.size - 1) is False


