"""Tests against a real single-node SLURM brought up on this machine.

Run: ``.venv/bin/python -m pytest -q tests/test_slurm.py`` (as root; the first
run installs slurmctld/slurmd/slurm-client/munge with apt-get, ~10 s).

The module-scoped fixture ``slurm`` runs ``tests/slurm/slurm_up.sh`` once and,
if it was the one that started SLURM, ``tests/slurm/slurm_down.sh`` at the end
(``HPCTRAIN_SLURM_KEEP=1`` leaves it running for the next session). That
SLURM is one per machine (one ``/etc/slurm``, SLURM's ports on this host), so
test sessions of two checkouts take turns on it: the fixture holds a lock
(``/tmp/hpctrain-slurm.lock``) from before ``slurm_up.sh`` to after
``slurm_down.sh``, and waits up to 30 minutes for another session's. The whole
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
``sbatch --parsable --output=FILE --chdir=<repo> [sbatch_args] script args...``,
follows the job with scontrol until it ends (asked every 0.1 s at first, at
most every 1 s later) and returns ``(returncode,
output_text)``: the job's exit code (scontrol's ExitCode; 128 + N for a job
ended by signal N) and the job's combined stdout/stderr, or sbatch's own
message when the submission is rejected. ``script`` is a path, or the text of
a script (starting with ``#!``), which is written to a file first. ``env`` adds
variables to the submitting environment (sbatch exports it to the job);
``HPCTRAIN_PYTHON`` is always set to the python running the tests, and
``PMI_*``/``OMPI_*``/``SLURM_*``-style launcher variables are dropped. A job still
running at ``timeout`` is cancelled and the test fails with its output so far.
Not ``sbatch --wait``: it polls every 2 s (``MinJobAge=5``), a second lost per
job on average, and across a requeue it can return early (below).

The job-script tests below submit the real ``jobs/ring.slurm`` and
``jobs/ps.slurm`` (see ``jobs/README.md``): training to >= 0.92 accuracy, the
world-size check, the mpirun launcher, a crash that is not requeued (every node
answers the script's probe), and kill-and-resume (signal, checkpoint,
requeue or resubmission, bit-exact final parameters). About 80 s on 2 idle cores.

The python running pytest is the one the jobs use (``.venv`` for ``make test``,
``.venv-openmpi`` for ``make test-openmpi``); the MPICH and Open MPI tests
skip themselves under the other MPI. Open MPI's ``srun --mpi=pmix`` needs
SLURM's PMIx plugin to find ``libpmix.so``: ``HPCTRAIN_SLURM_PMIX=1`` makes
``slurm_up.sh`` install it (Debian's ``libpmix-dev``).

Other attributes: ``slurm.repo``, ``slurm.python`` (the tests' python),
``slurm.workdir`` (job scripts and outputs), ``slurm.statedir`` (daemon logs),
``slurm.cmd(*argv, timeout=30)`` -> ``CompletedProcess`` for squeue/scontrol/...
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import pytest

from conftest import checkpoint_steps, checkpoints, into_the_next_second, under_mpirun
from hpctrain.run.cluster import child_env
from machine_lock import take_turn

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parent.parent
SLURM_DIR = REPO / "tests" / "slurm"
VENV_PY = Path(sys.executable)
# Which MPI the jobs run on: the PyPI wheels put these next to the python.
OPEN_MPI = (VENV_PY.parent / "ompi_info").exists()
needs_mpich = pytest.mark.skipif(OPEN_MPI, reason="MPICH (pmi2) test; this python's mpi4py uses Open MPI")
needs_open_mpi = pytest.mark.skipif(not OPEN_MPI, reason="Open MPI test (make test-openmpi)")
STATEDIR = Path(os.environ.get("HPCTRAIN_SLURM_STATE", "/tmp/hpctrain-slurm"))
# Fresh machine: apt-get update + install can take minutes on a slow mirror.
UP_TIMEOUT = 900
DOWN_TIMEOUT = 60
# The single-node SLURM is one per machine: sessions of other checkouts take
# turns on it (tests/machine_lock.py), waiting up to this long for theirs.
MACHINE_LOCK = Path("/tmp/hpctrain-slurm.lock")
TURN_WAIT = 1800


def _skip_reason():
    if os.environ.get("HPCTRAIN_SKIP_SLURM") == "1":
        return "HPCTRAIN_SKIP_SLURM=1"
    if under_mpirun():
        return "SLURM tests run in the plain pytest pass, not under an MPI launcher"
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to install and start a single-node SLURM"
    if not shutil.which("sbatch") and not shutil.which("apt-get"):
        return "SLURM is not installed and there is no apt-get to install it"
    return None


_reason = _skip_reason()
if _reason:
    pytest.skip(_reason, allow_module_level=True)


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

    def sbatch(self, script, *args, sbatch_args=(), env=None):
        """sbatch --parsable, the job followed by no one: (CompletedProcess,
        job id or None where the submission was rejected, job name, output file)."""
        name = f"hpctrain-test-{uuid.uuid4().hex[:8]}"
        out = self.workdir / f"{name}.out"
        argv = ["sbatch", "--parsable", f"--job-name={name}", f"--output={out}",
                f"--chdir={self.repo}", *map(str, sbatch_args), str(script),
                *map(str, args)]
        # The job must form its own MPI world under its own allocation: drop
        # launcher variables a surrounding mpirun or SLURM job would leak in.
        full_env = child_env(also=("SLURM_",))
        full_env["HPCTRAIN_PYTHON"] = str(self.python)
        full_env.update(env or {})
        proc = subprocess.run(argv, capture_output=True, text=True, env=full_env, timeout=30)
        job_id = proc.stdout.strip().split(";")[0] if proc.returncode == 0 else None
        return proc, job_id, name, out

    def submit(self, script, *args, sbatch_args=(), env=None, timeout=120):
        if isinstance(script, str) and script.startswith("#!"):
            script = self.script(script)
        proc, job_id, _, out = self.sbatch(script, *args, sbatch_args=sbatch_args, env=env)
        if job_id is None:
            return JobResult(proc.returncode, proc.stdout + proc.stderr)
        rc, text = _wait_until_ended(self, job_id, out, restarts=0, timeout=timeout)
        return JobResult(rc, text + proc.stderr if proc.stderr.strip() else text)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    turn = take_turn(MACHINE_LOCK, TURN_WAIT, what="this machine's single-node SLURM")
    try:
        yield from _slurm_up_and_down(tmp_path_factory)
    finally:
        os.close(turn)


def _slurm_up_and_down(tmp_path_factory):
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


@needs_mpich
def test_srun_pmi2_gives_one_world_of_four(slurm):
    rc, out = slurm.submit(_hello_job("--mpi=pmi2"), timeout=120)
    assert rc == 0, out
    hellos = [(int(r), int(s)) for r, s, _ in HELLO.findall(out)]
    assert sorted(hellos) == [(0, 4), (1, 4), (2, 4), (3, 4)], out
    assert "hello_mpi: world of 4 ranks OK" in out, out


@needs_mpich
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


# ---------------------------------------------------------------------------
# The real job scripts: jobs/ring.slurm and jobs/ps.slurm (see jobs/README.md).
# Each test gives the job its own checkpoint root (HPCTRAIN_CHECKPOINT_ROOT) or
# directory (HPCTRAIN_CHECKPOINT_DIR), so nothing lands in the repository's runs/.

RING_JOB = REPO / "jobs" / "ring.slurm"
PS_JOB = REPO / "jobs" / "ps.slurm"
WORLD_LINE = re.compile(r"^hpctrain: world size (\d+) \(as expected\), 1 host: (\S+) x(\d+); "
                        r"rank -> host/local rank/GPU/pid: (.*)$", re.M)
ACCURACY = re.compile(r"^test accuracy (\d+\.\d+)", re.M)
STOPPED = re.compile(r"stopped by (SIG\w+) after step (\d+); checkpoint (\S+ckpt-\d+);")
RESUMED = re.compile(r"^resumed from (\S+) at step (\d+)$", re.M)
EXPECT_MSG = ("hpctrain: error: expected one MPI world of 4 ranks, got size 1 "
              "(srun without --mpi=pmi2? set HPCTRAIN_SRUN_MPI)")


def _first_hpctrain_line(out):
    lines = [line for line in out.splitlines() if line.startswith("hpctrain:")]
    assert lines, out
    return lines[0]


def _check_world_of_four(out):
    """The job's first hpctrain line: one world of 4, and the rank map."""
    m = WORLD_LINE.match(_first_hpctrain_line(out))
    assert m, out
    assert m.group(1) == "4" and m.group(3) == "4", out
    host = re.escape(m.group(2))
    ranks = m.group(4).split(", ")
    assert len(ranks) == 4, out
    for r, entry in enumerate(ranks):
        # rank -> host/local rank/GPU/pid ("-" without CuPy or a GPU)
        assert re.fullmatch(rf"{r} -> {host}/{r}/(-|\d+)/\d+", entry), out


