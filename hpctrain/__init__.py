"""hpctrain: data-parallel training on MPI (ring allreduce or parameter servers).

Run:  mpirun -n 4 python -m hpctrain.mnist [--mode ring|ps] [--help]
"""
__version__ = "0.1.0"
