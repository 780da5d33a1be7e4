"""Faults: a /dev/shm too small for MPICH (4-20 MB in a container). Before,
every rank died in MPI_Init of SIGBUS or SIGSEGV with no line of ours; now the
job ends before MPI_Init with one line naming /dev/shm, exit 2.

A private mount namespace (`unshare -m`, as root) gives the job its own small
/dev/shm; where that is not permitted the tests are skipped, saying why.

    .venv/bin/python -m pytest tests/faults/test_small_shm.py
"""
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import MPIRUN, REPO
from hpctrain.run.cluster import child_env, mpich_shm_mb


def in_small_shm(size, command):
    """command (a list) run with its own tmpfs of size at /dev/shm."""
    script = f"mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {shlex.join(command)}"
    return subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                          timeout=120, env=child_env(), cwd=REPO)


@pytest.fixture(scope="module")
def private_mounts():
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) on this machine: cannot give a job its own /dev/shm")
    r = in_small_shm("4m", ["true"])
    if r.returncode != 0:
        pytest.skip(f"unshare -m / mount tmpfs not permitted here: {r.stderr.strip()}")


def test_a_4_mb_dev_shm_is_one_line_before_mpi_init(private_mounts):
    r = in_small_shm("4m", [MPIRUN, "-n", "2", sys.executable, "-m", "hpctrain.mnist",
                            "--steps", "5", "--hidden", "16", "--timeout", "20"])
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("hpctrain: error: /dev/shm on "), lines
    assert f"MB free; MPICH needs about {mpich_shm_mb(2)} MB there for 2 ranks" in lines[0]
    assert "--shm-size" in lines[0] and "step " not in r.stdout


def test_room_enough_trains(private_mounts):
    # The threshold is MPICH's need with margin, not a refusal of small mounts as such.
    size = f"{mpich_shm_mb(2) + 4}m"
    r = in_small_shm(size, [MPIRUN, "-n", "2", sys.executable, "-m", "hpctrain.mnist",
                            "--steps", "5", "--hidden", "16", "--timeout", "20"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "test accuracy" in r.stdout


def test_the_ps_window_line_never_contradicts_itself():
    # Before: 9.3 MB needed and 8.9 MB free both printed as "9 MB".
    from hpctrain.comm.ps.shared import too_little_room
    line = too_little_room(need=9.3 * 2**20, free=8.96 * 2**20)
    assert line.endswith("(9.3 MB with headroom; 8.9 MB free here)"), line
    assert too_little_room(need=2**20 + 1, free=2**20).endswith("(1.1 MB with headroom; 1.0 MB free here)")