def _final_metrics(path):
    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    final = [r for r in records if r.get("event") == "final"]
    assert len(final) == 1, records
    return final[0]


def _params(path):
    import h5py
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if hasattr(obj, "shape") else None)
        step = int(f.attrs["step"])
    return step, out


def _assert_same_params(a, b):
    step_a, pa = _params(a)
    step_b, pb = _params(b)
    assert step_a == step_b
    assert sorted(pa) == sorted(pb)
    for name in pa:
        assert pa[name].dtype == pb[name].dtype and pa[name].shape == pb[name].shape, name
        # Bit-exact: resume repeats the very same arithmetic.
        assert pa[name].tobytes() == pb[name].tobytes(), \
            f"{name}: max |diff| {abs(pa[name].astype('f8') - pb[name].astype('f8')).max()}"


@needs_mpich
def test_ring_job_trains_the_sample(slurm, tmp_path):
    # `sbatch jobs/ring.slurm` as is (4 ranks on the one node, 2000 steps), plus
    # a flag passed through to hpctrain.
    metrics = tmp_path / "ring.jsonl"
    rc, out = slurm.submit(RING_JOB, "--metrics", metrics,
                           env={"HPCTRAIN_CHECKPOINT_ROOT": str(tmp_path / "runs")}, timeout=240)
    assert rc == 0, out
    _check_world_of_four(out)
    assert "launch: srun --mpi=pmi2 " in out, out
    acc = [float(a) for a in ACCURACY.findall(out)]
    assert len(acc) == 1 and acc[0] >= 0.92, out
    final = _final_metrics(metrics)
    assert (final["mode"], final["world_size"], final["workers"], final["steps"]) == ("ring", 4, 4, 2000)
    # Checkpoints under <root>/<job name>/, the last one at the end of training.
    [job_dir] = (tmp_path / "runs").glob("hpctrain-test-*")
    assert checkpoint_steps(job_dir)[-1:] == [2000], (os.listdir(job_dir), out)
    assert "hpctrain-job: finished" in out, out


