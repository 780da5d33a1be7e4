"""Jobs for tests/test_dist.py: a rank that stops responding, or one that
calls allreduce with another shape than the others (in the world, or in a
process set of ranks 0 and 1 while rank 2 waits in a world barrier).

    mpirun -n 2 python -m tests.dist_calls stop 3            # rank 1 stops: one line, exit 3
    mpirun -n 2 python -m tests.dist_calls mismatch 3        # one line naming both calls, exit 2
    mpirun -n 3 python -m tests.dist_calls set_mismatch 3    # the same, through the set: exit 2, not 3
"""
import os
import signal
import sys

import numpy as np

import hpctrain.dist as hvd

mode, timeout = sys.argv[1], float(sys.argv[2])
hvd.init(timeout=timeout)
hvd.allreduce(np.ones(3))
if mode == "stop" and hvd.rank() == 1:
    os.kill(os.getpid(), signal.SIGSTOP)   # every thread stops: its watchdog answers no roll call
if mode == "set_mismatch":
    pair = hvd.ProcessSet([0, 1])
    if pair.included():
        hvd.allreduce(np.ones(4 + hvd.rank()), name="w", process_set=pair)
    hvd.barrier()
hvd.allreduce(np.ones(4 + (mode == "mismatch" and hvd.rank() == 1)), name="w")
print("the job went on", flush=True)
hvd.shutdown()
