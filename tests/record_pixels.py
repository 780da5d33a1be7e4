"""Run hpctrain.train and record what each training sample looked like: one
line per sample taken, "epoch id crc32-of-its-pixels", in
$RECORD_PIXELS/<rank>-<pid>.txt (a new file per process). With --augment the
pixels are the augmented ones, so two runs that saw the same samples
transformed alike record the same lines. A test switch, so it lives here (as
tests/record_samples.py does), not in production code.

    RECORD_PIXELS=/tmp/p mpirun -n 2 python tests/record_pixels.py --augment crop,flip --steps 20
"""
import os
import sys
import zlib

from hpctrain.run import cluster
from hpctrain import train as entry

cluster.configure_process(device="cpu")   # before numpy's BLAS starts (tests/record_samples.py)
from hpctrain.data import reader  # noqa: E402

OUT = os.environ["RECORD_PIXELS"]
_next_batch = reader.ShardReader.next_batch


def recording_next_batch(self):
    x, y = _next_batch(self)
    if not hasattr(self, "_record"):
        rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "x"))
        self._record = open(os.path.join(OUT, f"{rank}-{os.getpid()}.txt"), "a", buffering=1)
    epoch, ids = self.last_draw
    self._record.write("".join(f"{epoch} {i} {zlib.crc32(row.tobytes())}\n" for i, row in zip(ids.tolist(), x)))
    return x, y


if __name__ == "__main__":
    reader.ShardReader.next_batch = recording_next_batch
    sys.exit(entry.main())
