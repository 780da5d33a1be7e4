"""Deadlines for blocking MPI waits: a rank that waits too long finds out
which rank stalled, names it, and aborts the whole job instead of hanging.

MPI's blocking calls cannot time out, and polling non-blocking ones costs CPU
that oversubscribed ranks need. So the waiting thread just records what it is
waiting for (two dict writes), and one daemon thread checks the records a few
times a second. Used by the comm strategies, comm/ps and the run's start-up:

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

Work that one rank does while the others wait for it (the chief's
evaluation, its result files) runs under `with dog.busy():`: that
rank then answers a roll call "busy", and a rank whose wait expired waits
another --timeout instead of giving up, for as long as the answer is busy.
A busy rank that stops answering is named as any other. Once
`results_written(note)` is called, `note` ends every line (that the run's
results are already written); once `name_roles(fn)` is, each rank's part
follows its number ("rank 3 (pipeline 1, data 1, tensor 0)": its
coordinates on the mesh, run/mesh.py, in ring and pipeline modes).
"""
import contextlib
import sys
import threading
import time

from ..base.errors import EXIT_PREEMPTED, EXIT_TIMEOUT

ABORT_GRACE_S = 0.5
ROLL_CALL_S = 2.0      # how long the others have to answer "alive?"
# A rank still answers "busy" this long after its busy work ended: a roll
# call held just then by another rank sees what this one saw a moment ago,
# so the ranks whose waits expired together decide alike.
BUSY_GRACE_S = 2 * ROLL_CALL_S
_ASK, _ANSWER = 71, 72  # tags on the roll-call communicator
# The answers to "alive?"; OWN: inside work of its own that is not MPI (a
# user's model code), OWN_GIVING_UP: the same, past the deadline.
ALIVE, GIVING_UP, BUSY, OWN, OWN_GIVING_UP = 0, 1, 2, 3, 4


class _Wait:
    __slots__ = ("dog", "what", "peer", "key", "began", "since", "active", "own")

    def __init__(self, dog, what, peer, own=False):
        self.dog, self.what, self.peer, self.own = dog, what, peer, own

    def __enter__(self):
        self.key = threading.get_ident()
        # since: when the deadline counts from (a busy peer moves it); began: for the line
        self.began = self.since = time.monotonic()
        self.active = True
        self.dog._waits[self.key] = self
        return self

    def __exit__(self, *exc):
        self.active = False
        self.dog._waits.pop(self.key, None)
        return False


class _Busy:
    __slots__ = ("dog",)

    def __init__(self, dog):
        self.dog = dog

    def __enter__(self):
        self.dog._busy += 1
        return self

    def __exit__(self, *exc):
        self.dog._busy -= 1
        self.dog._busy_until = time.monotonic() + BUSY_GRACE_S
        return False


class NullWatchdog:
    """The watchdog of code that is given none (self-checks, unit tests): its
    waits and busy work have no deadline. `timeout` is None: nothing to
    watch for (a ps server starts no SilenceWatch)."""

    timeout = None

    def waiting(self, what, peer=None, own=False):
        return contextlib.nullcontext()

    def busy(self):
        return contextlib.nullcontext()


NO_WATCHDOG = NullWatchdog()


