"""Agreement at start-up (and wherever one rank's error must end every rank):
`agreed` runs a check on every rank of a communicator and turns an error on
any of them into the same exit on all, one line printed; `check_consistency`
compares settings that must be equal on every rank (the same job, the same
data, the same model), with fixed-size byte records, no pickle.

    mpirun -n 2 python -m hpctrain.mnist --lr 0.1 : -n 1 python -m hpctrain.mnist   # one line, exit 2
"""
import numpy as np
from mpi4py import MPI

from ..base.errors import HpctrainError
from .deadline import NO_WATCHDOG


def agreed(comm, fn, *args, watchdog=NO_WATCHDOG, what=None):
    """Run fn(*args) on every rank of comm; if it raises HpctrainError anywhere,
    every rank raises: the lowest failing rank its own message (printed), the
    others a silent error with the same exit code. So a set-up error on one
    rank never leaves the rest waiting in a collective, and the job prints one
    line. The agreement waits under `watchdog` (a rank that never arrives is
    named), labelled `what`."""
    error = None
    try:
        result = fn(*args)
    except HpctrainError as exc:
        error, result = exc, None
    size, rank = comm.Get_size(), comm.Get_rank()
    # [exit code, size - rank of a rank with a line to print]: the lowest such
    # rank prints. An error that an inner agreement already silenced has no
    # line of its own, so fn may itself agree on a smaller communicator.
    speaks = error is not None and error.report and bool(str(error))
    flag = np.array([error.exit_code if error else 0, size - rank if speaks else 0], np.int64)
    with watchdog.waiting(f"agreement after {what or getattr(fn, '__name__', 'args step')}", peer=None):
        comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
    if flag[0]:
        if error is None:
            error = HpctrainError("", exit_code=int(flag[0]))
        error.collective = True
        error.report = speaks and size - rank == flag[1]
        raise error
    return result


def check_consistency(comm, settings):
    """Every rank must run the same job: compare `settings` (name -> value,
    same names on all ranks) with an Allgather of fixed-size byte records (no
    pickle). A mismatch raises the same one-line HpctrainError on every rank,
    naming the setting and the ranks that differ from rank 0."""
    from .records import allgather_bytes
    width = 64
    names = sorted(settings)
    everyone = allgather_bytes(comm, [str(settings[name]).encode() for name in names], width)
    problems = []
    for i, name in enumerate(names):
        odd = [r for r in range(comm.Get_size()) if everyone[r][i] != everyone[0][i]]
        if odd:
            def show(r):
                return everyone[r][i].decode(errors="replace")
            problems.append(f"{name}: rank 0 has {show(0)}, "
                            + ", ".join(f"rank {r} has {show(r)}" for r in odd[:4])
                            + (" ..." if len(odd) > 4 else ""))
    if problems:
        raise HpctrainError("ranks disagree on the job: " + "; ".join(problems))
