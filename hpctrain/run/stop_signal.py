"""SIGTERM and SIGUSR1 (SLURM's pre-emption and time-limit warnings), and
SIGHUP (a closed terminal, a dropped ssh session: its default action would
end the rank with no checkpoint and its temporary files left): a flag the
next step carries to every rank, so all ranks stop after the same step and
checkpoint (exit 75). A SIGHUP the caller ignores (nohup) stays ignored.

Made first thing in every rank (train.py), before MPI starts: a signal that
comes during start-up is kept for the first step instead of killing the rank
mid-collective, and the watchdog (comm/deadline.py) can ask it whether a
stop was asked for when a wait expires (the job then ends 75, not 3).

    mpirun -n 2 python -m hpctrain.mnist --checkpoint-dir ckpt   # then: kill -TERM <mpirun's pid>
"""
import contextlib
import os
import signal
import time
import types

from ..base.errors import EXIT_PREEMPTED

# The signals that stop training after a checkpoint (Ctrl-C is train.py's: at once)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


class StopSignal:
    """SIGTERM/SIGUSR1 (SLURM's pre-emption and time-limit warnings) and SIGHUP set a flag
    that the next step carries to every rank, so all ranks stop after the same
    step.

    Python runs a signal handler only when the main thread gets back to Python
    code, so a rank blocked inside MPI during start-up would never see it. The
    signal's number is therefore also written to a pipe (set_wakeup_fd, done
    in C at delivery), which the watchdog's thread reads. During training the
    loops take the signal (checkpoint, exit 75 together). Outside training (start-up, or
    after the last step while the results are written) a signal that the
    process has not acted on within GRACE_S ends the job (exit 75) from that
    thread: a rank stuck there must not keep a pre-empted job alive. After
    the last step, only if a rank is stuck: while every rank answers a roll
    call (a long final evaluation, the result files) the run goes on to
    write its results and exit 0 (stopped_outside_training below)."""

    GRACE_S = 5.0

    def __init__(self):
        self.received = None   # the signal's name, e.g. "SIGTERM"
        self.signum = 0
        self.phase = "start-up"   # then "training" and "finishing": training() and frame.Frame.training
        # nohup: a SIGHUP ignored stays ignored, and the run goes on
        self._handlers = {sig: signal.SIG_IGN if sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN
                          else self._handle for sig in STOP_SIGNALS}
        self.claim()
        self.wakeup_fd, write_fd = os.pipe()
        os.set_blocking(self.wakeup_fd, False)
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._arrived = None
        self._seen = None   # the first stop signal delivered, read from the pipe (any phase)

    def claim(self):
        """Set this rank's handlers (again): MPI_Init may put its own in their
        place (UCX takes SIGHUP for its debug signal, UCX_DEBUG_SIGNO, and
        swallows it), so train.py calls this once MPI is up."""
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name
        self.signum = int(signum)

    @contextlib.contextmanager
    def training(self):
        """The server loop's phase (workers: frame.Frame.training): a stop
        signal is the loop's to take; leaving normally, the run is finishing.
        Set `.stopped` on the yielded object when the loop ends for a signal."""
        self.phase = "training"
        run = types.SimpleNamespace(stopped=False)
        yield run
        if not run.stopped:
            self.phase = "finishing"

    def overdue(self):
        """Called by the watchdog's thread: (signal name, phase) when a stop
        signal arrived outside training and GRACE_S have passed since."""
        self._drain()
        if self._arrived and self.phase != "training" and time.monotonic() - self._arrived[0] > self.GRACE_S:
            return self._arrived[1:]
        return None

    def postpone(self):
        """The process acted on an overdue signal by going on (every rank
        answered a roll call: working, not stuck): overdue() asks again
        GRACE_S from now."""
        if self._arrived is not None:
            self._arrived = (time.monotonic(), *self._arrived[1:])

    def _drain(self):
        """The signals delivered since the last call (written to the pipe in
        C, so seen even while the main thread sits in MPI, where no Python
        handler runs)."""
        try:
            data = os.read(self.wakeup_fd, 64)
        except BlockingIOError:
            data = b""
        for num in data:
            if num not in STOP_SIGNALS:
                continue
            self._seen = self._seen or signal.Signals(num).name
            # A signal read during training is the loop's to act on.
            if self._arrived is None and self.phase != "training":
                self._arrived = (time.monotonic(), signal.Signals(num).name, self.phase)

    def preempted_line(self, checkpoint_dir):
        """The words for a deadline line when a stop signal had come (the job
        ends 75 then: a rank stuck in its step must not turn a pre-emption
        into a failure), or None."""
        self._drain()
        name = self.received or self._seen
        if name is None:
            return None
        where = (f"the checkpoints in --checkpoint-dir {checkpoint_dir} are whole: run the same command again to "
                 f"resume from the newest" if checkpoint_dir else "no --checkpoint-dir: a new run starts from step 0")
        return f"stopped by {name} before every rank ended its step; {where}"


def stopped_outside_training(stop, checkpoint_dir, watchdog):
    """For the watchdog's thread: the line and exit code when a stop signal
    came outside training (start-up, or writing the results) and the
    process has not ended within the grace (a rank is stuck there). After
    the last step a roll call decides: when every rank answers, the ranks
    are working (a final evaluation longer than the grace: SLURM's
    --signal=USR1@60 with a large test set), and the run goes on to write
    its results (asked again a grace later); the ranks that do not are the
    stuck ones. Where no roll call can be held, as at start-up, the grace decides."""
    overdue = stop.overdue()
    if overdue is None:
        return None
    name, phase = overdue
    if phase == "start-up":
        return (f"stopped by {name} during start-up, before the first step (a rank is stuck there); "
                f"no new checkpoint: run the same command again to resume from the last one", EXIT_PREEMPTED)
    if watchdog.past_last_barrier():
        return None   # every rank wrote its results and got to the shutdown barrier: nothing is stuck
    silent = watchdog.silent_ranks()
    if silent == []:
        stop.postpone()
        return None
    if watchdog.past_last_barrier(wait=stop.GRACE_S):
        return None   # the silent ranks had left the shutdown barrier: this rank's returned as well
    stuck = (f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} did not answer a roll call"
             if silent else "a rank is stuck there")
    where = (f"the final checkpoint in {checkpoint_dir} is whole: run the same command again "
             f"to write the results" if checkpoint_dir else "no --checkpoint-dir: the results are lost")
    return f"stopped by {name} after the last step, while the results were written ({stuck}); {where}", \
        EXIT_PREEMPTED
