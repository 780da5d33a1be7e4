"""MNIST's name for hpctrain.train: the same program and flags (the bundled
MNIST sample is the default data; --data trains on any prepared shards).

    mpirun -n 4 python -m hpctrain.mnist
    python -m hpctrain.mnist --help
"""
import sys

from .train import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m hpctrain.mnist"))
