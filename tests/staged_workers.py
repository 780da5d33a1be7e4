"""Run hpctrain.mnist with NumPy standing in for the GPU of ps workers: their
batches go through the prefetcher and their parameters and gradients through
staged host mirrors, both with tests/gpu_fakes.LazyCopier (fresh buffers are
NaN, copies run only when waited for), and MPI messages to the servers, as
for a GPU worker, so CPU tests cover the GPU worker's wiring in
loop_ps.run_worker bit for bit.

    PYTHONPATH=tests mpirun -n 4 python -m staged_workers --mode ps --num-ps 2

The patch goes in after hpctrain.train.main has configured the process (numpy must
not load before: it reads the BLAS thread count once, when it loads).
"""
import sys
import types

from hpctrain import train as entry

_train = entry.train


def train(args, *rest):
    from gpu_fakes import LazyCopier
    from hpctrain.loops import ps as loop_ps
    from hpctrain.data import prefetch
    from hpctrain.comm.device_buffers import HostMirror
    loop_ps.HostMirror = lambda array, direct=False: HostMirror(array, copier=LazyCopier())
    loop_ps.prefetch = types.SimpleNamespace(
        device_batches=lambda reader, xp: prefetch.Prefetcher(reader, LazyCopier()))
    # A GPU worker exchanges by messages (loop_ps.open_exchange: its buffers are device memory).
    args.ps_exchange = "mpi"
    return _train(args, *rest)


if __name__ == "__main__":
    entry.train = train
    sys.exit(entry.main())
