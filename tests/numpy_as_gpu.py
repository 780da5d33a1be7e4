"""Run hpctrain.mnist with NumPy standing in for CuPy where --ps-device gpu
asks for the servers' array module, so CPU tests cover that code path
(optim.OnDevice and its host/device copies) bit for bit.

    PYTHONPATH=tests mpirun -n 4 python -m numpy_as_gpu --mode ps --num-ps 2 --ps-device gpu

The patch goes in after hpctrain.train.main has configured the process: numpy must
not load before (it reads the BLAS thread count once, when it loads).
"""
import sys

from hpctrain import train as entry

_train = entry.train


def train(args, *rest):
    import numpy as np
    from hpctrain.run import startup as session
    session.server_array_module = lambda args: np
    return _train(args, *rest)


if __name__ == "__main__":
    entry.train = train
    sys.exit(entry.main())
