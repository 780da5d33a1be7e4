"""Shared test helpers: run hpctrain under the venv's mpirun as a real job.

Plain `pytest` runs the serial tests and the tests that launch their own
mpirun jobs; `mpirun -n N python -m mpi4py -m pytest --only-mpi`
runs the tests marked @pytest.mark.mpi on N ranks (pytest-mpi).
"""
import os
import subprocess
import sys

import pytest

from hpctrain.cluster import child_env, in_mpi_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")


def under_mpirun():
    """True inside an MPI job of more than one rank (the MPI test pass)."""
    return in_mpi_job()


def run_job(n, *args, timeout=240, env=None, cwd=None, module="hpctrain.mnist"):
    """`mpirun -n n python -m hpctrain.mnist args...`; returns CompletedProcess
    with text stdout/stderr. A job that outlives `timeout` fails the test."""
    cmd = [MPIRUN, "-n", str(n), sys.executable, "-m", module, *map(str, args)]
    full_env = child_env()  # never let a nested job join the test runner's world
    full_env.update(env or {})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=cwd or REPO)


@pytest.fixture
def job():
    if under_mpirun():
        pytest.skip("launches its own mpirun jobs: runs in the plain pytest pass")
    return run_job
