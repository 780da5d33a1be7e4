"""Run hpctrain.mnist and, before the final evaluation, compare every
worker's parameters bit for bit (a sha256 of each, Allgathered as raw
bytes): the chief prints `parameters on N workers: identical` or `...:
DIFFERENT` and the run goes on. What the compression tests use to hold
"every rank applies the same update, bit for bit" in real jobs; the check
lives here, not in hpctrain (test-only switches live in the tests).

    PYTHONPATH=tests mpirun -n 3 python -m ranks_agree --steps 50 --compression powersgd

The patch goes in after hpctrain.train.main has configured the process (numpy
must not load before it: it reads the BLAS thread count once).
"""
import sys

from hpctrain import train as entry

_train = entry.train


def train(args, *rest):
    import hashlib

    import numpy as np

    from hpctrain.base import device
    from hpctrain.loops import frame

    finish = frame.Frame.finish

    def agree(comm, params):
        """Whether every rank of comm holds the same params, bit for bit."""
        device.synchronize(device.array_module(params))
        mine = np.frombuffer(hashlib.sha256(device.to_host(params).tobytes()).digest(), np.uint8)
        everyone = np.empty((comm.Get_size(), mine.size), np.uint8)
        comm.Allgather(mine, everyone)
        return all(np.array_equal(row, everyone[0]) for row in everyone)

    def checked(self, model, step, extra, alone=False):
        world = self.world
        if model.collective:
            # A pipeline (pipeline/whole.Pipelined): each stage's replicas
            # compared, on every stage; no rank holds the whole model.
            engine = model.engine
            same = np.array([all(agree(engine.grid.stage_comm, c.params) for c in engine.chunks)], np.int64)
            world.comm.Allreduce(MPI.IN_PLACE, same, op=MPI.MIN)
            if world.chief:
                print(f"stage parameters on {engine.grid.replicas} replicas of each stage: "
                      f"{'identical' if same[0] else 'DIFFERENT'}", flush=True)
        else:
            same = agree(world.cluster.worker_comm, model.model.params)
            if world.chief:
                print(f"parameters on {world.cluster.num_workers} workers: {'identical' if same else 'DIFFERENT'}",
                      flush=True)
        return finish(self, model, step, extra, alone)

    from mpi4py import MPI
    frame.Frame.finish = checked
    return _train(args, *rest)


if __name__ == "__main__":
    entry.train = train
    sys.exit(entry.main())
