"""Deadlines for blocking MPI waits: a rank that waits too long names the peer
it waited for and aborts the whole job instead of hanging.

MPI's blocking calls cannot time out, and polling non-blocking ones costs CPU
that oversubscribed ranks need. So the waiting thread just records what it is
waiting for (two dict writes), and one daemon thread checks the records a few
times a second. Used by comm/ring.py, comm/ps.py and train.py:

    dog = Watchdog(timeout=300, rank=comm.rank, abort=comm.Abort)
    with dog.waiting("ring allreduce", peer=left):
        comm.Sendrecv(...)
"""
import sys
import threading
import time

from ..errors import EXIT_TIMEOUT

ABORT_GRACE_S = 0.5


class _Wait:
    __slots__ = ("dog", "what", "peer", "key")

    def __init__(self, dog, what, peer):
        self.dog, self.what, self.peer = dog, what, peer

    def __enter__(self):
        self.key = threading.get_ident()
        self.dog._waits[self.key] = (time.monotonic(), self.what, self.peer)
        return self

    def __exit__(self, *exc):
        self.dog._waits.pop(self.key, None)
        return False


class Watchdog:
    """Aborts the job when any thread of this rank waits longer than `timeout` s."""

    def __init__(self, timeout, rank, abort, out=sys.stderr):
        self.timeout = float(timeout)
        self.rank = rank
        self.abort = abort   # MPI_Abort once MPI is up; before, os._exit
        self._out = out
        self._waits = {}
        self.fired = None
        period = min(1.0, max(0.05, self.timeout / 10))
        self._thread = threading.Thread(target=self._run, args=(period,), name="hpctrain-watchdog",
                                        daemon=True)
        self._thread.start()

    def waiting(self, what, peer=None):
        """Context manager around one blocking wait. `peer`: a rank, a list of
        ranks, a string, or a callable returning one (evaluated only on timeout)."""
        return _Wait(self, what, peer)

    def _run(self, period):
        while True:
            time.sleep(period)
            now = time.monotonic()
            for since, what, peer in list(self._waits.values()):
                if now - since > self.timeout:
                    self._fire(what, peer, now - since)
                    return

    def _fire(self, what, peer, waited):
        if callable(peer):
            peer = peer()
        if isinstance(peer, (list, tuple, set)) and len(peer) == 1:
            peer = next(iter(peer))
        if peer is None:
            whom = "its peers"
        elif isinstance(peer, (list, tuple, set)):
            whom = "ranks " + ",".join(str(p) for p in sorted(peer))
        elif isinstance(peer, int):
            whom = f"rank {peer}"
        else:
            whom = str(peer)
        self.fired = f"rank {self.rank} waited {waited:.0f} s for {whom} ({what}); giving up (--timeout {self.timeout:g})"
        print(f"hpctrain: error: {self.fired}", file=self._out, flush=True)
        # MPI_Abort makes the launcher kill every rank at once, and a line still
        # in the pipe to the launcher can be lost with them: give it a moment.
        time.sleep(ABORT_GRACE_S)
        self.abort(EXIT_TIMEOUT)
