"""jobs/launch.sh without SLURM: the job script run by hand with the
variables a SLURM batch job has (SLURM_JOB_ID, SLURM_NTASKS), the venv's
mpirun as the launcher (HPCTRAIN_LAUNCHER=mpirun). What needs a real
scheduler (requeue, srun, signals from slurmctld) is in tests/test_slurm.py.

    .venv/bin/python -m pytest -q tests/test_launch_script.py
"""
import os
import subprocess
import sys

import pytest

from conftest import REPO, under_mpirun
from hpctrain.cluster import child_env

LAUNCH = os.path.join(REPO, "jobs", "launch.sh")


def batch_env(tmp_path, **extra):
    """A batch job's environment as far as launch.sh reads it, and nothing of
    a surrounding SLURM job or MPI launcher."""
    env = child_env(also=("SLURM_",))
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NAME="fake", SLURM_NTASKS="2", SLURM_SUBMIT_DIR=str(tmp_path),
               HPCTRAIN_LAUNCHER="mpirun", HPCTRAIN_MPI="mpich", HPCTRAIN_PYTHON=sys.executable,
               HPCTRAIN_CHECKPOINT_ROOT=str(tmp_path / "runs"))
    env.update(extra)
    return env


@pytest.fixture(autouse=True)
def plain_pass():
    if under_mpirun():
        pytest.skip("runs launch.sh and its own mpirun: plain pytest pass")


@pytest.mark.parametrize("value", ["ten", "-1", "1.5", " 3"])
def test_a_requeue_limit_that_is_not_a_number_is_one_line_before_anything_runs(tmp_path, value):
    r = subprocess.run(["bash", LAUNCH, "--steps", "5"], capture_output=True, text=True, timeout=60,
                       env=batch_env(tmp_path, HPCTRAIN_MAX_REQUEUES=value), cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.splitlines() == [f"hpctrain-job: error: HPCTRAIN_MAX_REQUEUES={value}: expected a whole "
                                     f"number of requeues (0: never)"], r.stderr
    assert "launch:" not in r.stdout
