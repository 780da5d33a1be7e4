"""Tests against a real single-node SLURM brought up on this machine.

Run: ``.venv/bin/python -m pytest -q tests/test_slurm.py`` (as root; the first
run installs slurmctld/slurmd/slurm-client/munge with apt-get, ~10 s).

The module-scoped fixture ``slurm`` runs ``tests/slurm/slurm_up.sh`` once and,
if it was the one that started SLURM, ``tests/slurm/slurm_down.sh`` at the end
(``HPCTRAIN_SLURM_KEEP=1`` leaves it running for the next session). The whole
module is skipped, with the reason, when: ``HPCTRAIN_SKIP_SLURM=1``; not root;
neither ``sbatch`` nor ``apt-get`` exists; it runs under an MPI launcher
(``make test`` runs it in the plain pytest pass only); or ``slurm_up.sh`` could
not install the packages or found a SLURM config it did not write.

The node ``$(hostname -s)`` advertises 4 CPUs (``HPCTRAIN_SLURM_CPUS``) in
partition ``debug``; MPI programs must be launched with ``srun --mpi=pmi2``.

Reusing the fixture (e.g. for ``jobs/ring.slurm``)::

    def test_ring_job(slurm):
        rc, out = slurm.submit(slurm.repo / "jobs" / "ring.slurm", "--steps", "20",
                               sbatch_args=["--ntasks=4"], env={"DATA": "/tmp/d"},
                               timeout=300)
        assert rc == 0, out

``slurm.submit(script, *args, sbatch_args=(), env=None, timeout=120)`` runs
``sbatch --wait --output=FILE --chdir=<repo> [sbatch_args] script args...`` and
returns ``(returncode, output_text)``: the job's exit code (as sbatch --wait
reports it) and the job's combined stdout/stderr, or sbatch's own message when
the submission is rejected. ``script`` is a path, or the text of a script
(starting with ``#!``), which is written to a file first. ``env`` adds
variables to the submitting environment (sbatch exports it to the job);
``HPCTRAIN_PYTHON`` is always set to the repo's ``.venv`` python, and
``PMI_*``/``OMPI_*``/``SLURM_*``-style launcher variables are dropped. A job still
running at ``timeout`` is cancelled and the test fails with its output so far.
``sbatch --wait`` polls every 2 s (``MinJobAge=5``), so a job costs >= 2 s.

Other attributes: ``slurm.repo``, ``slurm.python`` (``.venv/bin/python``),
``slurm.workdir`` (job scripts and outputs), ``slurm.statedir`` (daemon logs),
``slurm.cmd(*argv, timeout=30)`` -> ``CompletedProcess`` for squeue/scontrol/...
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import NamedTuple

import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parent.parent
SLURM_DIR = REPO / "tests" / "slurm"
VENV_PY = REPO / ".venv" / "bin" / "python"
STATEDIR = Path(os.environ.get("HPCTRAIN_SLURM_STATE", "/tmp/hpctrain-slurm"))
# Fresh machine: apt-get update + install can take minutes on a slow mirror.
UP_TIMEOUT = 900
DOWN_TIMEOUT = 60


def _under_mpi_launcher():
    env = os.environ
    if "PMI_RANK" in env or "PMIX_RANK" in env:
        return True
    for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS"):
        try:
            if int(env.get(key, "1")) > 1:
                return True
        except ValueError:
            pass
    # Only look at mpi4py if it is already loaded: importing it here would
    # initialize MPI in the plain pytest pass for no reason.
    mpi = sys.modules.get("mpi4py.MPI")
    return bool(mpi and mpi.Is_initialized() and mpi.COMM_WORLD.Get_size() > 1)


def _skip_reason():
    if os.environ.get("HPCTRAIN_SKIP_SLURM") == "1":
        return "HPCTRAIN_SKIP_SLURM=1"
    if _under_mpi_launcher():
        return "SLURM tests run in the plain pytest pass, not under an MPI launcher"
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to install and start a single-node SLURM"
    if not shutil.which("sbatch") and not shutil.which("apt-get"):
        return "SLURM is not installed and there is no apt-get to install it"
    if not VENV_PY.exists():
        return f"no {VENV_PY} (run make test-serial first)"
    return None


_reason = _skip_reason()
if _reason:
    pytest.skip(_reason, allow_module_level=True)


_LAUNCHER_VARS = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPI_LOCAL", "SLURM_")


class JobResult(NamedTuple):
    returncode: int
    output: str


class Slurm:
    """Handle on the running test SLURM; see the module docstring."""

    def __init__(self, workdir, statedir):
        self.repo = REPO
        self.python = VENV_PY
        self.workdir = Path(workdir)
        self.statedir = Path(statedir)

    def cmd(self, *argv, timeout=30, env=None):
        return subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                              timeout=timeout, env=env)

    def script(self, text, name=None):
        path = self.workdir / (name or f"job-{uuid.uuid4().hex[:8]}.sh")
        path.write_text(text)
        path.chmod(0o755)
        return path

    def submit(self, script, *args, sbatch_args=(), env=None, timeout=120):
        if isinstance(script, str) and script.startswith("#!"):
            script = self.script(script)
        name = f"hpctrain-test-{uuid.uuid4().hex[:8]}"
        out = self.workdir / f"{name}.out"
        argv = ["sbatch", "--wait", f"--job-name={name}", f"--output={out}",
                f"--chdir={self.repo}", *map(str, sbatch_args), str(script),
                *map(str, args)]
        # The job must form its own MPI world under its own allocation: drop
        # launcher variables a surrounding mpirun or SLURM job would leak in.
        full_env = {k: v for k, v in os.environ.items()
                    if not k.startswith(_LAUNCHER_VARS)}
        full_env["HPCTRAIN_PYTHON"] = str(self.python)
        full_env.update(env or {})
        try:
            proc = subprocess.run(argv, capture_output=True, text=True,
                                  timeout=timeout, env=full_env)
        except subprocess.TimeoutExpired:
            self.cmd("scancel", f"--name={name}", timeout=15)
            so_far = out.read_text(errors="replace") if out.exists() else "(no output file)"
            pytest.fail(f"job {name} ({script}) still not finished after {timeout} s; "
                        f"cancelled. Output so far:\n{so_far}")
        if out.exists():
            text = out.read_text(errors="replace")
            if proc.stderr.strip():
                text += proc.stderr
        else:
            text = proc.stdout + proc.stderr
        return JobResult(proc.returncode, text)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    up = subprocess.run([str(SLURM_DIR / "slurm_up.sh"), str(STATEDIR)],
                        capture_output=True, text=True, timeout=UP_TIMEOUT)
    said = (up.stdout + up.stderr).strip()
    last = said.splitlines()[-1] if said else "(no output)"
    if up.returncode in (2, 3, 4):  # not root / cannot install / foreign SLURM config
        pytest.skip(f"cannot bring up SLURM here: {last}")
    if up.returncode != 0:
        pytest.fail(f"slurm_up.sh exited {up.returncode}:\n{said}")
    started_here = "already up" not in up.stdout
    yield Slurm(tmp_path_factory.mktemp("slurm"), STATEDIR)
    if started_here and os.environ.get("HPCTRAIN_SLURM_KEEP") != "1":
        down = subprocess.run([str(SLURM_DIR / "slurm_down.sh"), str(STATEDIR)],
                              capture_output=True, text=True, timeout=DOWN_TIMEOUT)
        assert down.returncode == 0, f"slurm_down.sh failed:\n{down.stdout}{down.stderr}"


HELLO = re.compile(r"^hello rank (\d+) of (\d+) on (\S+)$", re.M)


def _hello_job(srun_flags):
    return (
        "#!/bin/bash\n"
        "#SBATCH --ntasks=4 --nodes=1 --time=5\n"
        f"srun {srun_flags} {shlex.quote(str(VENV_PY))} tests/slurm/hello_mpi.py 4\n"
    )


def test_srun_pmi2_gives_one_world_of_four(slurm):
    rc, out = slurm.submit(_hello_job("--mpi=pmi2"), timeout=120)
    assert rc == 0, out
    hellos = [(int(r), int(s)) for r, s, _ in HELLO.findall(out)]
    assert sorted(hellos) == [(0, 4), (1, 4), (2, 4), (3, 4)], out
    assert "hello_mpi: world of 4 ranks OK" in out, out


def test_srun_without_pmi2_is_caught(slurm):
    # MpiDefault=none: no PMI for MPICH, so each task is its own singleton world.
    rc, out = slurm.submit(_hello_job(""), timeout=120)
    assert rc != 0, out
    hellos = [(int(r), int(s)) for r, s, _ in HELLO.findall(out)]
    assert hellos == [(0, 1)] * 4, out
    msg = "expected one MPI world of 4 ranks, got size 1 (srun without --mpi=pmi2?)"
    assert out.count(msg) == 4, out


def test_impossible_job_is_rejected_at_submission(slurm):
    # EnforcePartLimits=ALL: rejected by sbatch at once, never left pending.
    rc, out = slurm.submit(_hello_job("--mpi=pmi2"), sbatch_args=["--ntasks=64"], timeout=30)
    assert rc != 0, out
    assert "Batch job submission failed" in out, out
    queue = slurm.cmd("squeue", "-h", "-o", "%i %j %T")
    assert queue.returncode == 0, queue.stderr
    assert "hpctrain-test-" not in queue.stdout, queue.stdout
