"""Deadlines for blocking MPI waits: a rank that waits too long finds out
which rank stalled, names it, and aborts the whole job instead of hanging.

MPI's blocking calls cannot time out, and polling non-blocking ones costs CPU
that oversubscribed ranks need. So the waiting thread just records what it is
waiting for (two dict writes), and one daemon thread checks the records a few
times a second. Used by the comm strategies, comm/ps and the session:

    dog = Watchdog(timeout=300, rank=comm.rank, abort=comm.Abort)
    dog.roll_call_on(comm)          # once MPI is up (needs MPI_THREAD_MULTIPLE)
    with dog.waiting("ring allreduce", peer=left):
        comm.Sendrecv(...)

A survivor alone cannot tell which rank stopped: in a ring every rank ends up
waiting for a neighbour, innocent or not. So when a wait expires, the
watchdog's thread holds a roll call on a communicator of its own: it asks
every rank "alive?" and gives them ROLL_CALL_S to answer. Every watchdog
thread answers such questions (it polls for them), whatever its main thread
is blocked in; a rank that is stopped, or dead, does not. The line then names
the ranks that did not answer, and only the lowest rank that did answer
prints it (one line per job). Where the library gives less than
MPI_THREAD_MULTIPLE, the thread must not call MPI: the line names the ranks
waited for and says the culprit could not be determined.
"""
import sys
import threading
import time

from ..errors import EXIT_TIMEOUT

ABORT_GRACE_S = 0.5
ROLL_CALL_S = 2.0      # how long the others have to answer "alive?"
_ASK, _ANSWER = 71, 72  # tags on the roll-call communicator


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
        self._roll = None    # (communicator, numpy) once roll_call_on() was called
        self.no_roll_call = None   # why there is none, said in the line
        self._watches = []
        self._lock = threading.Lock()
        period = min(1.0, max(0.05, self.timeout / 10))
        self._thread = threading.Thread(target=self._run, args=(period,), name="hpctrain-watchdog",
                                        daemon=True)
        self._thread.start()

    def stop_using_mpi(self, abort):
        """Before MPI_Finalize: no more roll calls (this thread's MPI calls
        would race the finalization), and `abort` (os._exit) instead of MPI."""
        with self._lock:
            self._roll = None
            self.abort = abort

    def also_watch(self, check):
        """check() is called by this thread a few times a second; when it
        returns (line, exit code) the line is printed (by rank 0, or after a
        moment by any rank) and the job aborted with that code."""
        self._watches.append(check)

    def roll_call_on(self, comm):
        """Collective over comm: from now on an expired wait holds a roll call
        on a duplicate of comm, answered by every rank's watchdog thread."""
        import numpy as np
        self._roll = (comm.Dup(), np)

    def waiting(self, what, peer=None):
        """Context manager around one blocking wait. `peer`: a rank, a list of
        ranks, a string, or a callable returning one (evaluated only on timeout)."""
        return _Wait(self, what, peer)

    def _run(self, period):
        while True:
            time.sleep(period)
            self._answer_roll_calls()
            for check in self._watches:
                verdict = check()
                if verdict:
                    line, code = verdict
                    if self.rank != 0:
                        # Rank 0 got the same signal, most likely, and ends the
                        # job after ABORT_GRACE_S: one line, not one per rank.
                        self._linger(3.0)
                    print(f"hpctrain: error: {line}", file=self._out, flush=True)
                    self._linger(ABORT_GRACE_S)
                    self.abort(code)
                    return
            now = time.monotonic()
            for since, what, peer in list(self._waits.values()):
                if now - since > self.timeout:
                    self._fire(what, peer, now - since)
                    return

    def _answer_roll_calls(self):
        """Reply "alive" to every rank that asked (this thread only)."""
        with self._lock:
            if self._roll is None:
                return
            self._answer_locked(*self._roll)

    def _answer_locked(self, comm, np):
        asked = np.zeros(1, np.int64)
        while comm.Iprobe(tag=_ASK):
            status = _status()
            comm.Recv(asked, source=_any_source(), tag=_ASK, status=status)
            # The answer says whether this rank's own wait has expired too: of
            # the ranks that give up, the lowest prints the job's line.
            now = time.monotonic()
            expired = any(now - since > self.timeout for since, _, _ in list(self._waits.values()))
            comm.Send(np.array([int(expired)], np.int64), dest=status.Get_source(), tag=_ANSWER)

    def roll_call(self, grace=ROLL_CALL_S):
        """(silent, giving_up): the ranks that did not answer "alive?" within
        grace seconds, and those that answered that they give up too (sorted
        lists); asking from this thread, answering the others meanwhile."""
        comm, np = self._roll
        others = [r for r in range(comm.Get_size()) if r != comm.Get_rank()]
        question = np.zeros(1, np.int64)
        sends = [comm.Issend(question, dest=r, tag=_ASK) for r in others]
        answers = {r: np.zeros(1, np.int64) for r in others}
        recvs = {r: comm.Irecv(answers[r], source=r, tag=_ANSWER) for r in others}
        end = time.monotonic() + grace
        while time.monotonic() < end and not all(q.Test() for q in recvs.values()):
            self._answer_roll_calls()
            time.sleep(0.02)
        # Requests to a stopped rank stay pending: the job is about to be aborted.
        del sends
        silent = sorted(r for r, q in recvs.items() if not q.Test())
        return silent, sorted(r for r in others if r not in silent and answers[r][0])

    def _fire(self, what, peer, waited):
        silent, first = None, True
        if self._roll is not None:
            silent, giving_up = self.roll_call()
            first = self.rank < min(giving_up, default=self.rank + 1)
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
        waited_line = f"rank {self.rank} waited {waited:.0f} s for {whom} ({what})"
        if silent:
            culprits = ", ".join(map(str, silent))
            self.fired = (f"rank{'s' if len(silent) > 1 else ''} {culprits} stopped responding "
                          f"(no answer to a roll call in {ROLL_CALL_S:g} s); {waited_line}; "
                          f"giving up (--timeout {self.timeout:g})")
        elif self._roll is not None:
            self.fired = (f"{waited_line}; every rank answered a roll call (so a rank is alive but not "
                          f"taking part: stuck outside MPI, or a deadlock); giving up (--timeout {self.timeout:g})")
        else:
            self.fired = (f"{waited_line}" + (f" ({self.no_roll_call})" if self.no_roll_call else "")
                          + f"; giving up (--timeout {self.timeout:g})")
        if first:
            print(f"hpctrain: error: {self.fired}", file=self._out, flush=True)
        else:
            # The lowest surviving rank prints the job's one line: give it time
            # to get there before this rank takes the job down.
            self._linger(ROLL_CALL_S + 2 * ABORT_GRACE_S)
        # MPI_Abort makes the launcher kill every rank at once, and a line still
        # in the pipe to the launcher can be lost with them: give it a moment.
        self._linger(ABORT_GRACE_S)
        self.abort(EXIT_TIMEOUT)

    def _linger(self, seconds):
        """Sleep, still answering roll calls (a rank that fired is not stalled)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self._answer_roll_calls()
            time.sleep(0.02)


def _status():
    from mpi4py import MPI
    return MPI.Status()


def _any_source():
    from mpi4py import MPI
    return MPI.ANY_SOURCE