@needs_mpich
def test_ps_job_trains_the_sample(slurm, tmp_path):
    metrics = tmp_path / "ps.jsonl"
    rc, out = slurm.submit(PS_JOB, "--metrics", metrics,
                           env={"HPCTRAIN_CHECKPOINT_ROOT": str(tmp_path / "runs")}, timeout=240)
    assert rc == 0, out
    _check_world_of_four(out)
    assert "--mode ps --num-ps 1" in out, out
    acc = [float(a) for a in ACCURACY.findall(out)]
    assert len(acc) == 1 and acc[0] >= 0.92, out
    final = _final_metrics(metrics)
    assert (final["mode"], final["world_size"], final["workers"], final["steps"]) == ("ps", 4, 3, 2000)


@needs_mpich
def test_job_without_pmi_stops_with_one_clear_line(slurm, tmp_path):
    # srun --mpi=none: MPICH finds no PMI, every task is a world of size 1.
    rc, out = slurm.submit(RING_JOB, "--steps", "5", "--hidden", "8",
                           env={"HPCTRAIN_SRUN_MPI": "none",
                                "HPCTRAIN_CHECKPOINT_ROOT": str(tmp_path / "runs")}, timeout=120)
    assert rc == 2, out
    assert out.count(EXPECT_MSG) == 4, out      # every singleton world says it, once
    assert "test accuracy" not in out, out
    assert "hpctrain-job: hpctrain failed with exit code 2" in out, out
    assert "requeue" not in out, out
    written = [c for d in (tmp_path / "runs").glob("*") for c in checkpoints(d)]
    assert not written, "a singleton world wrote a checkpoint"


