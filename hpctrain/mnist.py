"""Entry point: train an MLP on MNIST, data-parallel across MPI ranks.

    mpirun -n 4 python -m hpctrain.mnist                      # ring allreduce
    mpirun -n 4 python -m hpctrain.mnist --mode ps --num-ps 2 # parameter servers
    python -m hpctrain.mnist --help

Order matters: flags are parsed and the process configured (BLAS threads, MPI
progress throttling, GPU binding) before numpy and MPI are imported, because
they read those settings once, when they load. Exit codes: hpctrain/errors.py.
"""
import sys

from . import cli, cluster
from .errors import EXIT_FAILURE, HpctrainError


def main(argv=None):
    rank, size, _, _ = cluster.launcher_env()
    args = cli.parse(argv, quiet=bool(rank))
    note = cluster.configure_process(device=args.device)
    try:
        from . import train  # numpy, BLAS and MPI start here
        train.run(args, note)
        return 0
    except HpctrainError as exc:
        if exc.report and str(exc):
            print(f"hpctrain: error: {exc}", file=sys.stderr, flush=True)
        if not exc.collective:
            _abort_others(exc.exit_code)
        return exc.exit_code
    except Exception:
        # A bug: show it, and take the other ranks down rather than leave
        # them blocked in a collective (what `python -m mpi4py` does).
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        _abort_others(EXIT_FAILURE)
        return EXIT_FAILURE


def _abort_others(code):
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.Get_size() > 1:
        import time
        from .comm.deadline import ABORT_GRACE_S
        time.sleep(ABORT_GRACE_S)  # let the launcher forward our error line first
        mpi.COMM_WORLD.Abort(code)


if __name__ == "__main__":
    sys.exit(main())
