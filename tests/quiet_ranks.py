"""pytest hooks for the MPI test pass: only rank 0's report on the terminal.

Under `mpirun -n N python -m mpi4py -m pytest --only-mpi tests`, every rank
runs pytest and printed its own header, dots, summary and pytest-mpi's
"MPI Information" section (20 lines), N times over, interleaved. With these
hooks (imported by tests/conftest.py) ranks other than 0 write their report to
a temporary file instead, and print it, under a line naming the rank, only
when their pytest fails: a failure on any rank is still shown, and still
fails the job (the rank's exit status is untouched). Outside an MPI job of
more than one rank nothing changes.
"""
import sys
import tempfile

import pytest

from hpctrain.base.launcher import in_mpi_job, launcher_env

_report = {}  # "file": the rank's report; "status": its pytest's exit status


def _quiet_rank():
    """This process's rank when it is not rank 0 of a multi-rank job, else None."""
    rank = launcher_env()[0]
    return rank if in_mpi_job() and rank else None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # The terminal reporter takes sys.stdout as its file when it is made, in
    # the terminal plugin's pytest_configure, after this one.
    rank = _quiet_rank()
    if rank is not None:
        _report.update(file=tempfile.TemporaryFile("w+", prefix=f"pytest-rank{rank}-"),
                       rank=rank, stdout=sys.stdout)
        sys.stdout = _report["file"]


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    _give_back_stdout()


def _give_back_stdout():
    if "stdout" in _report:
        sys.stdout = _report.pop("stdout")


def pytest_sessionfinish(session, exitstatus):
    _report["status"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    # After the terminal summary (written when the session finishes).
    _give_back_stdout()  # still ours if pytest stopped before its session began
    log = _report.pop("file", None)
    if log is None:
        return
    status = _report.pop("status", None)  # None: it stopped before its session ended
    if status != 0:
        log.seek(0)
        how = f"exited {status}" if status is not None else "stopped before its session ended"
        sys.stderr.write(f"==== rank {_report['rank']}: pytest {how}; its report ====\n{log.read()}")
        sys.stderr.flush()
    log.close()