@needs_mpich
def test_a_run_that_crashes_with_every_node_alive_is_not_requeued(slurm, tmp_path):
    # The job script asks every node whether one was lost after a failure it
    # cannot explain (jobs/launch.sh); here every rank dies of SIGKILL mid-run
    # (a crash, not a lost node): the node answers, and the job ends with the
    # launcher's status, not requeued (a crash requeued would crash again,
    # HPCTRAIN_MAX_REQUEUES times).
    model = tmp_path / "dies.py"
    model.write_text("import os, signal\nfrom hpctrain.nn import Dense, Flatten, Layer\n\n\n"
                     "class Dies(Layer):\n    keeps_output = False\n    calls = 0\n\n"
                     "    def forward(self, ctx, x, train):\n        Dies.calls += 1\n"
                     "        if Dies.calls > 6:\n            os.kill(os.getpid(), signal.SIGKILL)\n"
                     "        return x * 1\n\n    def backward(self, ctx, dy, need_dx):\n        return dy\n\n\n"
                     "def build(shape, classes):\n    return [Flatten(), Dense(16), Dies(), Dense(classes)]\n")
    rc, out = slurm.submit(RING_JOB, "--steps", "200", "--model", f"{model}:build",
                           env={"HPCTRAIN_CHECKPOINT_ROOT": str(tmp_path / "runs")}, timeout=120)
    assert rc == 128 + 9, out
    assert "hpctrain-job: srun exited 137; every node of the job answers: no node was lost" in out, out
    assert "hpctrain-job: hpctrain failed with exit code 137" in out and "requeue" not in out, out


@needs_mpich
def test_ring_job_with_mpirun_launcher(slurm, tmp_path_factory):
    # The uninterrupted ring job the kill tests compare with runs under the
    # mpirun launcher: one job for both (the suite's time).
    _, out = _reference(slurm, "ring", tmp_path_factory)
    _check_world_of_four(out)
    assert re.search(r"launch: \S*mpirun -n 4 ", out), out
    assert "hpctrain-job: finished" in out, out


@needs_open_mpi
def test_ring_job_on_open_mpi_with_srun_pmix(slurm, tmp_path):
    # jobs/env.sh finds Open MPI next to the python and launches with
    # srun --mpi=pmix and PMIX_MCA_psec=native: one world of 4, no PMIx noise.
    metrics = tmp_path / "ring.jsonl"
    rc, out = slurm.submit(RING_JOB, "--steps", "50", "--hidden", "32", "--metrics", metrics,
                           env={"HPCTRAIN_CHECKPOINT_ROOT": str(tmp_path / "runs")}, timeout=120)
    assert rc == 0, out
    assert (f"hpctrain-job: MPI: Open MPI (ompi_info next to {VENV_PY}) -> "
            "srun --mpi=pmix, PMIX_MCA_psec=native") in out, out
    assert "launch: srun --mpi=pmix " in out, out
    _check_world_of_four(out)
    final = _final_metrics(metrics)
    assert (final["mode"], final["world_size"], final["steps"]) == ("ring", 4, 50)
    assert "hpctrain-job: finished" in out, out
    rest = "\n".join(line for line in out.splitlines() if not line.startswith("hpctrain-job: MPI:"))
    for noise in ("psec", "munge", "help file", "PMIX ERROR", "-----"):
        assert noise not in rest, out

# ---- kill and resume -------------------------------------------------------------
# These jobs are submitted without --wait and followed with scontrol: across a
# requeue, `sbatch --wait` can return early (it polls every 2 s and sometimes
# catches the job between its runs, then exits 1).

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY"}


def _submit_nowait(slurm, script, *args, env):
    """sbatch, not followed; returns (job id, job name, output file)."""
    proc, job_id, name, out = slurm.sbatch(script, *args, env=env)
    assert job_id is not None, proc.stdout + proc.stderr
    return job_id, name, out


def _output(out):
    return out.read_text(errors="replace") if out.exists() else "(no output file yet)"


