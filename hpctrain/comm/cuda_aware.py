"""Does this MPI take device pointers? Ask the library itself.

mpi4py cannot say; the library can, through its own extension functions,
called here with ctypes on the libmpi this process loaded: MPICH's
MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag) and Open MPI's
MPIX_Query_cuda_support() (both after MPI_Init). A library with neither is
taken as not CUDA-aware; `--cuda-aware yes|no` overrides the answer. All ranks
of a communicator must then take the same path (`agree`).

    mpirun -n 2 python -m hpctrain.comm.cuda_aware     # prints "CUDA-aware: yes|no (why)"
"""
import ctypes
import os
import sys

import numpy as np
from mpi4py import MPI

# MPICH's mpi.h: #define MPIX_GPU_SUPPORT_CUDA (0)
_MPIX_GPU_SUPPORT_CUDA = 0


def loaded_libmpi():
    """Paths of the MPI libraries mapped into this process (mpi4py loads
    libmpi with RTLD_LOCAL, so its symbols are not global: open it by path)."""
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split()
                if len(parts) >= 6 and parts[5].startswith("/"):
                    name = os.path.basename(parts[5])
                    if name.startswith(("libmpi", "libmpich")) and ".so" in name and parts[5] not in paths:
                        paths.append(parts[5])
    except OSError:  # not Linux
        pass
    return paths


def _library_name():
    try:
        first = MPI.Get_library_version().strip().splitlines()[0]
    except Exception:
        return "the MPI library"
    return " ".join(first.split())[:60]


def _ask(lib, name):
    """(aware, why) from one library's query function, or None if it has none."""
    query = getattr(lib, "MPIX_GPU_query_support", None)  # MPICH >= 4
    if query is not None:
        query.restype = ctypes.c_int
        query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        flag = ctypes.c_int(0)
        if query(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) == 0:
            return bool(flag.value), f"{name}: MPIX_GPU_query_support(CUDA) = {flag.value}"
    query = getattr(lib, "MPIX_Query_cuda_support", None)  # Open MPI (and MPICH >= 4.1)
    if query is not None:
        query.restype = ctypes.c_int
        query.argtypes = []
        value = query()
        return bool(value), f"{name}: MPIX_Query_cuda_support() = {value}"
    return None


def query_cuda_support(handles=None):
    """(True/False, reason) from the MPI library itself. MPI must be initialized.
    `handles`: ctypes libraries to ask (default: the libmpi this process loaded)."""
    name = _library_name()
    if handles is None:
        handles = []
        for path in loaded_libmpi():
            try:
                handles.append(ctypes.CDLL(path))
            except OSError:
                continue
        handles.append(ctypes.CDLL(None))  # a libmpi linked into the executable
    for lib in handles:
        answer = _ask(lib, name)
        if answer is not None:
            return answer
    return False, f"{name} has no MPIX_GPU_query_support/MPIX_Query_cuda_support: taken as not CUDA-aware"


_DETECTED = None


def cuda_aware(flag="auto"):
    """--cuda-aware auto|yes|no -> (pass device buffers to MPI?, why)."""
    global _DETECTED
    if flag == "yes":
        return True, "--cuda-aware yes"
    if flag == "no":
        return False, "--cuda-aware no"
    if _DETECTED is None:
        _DETECTED = query_cuda_support()
    return _DETECTED


def agree(comm, direct):
    """Every rank of comm must take the same path (a staged allreduce runs one
    ring per chunk, a direct one a single ring): direct only where all can.
    Collective over comm."""
    if comm is None or comm == MPI.COMM_NULL or comm.Get_size() == 1:
        return direct
    votes = np.array([1 if direct else 0], np.int64)
    comm.Allreduce(MPI.IN_PLACE, votes, op=MPI.MIN)
    if direct and not votes[0] and comm.Get_rank() == 0:
        print("hpctrain: warning: some ranks' MPI is not CUDA-aware: staging through host memory on all",
              file=sys.stderr, flush=True)
    return bool(votes[0])


if __name__ == "__main__":
    aware, why = query_cuda_support()
    if MPI.COMM_WORLD.rank == 0:
        print(f"CUDA-aware: {'yes' if aware else 'no'} ({why})")
