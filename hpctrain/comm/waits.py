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

`growing` (hpctrain.dist's engine thread): a wait that has gone on for a
while naps up to GROW_FRACTION of the time waited so far (at most
GROW_NAP_MAX_S) instead of NAP_MAX_S, so a wait of T costs a few dozen polls
rather than T / NAP_MAX_S, and ends at most an eighth of T (2 ms) late; a
wait shorter than NAP_MAX_S / GROW_FRACTION (1.3 ms) naps as before. There a
call's meeting waits for the other ranks' backward (tens of ms where four
ranks share two cores): about 1,000 polls a step, most of the engine
thread's 10 ms of CPU a step, against DDP's gloo threads' 5 (docs/library.md).

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
GROW_FRACTION = 0.125
GROW_NAP_MAX_S = 2e-3
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
    def __init__(self, nap, growing=False):
        self.nap, self.growing = bool(nap), bool(growing)

    def __repr__(self):
        return f"Waits(nap={self.nap}{', growing=True' if self.growing else ''})"

    def one(self, request):
        if not self.nap:
            request.Wait()
            return
        for _ in self._naps(self.growing):
            if request.Test():
                return

    def all(self, requests):
        if not self.nap:
            MPI.Request.Waitall(requests)
            return
        for _ in self._naps(self.growing):
            if MPI.Request.Testall(requests):
                return

    def some(self, requests):
        """Indices of the completed requests (at least one), None if none is active."""
        if not self.nap:
            return MPI.Request.Waitsome(requests)
        for _ in self._naps(self.growing):
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
    def _naps(growing=False):
        """Yields before each poll: at once while spinning, then after a nap
        (growing: up to an eighth of the time waited so far, see above)."""
        if not getattr(_slack, "tight", False):
            tight_timer_slack()      # per thread: the training thread, the allreduce thread
            _slack.tight = True
        clock = time.perf_counter
        start = clock()
        spin_until = start + SPIN_S
        nap = NAP_MIN_S
        while True:
            yield
            now = clock()
            if now < spin_until:
                continue
            time.sleep(nap)
            most = NAP_MAX_S if not growing else min(GROW_NAP_MAX_S, max(NAP_MAX_S, GROW_FRACTION * (now - start)))
            nap = min(2 * nap, most)