def _wait_for(what, predicate, timeout, job_id=None, slurm=None, out=None, most=0.1):
    """predicate()'s first true value, asked every 0.1 s at first, then
    every 1.5 times longer up to `most` s (each scontrol is a process: a
    job of minutes asked every 0.1 s took cores from the job it waited for)."""
    deadline = time.monotonic() + timeout
    pause = 0.1
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(pause)
        pause = min(most, pause * 1.5)
    if job_id and slurm:
        slurm.cmd("scancel", job_id, timeout=15)
    pytest.fail(f"gave up waiting for {what} after {timeout} s"
                + (f" (job {job_id} cancelled)" if job_id else "")
                + (f"; job output so far:\n{_output(out)}" if out is not None else ""))


def _job_info(slurm, job_id):
    """(state, restarts, exit code) from scontrol; (None, None, None) once it is gone.
    The exit code: 128 + N for a job ended by signal N (ExitCode=0:N)."""
    show = slurm.cmd("scontrol", "show", "job", "-o", job_id).stdout
    state = re.search(r"\bJobState=(\S+)", show)
    restarts = re.search(r"\bRestarts=(\d+)", show)
    code = re.search(r"\bExitCode=(\d+):(\d+)", show)
    if not state:
        return None, None, None
    status, signal_number = int(code.group(1)), int(code.group(2))
    return state.group(1), int(restarts.group(1)), status or (128 + signal_number if signal_number else 0)


def _wait_until_ended(slurm, job_id, out, restarts, timeout):
    """The job's exit code, once its run number `restarts` has ended for good."""
    def ended():
        state, n, code = _job_info(slurm, job_id)
        return (code,) if state in TERMINAL and n == restarts else None
    return _wait_for(f"job {job_id} to end", ended, timeout, job_id, slurm, out, most=1.0)[0], _output(out)


def _interrupt_mid_run(slurm, script, flags, ckpt_dir, extra_env, scancel_args):
    """Submit script with flags, wait for its first periodic checkpoint, then
    send the signal with scancel. Returns (job id, job name, output file)."""
    env = {"HPCTRAIN_CHECKPOINT_DIR": str(ckpt_dir), **extra_env}
    job_id, name, out = _submit_nowait(slurm, script, *flags, env=env)
    _wait_for("the first checkpoint", lambda: checkpoints(ckpt_dir), 120, job_id, slurm, out)
    sent = slurm.cmd("scancel", *scancel_args, job_id)
    assert sent.returncode == 0, sent.stderr
    return job_id, name, out


def _check_stopped_and_resumed(out, signal_name, ckpt_dir):
    stopped = STOPPED.search(out)
    assert stopped, f"the job was not stopped by the signal (finished first?):\n{out}"
    assert stopped.group(1) == signal_name, out
    step = int(stopped.group(2))
    assert Path(stopped.group(3)).parent == ckpt_dir, out
    resumed = RESUMED.search(out)
    assert resumed, out
    assert (resumed.group(1), int(resumed.group(2))) == (stopped.group(3), step), out
    return step


# Long enough that the signal lands mid-run after the first periodic
# checkpoint (180 steps of ring after it, 380 of ps, whose steps are about
# twice as fast), short enough for CI: the first checkpoint comes early.
KILL_FLAGS = {
    "ring": ("--steps", "200", "--checkpoint-every", "20"),
    "ps": ("--steps", "400", "--checkpoint-every", "20"),
}
_REFERENCE = {}


def _reference(slurm, mode, tmp_path_factory):
    """(--save file, output) of an uninterrupted run of the same job
    (computed once per mode). Ring's runs under the mpirun launcher
    (HPCTRAIN_LAUNCHER=mpirun; test_ring_job_with_mpirun_launcher checks its
    output), the interrupted ones under srun: the launcher changes no bit."""
    if mode not in _REFERENCE:
        d = tmp_path_factory.mktemp(f"ref-{mode}")
        script = RING_JOB if mode == "ring" else PS_JOB
        env = {"HPCTRAIN_CHECKPOINT_DIR": str(d / "ckpt")}
        if mode == "ring":
            env["HPCTRAIN_LAUNCHER"] = "mpirun"
        rc, out = slurm.submit(script, *KILL_FLAGS[mode], "--save", d / "ref.h5", env=env, timeout=180)
        assert rc == 0, out
        assert "stopped by" not in out, out
        _REFERENCE[mode] = (d / "ref.h5", out)
    return _REFERENCE[mode]


