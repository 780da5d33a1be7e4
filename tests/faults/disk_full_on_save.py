"""Run hpctrain.mnist with the --save file failing as on a full disk (ENOSPC
when its HDF5 file is created): a fault injected from the tests, not from
production code.

    mpirun -n 2 python tests/faults/disk_full_on_save.py --steps 20 --save p.h5
"""
import errno
import os
import sys

import h5py

from hpctrain import mnist


def main():
    save = os.path.basename(sys.argv[sys.argv.index("--save") + 1])
    real_init = h5py.File.__init__

    def init(self, name, *args, **kwargs):
        if os.path.basename(str(name)).startswith(f".{save}.tmp-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_init(self, name, *args, **kwargs)

    h5py.File.__init__ = init
    sys.exit(mnist.main())


if __name__ == "__main__":
    main()