class Watchdog:
    """Aborts the job when any thread of this rank waits longer than `timeout` s."""

    def __init__(self, timeout, rank, abort, out=sys.stderr, heartbeat=None, preempted=None):
        """heartbeat: called by this thread a few times a second, for as long
        as the process moves (exit_guard.py's watcher listens). preempted:
        called when a wait expires; the words to end the line with when a
        stop signal (SIGTERM, SIGUSR1, SIGHUP) had come to this rank, else None: the
        job then ends with exit 75, as a pre-emption does (a rank stuck in
        its step must not turn a pre-emption into a failure), else 3."""
        self.timeout = float(timeout)
        self._heartbeat, self._preempted = heartbeat, preempted
        self.rank = rank
        self.abort = abort   # MPI_Abort once MPI is up; before, os._exit
        self._out = out
        self._waits = {}
        self.fired = None
        self._roll = None    # (communicator, numpy) once roll_call_on() was called
        self.no_roll_call = None   # why there is none, said in the line
        self._watches = []
        self._expired_checks = []   # more reasons to answer "giving up" (also_expired)
        self._busy, self._busy_until = 0, 0.0
        self._giving_up = False
        self.note = None
        self.roles = None   # callable: a world rank -> its part in words, said after its number
        self._in_last_barrier = False
        self._past_last_barrier = threading.Event()
        self._lock = threading.Lock()
        self._asking = threading.Lock()   # one roll call at a time: answers are matched by rank only
        self._firing = threading.Lock()
        period = min(1.0, max(0.05, self.timeout / 10))
        self._thread = threading.Thread(target=self._run, args=(period,), name="hpctrain-watchdog",
                                        daemon=True)
        self._thread.start()

    def mpi_started(self, rank, abort):
        """MPI is up: this rank's number in the world, and MPI_Abort to end the job."""
        self.rank, self.abort = rank, abort

    def results_written(self, note):
        """The run's results are written: every line from here on ends with `note`."""
        self.note = note

    def name_roles(self, roles):
        """roles: a world rank -> its part in words ("pipeline 1, data 0, tensor 0"),
        said after its number in every line from here on (run/mesh.Mesh.describe)."""
        self.roles = roles

    def without_roll_call(self, reason, abort):
        """MPI gives less than MPI_THREAD_MULTIPLE: this thread must not call
        MPI; a line names whom it waited for, says `reason`, and `abort` ends
        this process (the launcher takes the rest down)."""
        self.no_roll_call, self.abort = reason, abort

    @contextlib.contextmanager
    def last_barrier(self):
        """Around the shutdown barrier (comm/start.stop_mpi), every rank's
        last collective. A rank past it stops answering roll calls
        (stop_using_mpi), while a rank whose main thread has not yet returned
        from the same barrier may still hold one: the silence of the ranks
        that left must not read as ranks stuck (past_last_barrier)."""
        self._in_last_barrier = True
        yield
        self._past_last_barrier.set()

    def past_last_barrier(self, wait=0.0):
        """Whether this rank is past the shutdown barrier: every rank got
        there, nothing is stuck before it. While this rank is in the barrier,
        waits up to `wait` s for it to return: a roll call that found ranks
        silent then may have found ranks that left (their barrier returned
        first), and then this rank's returns a moment later."""
        if wait and self._in_last_barrier:
            return self._past_last_barrier.wait(wait)
        return self._past_last_barrier.is_set()

    def stop_using_mpi(self, abort):
        """Before MPI_Finalize: no more roll calls (this thread's MPI calls
        would race the finalization: one under way ends first), and `abort`
        (os._exit) instead of MPI."""
        with self._asking, self._lock:
            self._roll = None
            self.abort = abort

    def also_watch(self, check):
        """check() is called by this thread a few times a second; when it
        returns (line, exit code) the line is printed (by rank 0, or after a
        moment by any rank) and the job aborted with that code."""
        self._watches.append(check)

    def also_expired(self, check):
        """check() (any thread, a few times a second) returns True while this
        rank has itself waited past the deadline in a wait of its own making
        (comm/ps/silence.py): it then answers a roll call "giving up"."""
        self._expired_checks.append(check)

    def busy(self):
        """Context manager around work this rank does while others wait for
        it (the chief evaluating alone): their expired waits go on while it
        answers "busy" (see above)."""
        return _Busy(self)

    def roll_call_on(self, comm):
        """Collective over comm: from now on an expired wait holds a roll call
        on a duplicate of comm, answered by every rank's watchdog thread."""
        import numpy as np
        self._roll = (comm.Dup(), np)

    def waiting(self, what, peer=None, own=False):
        """Context manager around one blocking wait. `peer`: a rank, a list of
        ranks, a string, or a callable returning one (evaluated only on timeout).
        own: the wait is for work of this rank's own, outside MPI (a user's
        model code): a roll call then names this rank as the one stuck in it."""
        return _Wait(self, what, peer, own)

    def _run(self, period):
        while True:
            time.sleep(period)
            if self._heartbeat is not None:
                self._heartbeat()
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
            for wait in list(self._waits.values()):
                now = time.monotonic()
                if now - wait.since > self.timeout:
                    if self.fire(wait.what, wait.peer, now - wait.began, wait=wait):
                        return
                    wait.since = time.monotonic()   # a busy rank: another full --timeout

    def _answer_roll_calls(self):
        """Reply "alive" to every rank that asked (this thread only)."""
        with self._lock:
            if self._roll is None:
                return
            try:
                self._answer_locked(*self._roll)
            except Exception as exc:
                # --on-failure shrink (comm/ulfm.py): a peer died; no roll call on
                # this communicator any more (the survivors' comes with roll_call_on)
                from mpi4py import MPI
                if not isinstance(exc, MPI.Exception):
                    raise
                self._roll = None

    def _answer_locked(self, comm, np):
        asked = np.zeros(1, np.int64)
        while comm.Iprobe(tag=_ASK):
            status = _status()
            comm.Recv(asked, source=_any_source(), tag=_ASK, status=status)
            comm.Send(np.array([self._answer()], np.int64), dest=status.Get_source(), tag=_ANSWER)

    def _answer(self):
        """Whether this rank gives up too (of the ranks that give up, the
        lowest prints the job's line), is busy, or is just alive."""
        now = time.monotonic()
        waits = list(self._waits.values())
        own = any(w.own for w in waits)
        if self._giving_up or any(now - w.since > self.timeout for w in waits) \
                or any(check() for check in self._expired_checks):
            return OWN_GIVING_UP if own else GIVING_UP
        if own:
            return OWN
        return BUSY if self._busy or now < self._busy_until else ALIVE

    def roll_call(self, grace=ROLL_CALL_S):
        """(silent, giving_up, busy, own): the ranks that did not answer
        "alive?" within grace seconds, those that answered that they give up
        too, those busy, and those inside work of their own (sorted lists);
        answering the others meanwhile."""
        with self._asking:
            return self._roll_call(grace)

    def _roll_call(self, grace):
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
        heard = [r for r in others if r not in silent]
        said = {r: int(answers[r][0]) for r in heard}
        return (silent, [r for r in heard if said[r] in (GIVING_UP, OWN_GIVING_UP)],
                [r for r in heard if said[r] == BUSY], [r for r in heard if said[r] in (OWN, OWN_GIVING_UP)])

    def silent_ranks(self):
        """The ranks that do not answer a roll call now (sorted; [] when every
        rank answers), or None where no roll call can be held (no
        MPI_THREAD_MULTIPLE, not yet, or no longer: stop_using_mpi)."""
        with self._asking:
            return None if self._roll is None else self._roll_call(ROLL_CALL_S)[0]

    def fire(self, what, peer, waited, wait=None, peer_named_alone=False):
        """This rank waited `waited` s for `peer` (`what`): hold a roll call,
        then print the job's line (the lowest rank that gives up) and abort.
        Returns False, without a line, when a rank answered busy or `wait`
        ended meanwhile (the caller waits on), True once the job is being
        ended (by this call, or by another thread of this rank).
        peer_named_alone: when the roll call finds `peer` alone silent, the
        line is the plain waited line (it names the culprit already)."""
        with self._firing:
            if self._giving_up:
                return True
            silent, own, first = None, [], True
            if self._roll is not None:
                silent, giving_up, busy, own = self.roll_call()
                if busy or (wait is not None and not wait.active):
                    return False
                first = self.rank < min(giving_up, default=self.rank + 1)
            self._giving_up = True
        if (peer_named_alone and silent == [peer]) or (wait is not None and wait.own):
            silent = None   # the waited line names the rank already (a wait of its own: this one)
        self._end(what, peer, waited, silent, first, own)
        return True

    def _end(self, what, peer, waited, silent, first, own=()):
        if callable(peer):
            peer = peer()
        if isinstance(peer, (list, tuple, set)) and len(peer) == 1:
            peer = next(iter(peer))
        if peer is None:
            whom = "its peers"
        elif isinstance(peer, (list, tuple, set)):
            whom = "ranks " + (", " if self.roles else ",").join(self._named(p) for p in sorted(peer))
        elif isinstance(peer, int):
            whom = f"rank {self._named(peer)}"
        else:
            whom = str(peer)
        waited_line = f"rank {self._named(self.rank)} waited {waited:.0f} s for {whom} ({what})"
        if silent:
            culprits = ", ".join(map(self._named, silent))
            self.fired = (f"rank{'s' if len(silent) > 1 else ''} {culprits} stopped responding "
                          f"(no answer to a roll call in {ROLL_CALL_S:g} s); {waited_line}; "
                          f"giving up (--timeout {self.timeout:g})")
        elif own:
            names = ", ".join(map(self._named, own))
            self.fired = (f"rank{'s' if len(own) > 1 else ''} {names} {'are' if len(own) > 1 else 'is'} stuck in "
                          f"its own work, outside MPI (the model file's code: its import, its function or a layer "
                          f"check that does not return); {waited_line}; giving up (--timeout {self.timeout:g})")
        elif self._roll is not None and silent is not None:
            self.fired = (f"{waited_line}; every rank answered a roll call (so a rank is alive but not "
                          f"taking part: stuck outside MPI, or a deadlock); giving up (--timeout {self.timeout:g})")
        else:
            self.fired = (f"{waited_line}" + (f" ({self.no_roll_call})" if self.no_roll_call else "")
                          + f"; giving up (--timeout {self.timeout:g})")
        code = EXIT_TIMEOUT
        stopped = self._preempted() if self._preempted is not None else None
        if stopped:
            self.fired += f"; {stopped}"
            code = EXIT_PREEMPTED
        if self.note:
            self.fired += f"; {self.note}"
        if first:
            print(f"hpctrain: error: {self.fired}", file=self._out, flush=True)
        else:
            # The lowest surviving rank prints the job's one line: give it time
            # to get there before this rank takes the job down.
            self._linger(ROLL_CALL_S + 2 * ABORT_GRACE_S)
        # MPI_Abort makes the launcher kill every rank at once, and a line still
        # in the pipe to the launcher can be lost with them: give it a moment.
        self._linger(ABORT_GRACE_S)
        self.abort(code)

    def _named(self, rank):
        return f"{rank} ({self.roles(rank)})" if self.roles else str(rank)

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
