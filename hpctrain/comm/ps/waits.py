"""Waiting for MPI requests without taking a core from the ranks that compute.

    python -c "from hpctrain.comm.ps.waits import Waits; print(Waits(nap=True))"

A ps job with more ranks than cores (2 servers + 2 workers on 2 cores) has,
at any moment of a round, two ranks computing (the workers' forward/backward,
or the servers' optimizer) and two waiting for them. MPI's Waitsome/Waitall
busy-poll (MPICH's progress throttle sleeps a microsecond now and then), so
the waiting ranks take about half of the cores from the computing ones and a
round costs about twice its work. With `nap`, a wait polls (Testsome/Testall)
for SPIN_S, then sleeps between polls, NAP_MIN_S doubling up to NAP_MAX_S: a
waiting rank then costs a poll per nap, and a message is seen at most
NAP_MAX_S late. Linux rounds every sleep up by the thread's timer slack
(50 us by default: a 20 us nap took 85 us here), so a napping thread asks
for 1 us of slack (prctl PR_SET_TIMERSLACK; elsewhere the naps are longer).
Without `nap` (a core per rank), the plain blocking calls.
"""
import ctypes
import sys
import time

from mpi4py import MPI

SPIN_S = 30e-6
NAP_MIN_S = 20e-6
NAP_MAX_S = 160e-6
PR_SET_TIMERSLACK = 29


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
        if self.nap:
            tight_timer_slack()      # the thread that waits is the one that builds the Waits

    def __repr__(self):
        return f"Waits(nap={self.nap})"

    def some(self, requests):
        """Indices of the completed requests (at least one), None if none is active."""
        if not self.nap:
            return MPI.Request.Waitsome(requests)
        for _ in self._naps():
            ready = MPI.Request.Testsome(requests)
            if ready is None or ready:
                return ready

    def all(self, requests):
        if not self.nap:
            MPI.Request.Waitall(requests)
            return
        for _ in self._naps():
            if MPI.Request.Testall(requests):
                return

    @staticmethod
    def _naps():
        """Yields before each poll: at once while spinning, then after a nap."""
        clock = time.perf_counter
        spin_until = clock() + SPIN_S
        nap = NAP_MIN_S
        while True:
            yield
            if clock() < spin_until:
                continue
            time.sleep(nap)
            nap = min(2 * nap, NAP_MAX_S)
