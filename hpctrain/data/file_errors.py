"""The one mapping from a source file's open/read errors to HpctrainError
lines, shared by the readers of raw data files (idx.py, cifar.py); and the
stop signals turned into an exception, so that what `fetch` and `prepare`
were writing is removed (signals_raise).

    with file_errors(path, "an IDX file"):
        with open(path, "rb") as f: ...

No MPI here (house rule).
"""
import signal
import threading
from contextlib import contextmanager

from hpctrain.errors import HpctrainError


@contextmanager
def file_errors(path, expected):
    """Turn what opening or reading `path` raises (missing, a directory, no
    permission, any other OSError) into one HpctrainError line; `expected`
    names what the file should have been ("an IDX file")."""
    try:
        yield
    except FileNotFoundError:
        raise HpctrainError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise HpctrainError(f"{path}: is a directory, expected {expected}") from None
    except PermissionError as e:
        raise HpctrainError(f"{path}: cannot read ({e.strerror})") from None
    except OSError as e:
        raise HpctrainError(f"{path}: cannot read ({e.strerror or e})") from None


@contextmanager
def signals_raise(stopped, signals=(signal.SIGTERM, signal.SIGINT)):
    """The signals raise stopped(signum), an HpctrainError, inside the block,
    so that every `finally` and `except` runs and removes what was being
    written (their default action ends the process with nothing run). A
    second signal is ignored: it must not cut that removal short, and so is
    one the caller ignores (nohup, a shell's background job and Ctrl-C).
    Only the main thread can set handlers; elsewhere the caller's own
    handling stands."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = [sig for sig in signals if signal.getsignal(sig) is not signal.SIG_IGN]

    def stop(num, frame):
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
        raise stopped(num)

    before = {sig: signal.signal(sig, stop) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
