"""Run hpctrain.train with the training batches coming through the GPU
prefetcher (prefetch.Prefetcher: pinned slots, copies to the device one
batch ahead, the reader's position and draws carried along) on NumPy,
over tests/gpu_fakes.LazyCopier: its copies run only when waited for and
its fresh buffers are NaN, so a missing wait shows up as wrong numbers.
A CPU run then takes the batch path of a GPU run (a pipeline stage's reader
included, which hands out None for what the stage does not read). A test
switch, so it lives here (as tests/numpy_as_gpu.py does).

    PYTHONPATH=tests mpirun -n 2 python -m prefetched_batches --pipeline-stages 2 --steps 5

The patch goes in after hpctrain.train.main has configured the process:
numpy must not load before (it reads the BLAS thread count once).
"""
import sys

from hpctrain import train as entry

_train = entry.train


def train(args, *rest):
    from gpu_fakes import LazyCopier
    from hpctrain.data import prefetch
    prefetch.device_batches = lambda reader, xp: prefetch.Prefetcher(reader, LazyCopier())
    return _train(args, *rest)


if __name__ == "__main__":
    entry.train = train
    sys.exit(entry.main())
