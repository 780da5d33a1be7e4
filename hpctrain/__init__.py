"""hpctrain: neural-network training across MPI ranks: data parallelism (ring
allreduce or parameter servers) and model parallelism (pipeline stages).

Run:  mpirun -n 4 python -m hpctrain.mnist [--mode ring|ps] [--help]
"""
from importlib import metadata

try:
    __version__ = metadata.version("hpctrain")   # pyproject.toml is the one source
except metadata.PackageNotFoundError:            # run from a source tree that was never installed
    __version__ = "unknown"
