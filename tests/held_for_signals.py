"""Run hpctrain.mnist with rank 0 held, once it has written a checkpoint
past a given step, until the stop signal the test then sends has reached it
(tests/test_checkpoint.py's run_and_signal): the job stops after the step
that follows that checkpoint, at any speed of the machine. The other ranks
go on into that step and take the signal wherever it finds them (waiting
for rank 0 in a collective, or after), as before. Without the hold
the ranks ran on while the test saw the checkpoint and signalled, so a run
needed hundreds of steps of margin (most of those tests' time) and still
stopped wherever the signal happened to land.

    HELD_AFTER_STEP=0 PYTHONPATH=tests mpirun -n 2 python -m held_for_signals --checkpoint-dir ck ...
    # then: kill -TERM <mpirun's pid> once ck holds a checkpoint

Environment:
  HELD_AFTER_STEP=S   after writing its first checkpoint of a step past S,
                      rank 0 waits (up to 30 s) for a stop signal, then goes on:
                      the next step carries it to every rank (run/stop_signal.py)

The patches go in when entry.train starts, after the process is configured
(numpy must not load before: it reads the BLAS thread count once).
"""
import os
import sys
import time

from hpctrain import train as entry
from hpctrain.run import cluster

_train = entry.train
HOLD_S = 30.0


def hold_after_checkpoints(after_step, owner, name, holds=True):
    """Wrap `owner.name`, a checkpoint write called (x, step, ...) (the
    program's resume.write_checkpoint; ps's Checkpoints.save_written,
    tests/faults/inject_ps.py): where `holds`, once it has written the first
    checkpoint of a step past `after_step`, wait there (up to HOLD_S) until
    the stop signal the test then sends has reached this process."""
    from hpctrain.run.stop_signal import StopSignal
    made, held_once = [], []
    init, write = StopSignal.__init__, getattr(owner, name)

    def remembered(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    def held(first, step, *args, **kwargs):
        path = write(first, step, *args, **kwargs)
        if holds and step > after_step and not held_once:
            held_once.append(step)
            deadline = time.monotonic() + HOLD_S
            while made[0].received is None and time.monotonic() < deadline:
                time.sleep(0.001)   # the handler runs here, in the main thread
        return path

    StopSignal.__init__ = remembered
    setattr(owner, name, held)


def train(*args, **kwargs):
    from hpctrain.checkpoints import resume
    hold_after_checkpoints(int(os.environ["HELD_AFTER_STEP"]), resume, "write_checkpoint",
                           holds=(cluster.launcher_env()[0] or 0) == 0)   # rank 0
    return _train(*args, **kwargs)


def main():
    entry.train = train
    sys.exit(entry.main())


if __name__ == "__main__":
    main()
