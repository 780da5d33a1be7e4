"""The MPI test pass shows rank 0's report, and another rank's only when it
fails (tests/quiet_ranks.py). Runs pytest under `mpirun -n 3` on a small
test file where rank 2 fails; about 5 s on idle cores.
"""
import os
import subprocess
import sys

from conftest import MPIRUN, REPO, under_mpirun
from hpctrain.run.cluster import child_env
import pytest

INNER = '''
import pytest
from mpi4py import MPI


@pytest.mark.mpi
def test_everywhere():
    assert MPI.COMM_WORLD.size == 3


@pytest.mark.mpi
def test_fails_on_rank_2():
    assert MPI.COMM_WORLD.rank != 2, "failed on rank 2 as meant"
'''


@pytest.mark.skipif(under_mpirun(), reason="starts its own mpirun: runs in the plain pytest pass")
def test_only_rank_0_reports_unless_another_rank_fails(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER)
    env = child_env()
    env["PYTHONPATH"] = os.path.join(REPO, "tests")
    # Without `-m mpi4py` (which make test-mpi uses): the failing rank exits
    # rather than calling MPI_Abort, so no rank is killed with its shared
    # memory segment still in /dev/shm.
    proc = subprocess.run([MPIRUN, "-n", "3", sys.executable, "-m", "pytest", "-q",
                           "-p", "no:cacheprovider", "-p", "quiet_ranks", "--only-mpi",
                           "test_inner.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    # rank 0's report and rank 2's (it failed); not rank 1's (it passed)
    assert out.count("MPI Information") == 2, out
    assert "==== rank 2: pytest exited 1; its report ====" in out, out
    assert "==== rank 1" not in out and "==== rank 0" not in out, out
    assert "failed on rank 2 as meant" in out and "2 passed" in out, out