def _kill_and_resume(slurm, tmp_path, tmp_path_factory, mode, how):
    """Run the job, stop it mid-run with a signal, let it continue (requeue or
    resubmission), and compare the final parameters with an uninterrupted run's.

    how = "requeue": `scancel --signal=TERM` signals the job step, so srun's
    tasks get SIGTERM directly (as on pre-emption); they stop after the same
    step, the chief checkpoints, all exit 75, and the job script requeues the
    job (same id, restart 1), which resumes from the checkpoint.
    how = "resubmit": `scancel --batch --signal=USR1` signals only the batch
    shell (what --signal=B:USR1@120 does before the time limit), which
    forwards it through srun to the ranks; with HPCTRAIN_MAX_REQUEUES=0 the
    job ends with 75, and submitting the same job again continues it.
    """
    ref, _ = _reference(slurm, mode, tmp_path_factory)
    script = RING_JOB if mode == "ring" else PS_JOB
    ckpt = tmp_path / "ckpt"
    resumed_h5 = tmp_path / "resumed.h5"
    flags = (*KILL_FLAGS[mode], "--save", resumed_h5)
    steps = int(KILL_FLAGS[mode][1])
    if how == "requeue":
        job_id, name, out_file = _interrupt_mid_run(slurm, script, flags, ckpt, {}, ["--signal=TERM"])
        # SLURM holds a requeued job ~2 min (BeginTime) before it may start
        # again; let it start now.
        _wait_for("the requeued job", lambda: _job_info(slurm, job_id)[:2] == ("PENDING", 1), 120,
                  job_id, slurm, out_file)
        # Not within the second the first run ended in (conftest.into_the_next_second).
        into_the_next_second()
        up = slurm.cmd("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        assert up.returncode == 0, up.stderr
        rc, out = _wait_until_ended(slurm, job_id, out_file, restarts=1, timeout=180)
        assert rc == 0, out
        assert f"requeueing job {job_id} (restart 1 of at most 10)" in out, out
        assert f"job {job_id} '{name}' run 2 (restart 1)" in out, out
        step = _check_stopped_and_resumed(out, "SIGTERM", ckpt)
        assert out.count("hpctrain-job: finished") == 1, out
    else:
        no_requeue = {"HPCTRAIN_MAX_REQUEUES": "0"}
        job_id, _, out_file = _interrupt_mid_run(slurm, script, flags, ckpt, no_requeue,
                                                 ["--batch", "--signal=USR1"])
        rc, first = _wait_until_ended(slurm, job_id, out_file, restarts=0, timeout=120)
        assert rc == 75, first
        assert "hpctrain-job: got SIGUSR1" in first, first
        assert "not requeued" in first and "Resubmit with the same job name to continue" in first, first
        assert not resumed_h5.exists(), first
        rc, second = slurm.submit(script, *flags, env={"HPCTRAIN_CHECKPOINT_DIR": str(ckpt), **no_requeue},
                                  timeout=180)
        assert rc == 0, second
        assert "requeue" not in second, second
        out = first + second
        step = _check_stopped_and_resumed(out, "SIGUSR1", ckpt)
    assert 0 < step < steps, out
    _assert_same_params(resumed_h5, ref)


@needs_mpich
def test_ring_job_killed_requeues_itself_and_ends_where_an_uninterrupted_run_ends(
        slurm, tmp_path, tmp_path_factory):
    _kill_and_resume(slurm, tmp_path, tmp_path_factory, "ring", "requeue")


@needs_mpich
def test_ring_job_stopped_before_time_limit_resubmitted_ends_where_an_uninterrupted_run_ends(
        slurm, tmp_path, tmp_path_factory):
    _kill_and_resume(slurm, tmp_path, tmp_path_factory, "ring", "resubmit")


@needs_mpich
def test_ps_job_killed_requeues_itself_and_ends_where_an_uninterrupted_run_ends(
        slurm, tmp_path, tmp_path_factory):
    _kill_and_resume(slurm, tmp_path, tmp_path_factory, "ps", "requeue")
