"""jobs/launch.sh without SLURM: the job script run by hand with the
variables a SLURM batch job has (SLURM_JOB_ID, SLURM_NTASKS), the venv's
mpirun as the launcher (HPCTRAIN_LAUNCHER=mpirun). What needs a real
scheduler (requeue, srun, signals from slurmctld) is in tests/test_slurm.py.

    .venv/bin/python -m pytest -q tests/test_launch_script.py
"""
import json
import os
import signal
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


def test_a_rank_that_hangs_after_mpi_finalize_is_ended_by_the_job_script(tmp_path):
    # Issue 19, 2: rank 1 stops itself after MPI_Finalize (tests/faults/slow_ranks.py),
    # where no watchdog of the job can see it: rank 0 exits 0 and mpirun waits
    # for rank 1 forever. launch.sh waits --timeout + 10 s after the chief's
    # final record (HPCTRAIN_FINISHED_FILE), then ends the launcher, one line, exit 3.
    python = tmp_path / "python"   # the job's python, running the fault launcher
    python.write_text(f'#!/bin/sh\n[ "$1 $2" = "-m hpctrain.mnist" ] && shift 2 && set -- -m slow_ranks "$@"\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    pids, metrics = tmp_path / "pids", tmp_path / "m.jsonl"
    pids.mkdir()
    env = batch_env(tmp_path, HPCTRAIN_PYTHON=str(python),
                    HPCTRAIN_MPIRUN=os.path.join(os.path.dirname(sys.executable), "mpirun"),
                    PYTHONPATH=os.path.join(REPO, "tests", "faults"), FAULT_FINAL_STOP="1", FAULT_PID_DIR=str(pids))
    proc = subprocess.Popen(["bash", LAUNCH, "--steps", "20", "--hidden", "16", "--timeout", "3",
                             "--metrics", str(metrics)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids.iterdir():
            try:
                os.kill(int(pid.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    assert proc.returncode == 3, (out, err)
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("hpctrain-job: error: hpctrain's chief wrote its final record "
                                                   "(the results are written)"), err
    assert "mpirun has not ended: a rank hangs on its way out; killed the job step (--timeout 3 + 10 s)" in lines[0]
    assert json.loads(metrics.read_text().splitlines()[-1])["event"] == "final"
    assert not list((tmp_path / "runs" / "fake").glob(".finished-*"))
