"""Run by tests/test_waits.py under mpirun -n 2: rank 0 sleeps SLEEP_S before
each exchange, so rank 1 waits that long in it, once per kind of wait (a
Waits.one, a pipeline receive, the loss-and-stop allreduce); rank 1 prints one JSON line of its CPU seconds per wait, for
nap given as argv[1] ("1" or "0").

    mpirun -n 2 python tests/napping_ranks.py 1
"""
import json
import sys
import time

import numpy as np
from mpi4py import MPI

from hpctrain.comm.deadline import NO_WATCHDOG
from hpctrain.comm.waits import Waits
from hpctrain.pipeline.transfers import Receives

SLEEP_S = 1.0
comm = MPI.COMM_WORLD
waits = Waits(sys.argv[1] == "1")
buf = np.ones(1 << 16, np.float32)
receives = Receives(comm, 0, buf.shape, [7], 1, NO_WATCHDOG, "activations", 0, waits=waits)
cpu = {}


def exchange(name, rank0, rank1):
    comm.Barrier()
    if comm.rank == 0:
        time.sleep(SLEEP_S)
        rank0()
    else:
        t0 = time.process_time()
        rank1()
        cpu[name] = time.process_time() - t0


exchange("one", lambda: comm.Send(buf, 1, 5), lambda: waits.one(comm.Irecv(buf, 0, 5)))
receives.start()
exchange("pipeline receive", lambda: comm.Send(buf, 1, 7), lambda: receives.get(7))
head = np.ones(2, np.float64)
exchange("loss and stop", lambda: waits.allreduce(comm, head, MPI.SUM),
         lambda: waits.allreduce(comm, head, MPI.SUM))
assert buf[0] == 1 and head[0] == 2
if comm.rank == 1:
    print(json.dumps(cpu), flush=True)
