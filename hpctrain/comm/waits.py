"""Waiting for MPI without taking a core from the ranks that compute.

    python -c "from hpctrain.comm.waits import Waits; print(Waits(nap=True))"

Where ranks outnumber the node's cores (4 ranks on 2 cores; the World
decides once from --wait-mode, run/startup.py), some ranks always wait
while others compute: a ps round's servers while the workers run
forward/backward and the workers while the servers update; a pipeline's
lighter stage while the heavier one computes. MPI's blocking calls
(MPI_Wait, Waitall, Waitsome) busy-poll
(MPICH's progress throttle sleeps a microsecond now and then), so the
waiting ranks take about half of the cores from the computing ones: a
pipeline stage that waited 87% of its step still used as much CPU as the
stage it waited for. With `nap`, every wait here polls (Test, Testall,
Testsome) for SPIN_S, then sleeps between polls, NAP_MIN_S doubling up to
NAP_MAX_S: a waiting rank costs a poll per nap, and a message is seen at
most NAP_MAX_S late. Linux rounds every sleep up by the thread's timer slack
(50 us by default: a 20 us nap took 85 us here), so a thread that naps asks
for 1 us of slack (prctl PR_SET_TIMERSLACK, once per thread; elsewhere the
naps are longer). Without `nap` (a core per rank), MPI's plain blocking
calls: the lowest latency, and the same messages either way.

Not for the program's ring exchanges (comm/ring_allreduce.py): many short
waits for a neighbour that is exchanging too, latency-bound; napping there
took the MLP from 23k to 13k samples/s at 4 ranks on 2 cores. hpctrain.dist's
ring does nap there (RingAllreduce's `waits`): it runs on a communication
thread while the user's backward computes on the same cores, so a spinning
exchange takes the core from the neighbour it waits for (nanoGPT's loop, 4
ranks on 2 cores: the thread's CPU 13.6 -> 5.2 ms a step, docs/library.md).

The waits run under the watchdog's deadline as before: the caller's
`watchdog.waiting(...)` is around them.
"""
import ctypes
import sys
import threading
import time

from mpi4py import MPI

SPIN_S = 30e-6
NAP_MIN_S = 20e-6
NAP_MAX_S = 160e-6
PR_SET_TIMERSLACK = 29

_slack = threading.local()


def tight_timer_slack():
    """Sleeps of this thread end within about a microsecond of the time asked (Linux)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0)
        except (OSError, AttributeError):
            pass


class Waits:
    def __init__(self, nap):
        self.nap = bool(nap)

    def __repr__(self):
        return f"Waits(nap={self.nap})"

    def one(self, request):
        if not self.nap:
            request.Wait()
            return
        for _ in self._naps():
            if request.Test():
                return

    def all(self, requests):
        if not self.nap:
            MPI.Request.Waitall(requests)
            return
        for _ in self._naps():
            if MPI.Request.Testall(requests):
                return

    def some(self, requests):
        """Indices of the completed requests (at least one), None if none is active."""
        if not self.nap:
            return MPI.Request.Waitsome(requests)
        for _ in self._naps():
            ready = MPI.Request.Testsome(requests)
            if ready is None or ready:
                return ready

    def allreduce(self, comm, buf, op):
        """comm.Allreduce(MPI.IN_PLACE, buf, op), the same bits, with the wait
        for the last rank to arrive done here: the ranks first meet in an
        Ibarrier (napping where nap), then the Allreduce finds them all
        there. Every rank makes the same two calls whatever its own nap
        (nodes may differ; a blocking collective never matches a
        nonblocking one)."""
        self.one(comm.Ibarrier())
        comm.Allreduce(MPI.IN_PLACE, buf, op=op)

    @staticmethod
    def _naps():
        """Yields before each poll: at once while spinning, then after a nap."""
        if not getattr(_slack, "tight", False):
            tight_timer_slack()      # per thread: the training thread, the allreduce thread
            _slack.tight = True
        clock = time.perf_counter
        spin_until = clock() + SPIN_S
        nap = NAP_MIN_S
        while True:
            yield
            if clock() < spin_until:
                continue
            time.sleep(nap)
            nap = min(2 * nap, NAP_MAX_S)
