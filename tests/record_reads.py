"""Run hpctrain.train and record which HDF5 datasets each rank reads: one
line per read, "<shard file> <dataset> <bytes>", in $RECORD_READS/<rank>.txt.
h5py's own Dataset.__getitem__ is wrapped (the read itself unchanged), so
what a rank holds is what it read from the files. A test switch, so it lives
here (as tests/record_samples.py does), not in production code.

    RECORD_READS=/tmp/r mpirun -n 3 python tests/record_reads.py --pipeline-stages 3 --steps 2
"""
import os
import sys

from hpctrain.run import cluster
from hpctrain import train as entry

cluster.configure_process(device="cpu")   # before numpy's BLAS starts (tests/record_samples.py)
import h5py  # noqa: E402

OUT = os.environ["RECORD_READS"]
_getitem = h5py.Dataset.__getitem__


def recording_getitem(self, key):
    array = _getitem(self, key)
    rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "x"))
    with open(os.path.join(OUT, f"{rank}.txt"), "a") as f:
        f.write(f"{os.path.basename(self.file.filename)} {self.name.lstrip('/')} {array.nbytes}\n")
    return array


if __name__ == "__main__":
    h5py.Dataset.__getitem__ = recording_getitem
    sys.exit(entry.main())
