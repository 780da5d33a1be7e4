"""Run hpctrain.mnist and record which training samples each worker takes:
one line per batch, "epoch id id ...", in $RECORD_SAMPLES/<rank>-<pid>.txt
(a new file per process, so a resumed run adds files beside the earlier
ones). The ids are the reader's `last_ids`: rows of the training set in
shard order. A test switch, so it lives here (as tests/ps_servers_at.py does),
not in production code.

    RECORD_SAMPLES=/tmp/s mpirun -n 2 python tests/record_samples.py --steps 100
"""
import os
import sys

# The reader's module loads numpy, whose BLAS reads its thread count once:
# configure the process first, as hpctrain.mnist then does again (it keeps
# what is set). Unconfigured, 2-4 ranks sharing 2 cores ran 50x slower.
from hpctrain.run import cluster
from hpctrain import train as entry

cluster.configure_process(device="cpu")
from hpctrain.data import reader  # noqa: E402

OUT = os.environ["RECORD_SAMPLES"]
_next_batch = reader.ShardReader.next_batch


def recording_next_batch(self):
    batch = _next_batch(self)
    if not hasattr(self, "_record"):
        rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "x"))
        self._record = open(os.path.join(OUT, f"{rank}-{os.getpid()}.txt"), "a", buffering=1)
    self._record.write(f"{self.position[0]} {' '.join(map(str, self.last_ids.tolist()))}\n")
    return batch


if __name__ == "__main__":
    reader.ShardReader.next_batch = recording_next_batch
    sys.exit(entry.main())
