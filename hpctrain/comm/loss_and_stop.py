"""A ring step's loss and stop flag, summed over the replicas in one small
allreduce of their own, so that the gradient buffer the buckets exchange is
the model's gradient and nothing else (the pipeline's engine sums its
[loss, stop, ...] the same way, pipeline/engine.py).

Per step: `begin(stop)` (this rank's wish to stop), `loss_ready(loss)` as
soon as forward has the loss (a 1-element array, on the device or not), and
`summed()` once the gradients are exchanged: (the loss summed over the
ranks, whether any rank asked to stop), the same bits on every rank.

The sum starts as soon as the host holds the loss: on the CPU at
loss_ready, an Iallreduce that completes while backprop and the buckets
run; from a GPU the loss is copied to pinned memory asynchronously at
loss_ready (no synchronization of the compute stream) and the sum starts in
summed(), after that copy's event, which backprop's wait has long passed.
The training loop so reads the loss and the stop flag without waiting for
the optimizer's kernels. Sums in float64, as the pipeline's: exact for the
flag, and a loss of every rank's float32 value summed without float32's
rounding. Takes a communicator (the replicas'), the loss's copier
(device.copier: pinned memory and events on a GPU, plain copies on the
CPU) and a watchdog.

    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_loss_and_stop.py
"""
import numpy as np
from mpi4py import MPI

from ..precision import FLOAT32

from .strategy import waiting


class LossAndStop:
    """[loss, stop] of one step over comm (see the module's docstring);
    copier: device.copier(xp) of the loss's array module; watchdog: the
    deadline of the wait (or None)."""

    def __init__(self, comm, copier, watchdog=None):
        self.comm, self.watchdog, self.copier = comm, watchdog, copier
        self._host_loss = self.copier.host_empty(1, FLOAT32.compute)   # the loss, as the model computes it
        self._mine = np.zeros(2, np.float64)
        self._sum = np.zeros(2, np.float64)
        self._copied = self._request = None

    def begin(self, stop):
        """Before the step's forward: this rank's wish to stop."""
        self._mine[1] = 1.0 if stop else 0.0

    def loss_ready(self, loss):
        """forward has written this rank's loss (1 element): on the host it
        goes out at once; from a device once summed() finds it copied."""
        self._copied = self.copier.to_host(loss, self._host_loss, after=self.copier.mark())
        if self._copied is None:   # a host array: nothing to wait for
            self._start()

    def _start(self):
        self._mine[0] = self._host_loss[0]
        self._request = self.comm.Iallreduce(self._mine, self._sum, op=MPI.SUM)

    def summed(self):
        """(loss summed over the ranks, did any rank ask to stop): waits for the sum."""
        if self._request is None:
            self.copier.wait(self._copied)
            self._start()
        with waiting(self.watchdog, "loss and stop allreduce"):
            self._request.Wait()
        self._request = self._copied = None
        return float(self._sum[0]), bool(self._sum[1] > 0)
