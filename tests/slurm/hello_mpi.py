"""Smallest MPI check for a launcher: one line per rank, and a world-size check.

Run it under whatever launcher is being tested, e.g. inside a SLURM job:

    srun --mpi=pmi2 .venv/bin/python tests/slurm/hello_mpi.py 4

Each rank prints ``hello rank R of S on HOST``, then the ranks do one
allreduce so a world that only *looks* right (size from the environment, no
working transport) fails here too. With EXPECTED_SIZE given, a world of any
other size exits 3 with one clear line: that is what plain ``srun`` without
``--mpi=pmi2`` does to the PyPI MPICH wheel (every task becomes its own
singleton world of size 1).
"""

import socket
import sys

from mpi4py import MPI


def main(argv):
    expected = int(argv[1]) if len(argv) > 1 else None
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    print(f"hello rank {rank} of {size} on {socket.gethostname()}", flush=True)
    if expected is not None and size != expected:
        print(f"hello_mpi: rank {rank}: expected one MPI world of {expected} ranks, "
              f"got size {size} (srun without --mpi=pmi2?)", file=sys.stderr, flush=True)
        return 3
    total = comm.allreduce(rank, op=MPI.SUM)
    if total != size * (size - 1) // 2:
        print(f"hello_mpi: rank {rank}: allreduce of ranks gave {total}, "
              f"expected {size * (size - 1) // 2}", file=sys.stderr, flush=True)
        return 4
    if rank == 0:
        print(f"hello_mpi: world of {size} ranks OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
