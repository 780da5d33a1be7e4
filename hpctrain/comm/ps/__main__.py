"""Self-check of the protocol, sync: every worker pushes full(n, w+1) each
round with SGD lr 1; after R rounds params = -R * mean(1..W), on every element
of every server. 1 ps below 4 ranks, 2 from 4 on.

    mpirun -n 3 python -m hpctrain.comm.ps
"""
import sys

import numpy as np
from mpi4py import MPI

from . import Client, Server, place
from ...base.precision import FLOAT32


class PlainSGD:
    """The protocol takes any optimizer object; no hpctrain.optim import here."""
    t = 0

    def __init__(self, size):
        pass

    def state(self):
        return {}

    def step(self, params, grads, lr, grad_scale=1.0):
        self.t += 1
        params -= grads * params.dtype.type(lr * grad_scale)


def main():
    world = MPI.COMM_WORLD
    num_ps = 1 if world.size < 4 else 2
    if world.size <= num_ps:   # a server and at least one worker
        print(f"hpctrain: error: the ps self-check runs on at least 2 ranks, got {world.size}", file=sys.stderr)
        sys.exit(2)
    servers, workers = list(range(num_ps)), list(range(num_ps, world.size))
    n, rounds = 1003, 5
    layout = place([("a", 0, 600), ("b", 600, n)], num_ps, "even")
    if world.rank < num_ps:
        mine = layout[world.rank]
        size = sum(hi - lo for lo, hi in mine)
        Server(world, mine, workers, servers, PlainSGD(size), lambda v: 1.0, steps=rounds).serve_until_done()
        return
    worker = world.rank - num_ps
    params, grads = np.zeros(n, FLOAT32.params), np.zeros(n, FLOAT32.grads)
    client = Client(world, servers, layout, params, grads, worker, len(workers))
    if worker == 0:
        client.restore(0, 0, params)
    client.pull()
    while not client.stop:
        grads[:] = worker + 1
        client.push_pull(0.0)
    client.final()
    expect = -rounds * (len(workers) + 1) / 2
    assert client.version == rounds and np.allclose(params, expect), (client.version, params[:3], expect)
    if worker == 0:
        print(f"ps protocol OK: {num_ps} ps, {len(workers)} workers, {rounds} sync rounds")


if __name__ == "__main__":
    main()
