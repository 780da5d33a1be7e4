"""Run hpctrain.mnist with the --save file failing as on a full disk (ENOSPC
when its HDF5 file is created): a fault injected from the tests, not from
production code.

    PYTHONPATH=tests/faults mpirun -n 2 python -m disk_full_on_save --steps 20 --save p.h5

The patch goes in after hpctrain.train.main has configured the process: h5py and
numpy must not load before (numpy reads the BLAS thread count once).
"""
import errno
import os
import sys

from hpctrain import train as entry

_train = entry.train


def train(args, *rest):
    import h5py
    save = os.path.basename(args.save)
    real_init = h5py.File.__init__

    def init(self, name, *a, **kw):
        if os.path.basename(str(name)).startswith(f".{save}.tmp-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_init(self, name, *a, **kw)

    h5py.File.__init__ = init
    return _train(args, *rest)


if __name__ == "__main__":
    entry.train = train
    sys.exit(entry.main())
