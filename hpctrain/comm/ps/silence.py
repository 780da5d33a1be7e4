"""Workers that go quiet: a server notices a worker that has sent nothing
while the server owes it nothing (stopped, swapped out, hung in its own
code). ps 0 says so in one line; the other workers go on (async, backup
workers). At the deadline (--timeout of silence):
- if every other worker has finished (the run is over), each server leaves
  the silent one behind: the others get their final replies and the chief
  writes the result, then ends the job (it can never join MPI_Finalize);
- otherwise ps 0 ends the job (exit 3) with a line naming the silent worker.

    mpirun -n 4 python -m pytest tests/test_ps.py -k "stopped_worker or never_returns or abandoned"

A worker can be silent because another rank holds it up (a stopped server
that it waits for), or because it is busy with work of its own (the chief's
evaluation): before it ends the job, ps 0 holds the watchdog's roll call, so
the line names a rank that does not answer (not the worker that waits for
it), and a worker that answers busy gets another --timeout. The warning at
timeout/4 holds no roll call: a roll call that is not followed by the end
of the job leaves its requests to a stopped rank pending, which MPI then
finds at MPI_Finalize (and it held the warning back past a short stop).

A thread, because the server's own wait (Waitsome) wakes only for messages:
it wakes the server with a message to itself. It judges only while the
server is blocked in that wait, when every request that arrived has been
handled: a server stuck elsewhere (a hung rank) is left to the workers'
watchdogs, which name it.
"""
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from .protocol import TAG_WAKE


class SilenceWatch:
    """Warn (ps 0) after timeout/4 of silence from one worker; at timeout,
    leave it behind if the run is over, else (ps 0) end the job."""

    def __init__(self, server, watchdog, out=sys.stderr):
        self.server, self.watchdog, self.timeout, self.out = server, watchdog, float(watchdog.timeout), out
        self.warn_after = self.timeout / 4
        self.quiet_since = np.full(server.num_workers, time.monotonic())
        self.idle = False          # the server is blocked waiting for requests
        self.warned = set()
        self.stopped = False
        self.woke = False
        # The server's wake-up line: a receive on its own COMM_SELF, in its Waitsome.
        self.wake_comm = MPI.COMM_SELF.Dup()
        self.wake_buf = np.zeros(1, np.int64)
        self.request = self.wake_comm.Recv_init(self.wake_buf, 0, TAG_WAKE)
        self.request.Start()
        # A roll call while this server is past its deadline: it gives up too.
        watchdog.also_expired(lambda: not self.stopped and self.idle and bool(self.gone()))
        period = min(1.0, max(0.05, self.timeout / 20))
        threading.Thread(target=self._run, args=(period,), name="hpctrain-ps-silence", daemon=True).start()

    def heard(self, w):
        """A request from worker w, or a reply to it: it is not silent now."""
        self.quiet_since[w] = time.monotonic()
        self.warned.discard(w)

    def gone(self):
        """Workers silent for longer than the deadline."""
        now = time.monotonic()
        return [w for w, quiet in self._silent(now) if quiet > self.timeout]

    def stop(self):
        self.stopped = True
        if not self.woke:
            self.request.Cancel()
            self.request.Wait()
        self.request.Free()
        self.wake_comm.Free()

    def _silent(self, now):
        srv = self.server
        held = {h[0] for h in srv.cut.held}
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
            now = time.monotonic()
            silent = dict(self._silent(now))
            gone = [w for w, quiet in silent.items() if quiet > self.timeout]
            if gone and self.idle:
                others_done = srv.done.any() and all(srv.done[w] or w in gone for w in range(srv.num_workers))
                if others_done:
                    self.woke = True          # the server leaves them behind (Server._leave_behind)
                    self.wake_comm.Send(np.ones(1, np.int64), 0, TAG_WAKE)
                    return
                if srv.leader:
                    w = gone[0]
                    if self.watchdog.fire(f"requests from worker {w}", srv.workers[w], silent[w],
                                          peer_named_alone=True):
                        return
                    # A rank answered busy (the chief evaluating): another full --timeout.
                    self.quiet_since[gone] = time.monotonic()
                    continue
            if srv.leader:
                self._warn([w for w, quiet in silent.items() if quiet > self.warn_after and w not in self.warned],
                           silent)

    def _warn(self, due, silent):
        """One line per worker silent for warn_after."""
        for w in due:
            self.warned.add(w)
            print(f"hpctrain: warning: worker {w} (rank {self.server.workers[w]}) has sent nothing for "
                  f"{silent[w]:.0f} s; the job ends at --timeout {self.timeout:g} s unless it returns",
                  file=self.out, flush=True)
