"""Workers that go quiet: the leader server notices a worker that has sent
nothing while the server owes it nothing (stopped, swapped out, hung in its
own code), says so in one line, and ends the job at the deadline if it never
comes back. The other workers go on meanwhile (async, backup workers).

    mpirun -n 4 python -m pytest tests/test_ps.py -k stopped_worker

A thread, because the server's own wait (Waitsome) wakes only for messages.
It judges only while the server is blocked in that wait, when every request
that arrived has been handled: a server stuck elsewhere (a hung rank) is left
to the workers' watchdogs, which name it.
"""
import sys
import threading
import time

import numpy as np

from ...errors import EXIT_TIMEOUT
from ..deadline import ABORT_GRACE_S


class SilenceWatch:
    """Warn after timeout/4 of silence from one worker; give up after timeout."""

    def __init__(self, server, timeout, out=sys.stderr):
        self.server, self.timeout, self.out = server, float(timeout), out
        self.warn_after = self.timeout / 4
        self.quiet_since = np.full(server.num_workers, time.monotonic())
        self.idle = False          # the server is blocked waiting for requests
        self.warned = set()
        self.stopped = False
        period = min(1.0, max(0.05, self.timeout / 20))
        threading.Thread(target=self._run, args=(period,), name="hpctrain-ps-silence", daemon=True).start()

    def heard(self, w):
        """A request from worker w, or a reply to it: it is not silent now."""
        self.quiet_since[w] = time.monotonic()
        self.warned.discard(w)

    def stop(self):
        self.stopped = True

    def _silent(self, now):
        srv = self.server
        held = {h[0] for h in srv.held}
        for w in range(srv.num_workers):
            if srv.done[w] or srv.want[w] >= 0 or w in held:   # done, or waiting for us
                continue
            yield w, now - self.quiet_since[w]

    def _run(self, period):
        srv = self.server
        while not self.stopped:
            time.sleep(period)
            if not self.idle:
                continue
            for w, quiet in self._silent(time.monotonic()):
                rank = srv.workers[w]
                if quiet > self.timeout and self.idle:
                    self._give_up(rank, w, quiet)
                    return
                if quiet > self.warn_after and w not in self.warned:
                    self.warned.add(w)
                    print(f"hpctrain: warning: worker {w} (rank {rank}) has sent nothing for {quiet:.0f} s; "
                          f"the job ends at --timeout {self.timeout:g} s unless it returns",
                          file=self.out, flush=True)

    def _give_up(self, rank, w, quiet):
        srv = self.server
        print(f"hpctrain: error: rank {srv.rank} waited {quiet:.0f} s for rank {rank} (requests from worker "
              f"{w}); giving up (--timeout {self.timeout:g})", file=self.out, flush=True)
        time.sleep(ABORT_GRACE_S)     # let the launcher forward the line before the ranks die
        srv.comm.Abort(EXIT_TIMEOUT)
