"""Run hpctrain.train and write, at the end of a pipeline run, each rank's
bits of every tied tensor that spans stages (pipeline/tied.py): the owner's
stage its slice's, a user's stage its copy's, as
$TIED_COPIES/<world rank>.npy. TiedStages.free is wrapped (the freeing
itself unchanged), so what is written is what the stage trained with. A
test switch, so it lives here (as tests/record_reads.py does).

    TIED_COPIES=/tmp/t mpirun -n 2 python tests/tied_copies.py --model examples/tied_model.py:build \
        --pipeline-stages 2 --pipeline-split 3
"""
import os
import sys

from hpctrain.run import cluster
from hpctrain import train as entry

cluster.configure_process(device="cpu")   # before numpy's BLAS starts (tests/record_samples.py)
import numpy as np  # noqa: E402

from hpctrain.base import device   # noqa: E402
from hpctrain.pipeline import tied  # noqa: E402

OUT = os.environ["TIED_COPIES"]
_free = tied.TiedStages.free


def writing_free(self):
    if self.spanning:
        rank = self.grid.world_rank(self.grid.stage)
        np.save(os.path.join(OUT, f"{rank}.npy"),
                np.stack([device.to_host(self._tensor(span, "params")) for span in self.spanning]))
    _free(self)


if __name__ == "__main__":
    tied.TiedStages.free = writing_free
    sys.exit(entry.main())
