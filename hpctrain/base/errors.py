"""The one exception type users see, and the exit codes scripts rely on.

A HpctrainError is printed as one line (`hpctrain: error: ...`) with no
traceback; its exit code tells a job script what happened:

    0    done: the final record and --save written
    1    a bug: an uncaught exception, its traceback printed, the job aborted
    2    bad input: a flag, file, data, output or cluster layout (one line,
         nothing trained or written)
    3    a rank waited longer than --timeout (from before MPI_Init to
         MPI_Finalize); a roll call names the rank that stopped responding.
         Before MPI is up there is no MPI_Abort: the rank that says it
         exits 3 and the launcher ends the rest, and MPICH's mpirun may then
         report 9 (the SIGKILL of the rank it ended) in its place
    4    the loss became inf/nan (diverged): no checkpoint of those
         parameters; job scripts do not requeue it
    75   pre-empted (SIGTERM/SIGUSR1): a checkpoint written after the same
         step on every rank; requeue, and the same command resumes (EX_TEMPFAIL)
    130  interrupted (Ctrl-C, SIGINT): stopped at once without a new
         checkpoint; the checkpoints and metrics records written before are
         whole, temporary files removed (128 + SIGINT, as shells report it)

Training takes SIGHUP (a closed terminal, a dropped ssh session) as it takes
SIGTERM: a checkpoint, then 75 (run/stop_signal.py); `data prepare` too
(its temporary folder removed, 75; Ctrl-C 130). The one-process commands
(evaluate, predict, generate, checkpoint, plot, data fetch, bench's
launcher) stop on SIGINT, SIGTERM and SIGHUP with one line
(`hpctrain: error: evaluate stopped by SIGTERM`), their temporary files
removed, and exit 128 + the signal, as shells report it: 130 for Ctrl-C,
143 for SIGTERM, 129 for SIGHUP (`stops_as_errors`, through
`one_line_errors`). A signal the caller ignores (nohup's SIGHUP, a
background job's SIGINT) stays ignored.
"""
import contextlib
import functools
import signal
import sys
import threading

EXIT_FAILURE = 1      # a bug: uncaught exception, traceback printed
EXIT_BAD_INPUT = 2    # bad flag, file, data or cluster layout
EXIT_TIMEOUT = 3      # a blocking wait passed --timeout; the message names the peer
EXIT_DIVERGED = 4     # the loss or the parameters became inf/nan: no checkpoint of them, no requeue
EXIT_PREEMPTED = 75   # SIGTERM/SIGUSR1: checkpoint written, requeue and --resume
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT): stopped at once, no new checkpoint (128 + SIGINT, as shells do)


class HpctrainError(Exception):
    """An error the user can act on; `str(e)` is the whole message, one line."""

    exit_code = EXIT_BAD_INPUT
    # collective: every rank raised it at the same point, so all can simply
    # exit; otherwise the job must be aborted or the other ranks would hang.
    collective = False
    # report: this rank prints the message (one line per job, not per rank).
    report = True

    # detail: text the reporting rank prints above the line (a user's own
    # traceback, when their model file raised), or None.
    detail = None

    def __init__(self, message, exit_code=None, collective=False, report=True, detail=None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
        self.collective = collective
        self.report = report
        self.detail = detail


def one_line_errors(main):
    """A command's main(argv, ...) that returns its exit code, with a
    HpctrainError it raises printed as its one line (`hpctrain: error: ...`,
    on standard error) and its exit code returned, and the stop signals
    made one such line too (stops_as_errors): the single-process commands'
    error tail, written once (train has its own: ranks agree)."""
    command = _command_name(main)

    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            with stops_as_errors(command):
                return main(*args, **kwargs)
        except HpctrainError as e:
            print(f"hpctrain: error: {e}", file=sys.stderr)
            return e.exit_code
    return run


def _command_name(main):
    """main's command: hpctrain.evaluate -> evaluate, hpctrain.data.__main__
    -> data; run as `python -m hpctrain.evaluate` too, where its module is
    __main__ (the spec keeps the name)."""
    spec = getattr(sys.modules.get(main.__module__), "__spec__", None)
    module = spec.name if spec is not None else main.__module__
    return module.removeprefix("hpctrain.").removesuffix(".__main__")


# The signals that stop a command: Ctrl-C, a job scheduler's or `kill`'s
# SIGTERM, and SIGHUP (a closed terminal, a dropped ssh session), whose
# default actions end the process with no `finally` run.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(HpctrainError):
    """A one-process command stopped by a signal: 128 + the signal, as shells report it."""

    def __init__(self, command, signum):
        name = signal.Signals(signum).name
        super().__init__(f"{command} stopped by {name}{' (Ctrl-C)' if signum == signal.SIGINT else ''}",
                         exit_code=128 + signum)
        self.command, self.signum = command, signum


@contextlib.contextmanager
def stops_as_errors(command, signals=STOP_SIGNALS):
    """The stop signals raise Stopped inside the block (signals_raise), so
    that every `finally` removes what was being written and the command
    ends with one line, not a KeyboardInterrupt traceback or a silent
    death. A stop raised inside a finaliser or weakref callback (the
    garbage collector runs them at any moment; h5py has them), where
    Python only prints the exception and goes on, is delivered again to the
    main flow 50 ms later, once that callback has returned (as train.py's
    Ctrl-C is)."""
    hook = sys.unraisablehook

    def unraisable(what):
        if isinstance(what.exc_value, Stopped):
            import _thread
            rearm()
            later = threading.Timer(0.05, _thread.interrupt_main, args=(what.exc_value.signum,))
            later.daemon = True
            later.start()
            return
        hook(what)

    with signals_raise(functools.partial(Stopped, command), signals) as rearm:
        sys.unraisablehook = unraisable
        try:
            yield
        finally:
            sys.unraisablehook = hook


@contextlib.contextmanager
def signals_raise(stopped, signals=STOP_SIGNALS):
    """The signals raise stopped(signum), an HpctrainError, inside the block,
    so that every `finally` and `except` runs and removes what was being
    written (their default action ends the process with nothing run). A
    second signal is ignored: it must not cut that removal short, and so is
    one the caller ignores (nohup, a shell's background job and Ctrl-C).
    Yields rearm(): the handlers set again (a stop to be delivered anew).
    Only the main thread can set handlers; elsewhere the caller's own
    handling stands."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    signals = [sig for sig in signals if signal.getsignal(sig) is not signal.SIG_IGN]

    def stop(num, frame):
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
        raise stopped(num)

    def rearm():
        for sig in signals:
            signal.signal(sig, stop)

    before = {sig: signal.signal(sig, stop) for sig in signals}
    try:
        yield rearm
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
