"""The one mapping from a source file's open/read errors to HpctrainError
lines, shared by the readers of raw data files (idx.py, cifar.py). (The
stop signals that `fetch` and `prepare` turn into an exception, so that
what they were writing is removed, are errors.signals_raise's: the one way
every one-process command takes a stop signal.)

    with file_errors(path, "an IDX file"):
        with open(path, "rb") as f: ...

No MPI here (house rule).
"""
from contextlib import contextmanager

from hpctrain.base.errors import HpctrainError


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


