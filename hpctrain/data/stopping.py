"""A `prepare` stopped by a signal, or killed: a stop signal raised as a
one-line stop inside prepare (its `except` then removes the temporary
folder), the renames that install the shards held from stops, and the
temporary folders of killed prepares (SIGKILL, a crashed node) swept once
their process is gone, as training sweeps its files (hpctrain/base/files.py).

    python -c "from hpctrain.data.stopping import stops_cleanly"

No MPI here (house rule).
"""
import contextlib
import contextvars
import functools
import os
import re
import shutil
import signal
import stat
import sys
import threading

from hpctrain.base.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, HpctrainError, signals_raise
from hpctrain.base.files import abandoned, process_start_time


# SLURM's pre-emption and time-limit signals, a closed terminal's (SIGHUP:
# like SIGTERM, else its default action leaves the temporary folder), and Ctrl-C
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT)


def _stopped(num):
    """A stopped prepare's line; its exit code as errors.py gives it (130
    for Ctrl-C; 75 for SLURM's stops and SIGHUP: requeued, the same command
    redoes it)."""
    return HpctrainError(f"prepare stopped by {signal.Signals(num).name}: nothing written (--out as it was, "
                         f"the temporary folder removed); run the same command again",
                         exit_code=EXIT_INTERRUPTED if num == signal.SIGINT else EXIT_PREEMPTED)


# The stops a running prepare raised (stops_cleanly), for signals_held to see.
_STOPS = contextvars.ContextVar("hpctrain_prepare_stops", default=())


def stops_cleanly(prepare):
    """prepare, a stop signal raising _stopped inside it (errors.signals_raise),
    so that its `except` removes the temporary folder (SIGTERM's default
    action left it for ever). A handler that runs inside a __del__ or a
    weakref callback (h5py's, while shards are written) raises where Python
    only reports the exception and goes on: that report is kept quiet (the
    stop stays one line), and signals_held raises the stop again before
    anything is installed."""
    @functools.wraps(prepare)
    def stoppable(*args, **kwargs):
        stops = []

        def stopped(num):
            stops.append(_stopped(num))
            return stops[-1]

        previous = sys.unraisablehook

        def unraisable(what):
            if not any(what.exc_value is e for e in stops):
                previous(what)
        token, sys.unraisablehook = _STOPS.set(stops), unraisable
        try:
            with signals_raise(stopped, STOP_SIGNALS):
                return prepare(*args, **kwargs)
        finally:
            _STOPS.reset(token)
            sys.unraisablehook = previous
    return stoppable


def _tmp_pattern(out):
    """prepare._tmp_name's names for out: .NAME.tmp-PID-RANDOM (the pid: whose it is)."""
    return re.compile(rf"^\.{re.escape(out.name)}\.tmp-(?P<pid>\d+)-[0-9a-f]{{8}}$")


def sweep_stale_tmps(out, log):
    """Remove the temporary folders that killed prepares of out left beside
    it (SIGKILL, a node's crash): only folders of prepare's names, last
    changed before this process started, whose process is gone
    (files.abandoned, as training sweeps its files)."""
    pattern, started = _tmp_pattern(out), process_start_time()
    try:
        names = os.listdir(out.parent)
    except OSError:
        return
    for name in names:
        m = pattern.match(name)
        if m and abandoned(out.parent / name, int(m.group("pid")), started, kind=stat.S_ISDIR):
            shutil.rmtree(out.parent / name, ignore_errors=True)
            log(f"removed {out.parent / name}: left by an earlier prepare (process {m.group('pid')}, gone)")


@contextlib.contextmanager
def signals_held():
    """Installing is a few renames that must not be cut in two (out moved
    aside, the new one not yet in place): a stop signal that comes while
    they run is dropped, as training drops a stop after its last step: the
    shards are then in place, there is nothing left to stop. (Not by
    blocking the signals: that is per thread, and numpy's BLAS threads would
    still take SIGTERM's default action.) Only the main thread can set
    handlers; elsewhere the caller's own handling stands."""
    stops = _STOPS.get()
    if stops:   # a stop whose exception Python swallowed (stops_cleanly): install nothing
        raise stops[0]
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, _dropped) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _dropped(num, frame):
    pass
