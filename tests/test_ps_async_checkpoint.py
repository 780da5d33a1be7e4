"""Async ps with two servers checkpoints (issue 19, section 3.1): the
periodic checkpoints and the one after a stop signal are written although
the servers' versions differ, and the same command resumes from them.

    .venv/bin/python -m pytest -q tests/test_ps_async_checkpoint.py

The job runs under tests/faults/inject_ps.py for its probes only (no fault):
PROBE_CUTS records every cut the chief takes; HELD_AFTER_STEP holds the chief
after its first checkpoint past that step until the signal (sent to mpirun
once that checkpoint is on disk) reached it, so the job stops there at any
speed and a short run leaves the stop room before its last step.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import MPIRUN, OPEN_MPI, REPO, checkpoint_path, checkpoint_steps, only_checkpoints, under_mpirun
from hpctrain.run.cluster import child_env
from hpctrain.base.errors import EXIT_PREEMPTED

TESTS = os.path.dirname(os.path.abspath(__file__))
FAULTS = os.path.join(TESTS, "faults")
STEPS = 400
HELD_AFTER = 50

pytestmark = pytest.mark.skipif(under_mpirun(), reason="launches its own mpirun jobs: runs in the plain pytest pass")


def launch(args, env):
    cmd = [MPIRUN, "-n", "4", sys.executable, "-m", "inject_ps", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=dict(child_env(), PYTHONPATH=os.pathsep.join([FAULTS, TESTS]), **env))


def run_and_signal(args, env, ckpt, sig, timeout=120):
    """The job, and `sig` to mpirun (MPICH's hydra forwards it to every rank)
    once a checkpoint past HELD_AFTER is written (the chief waits there for it)."""
    p = launch(args, dict(env, HELD_AFTER_STEP=str(HELD_AFTER)))
    deadline = time.monotonic() + timeout
    try:
        while p.poll() is None and time.monotonic() < deadline:
            if any(step > HELD_AFTER for step in checkpoint_steps(ckpt)):
                p.send_signal(sig)
                break
            time.sleep(0.005)
        out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return p.returncode, out, err


def test_async_two_servers_checkpoint_periodically_and_on_a_signal_and_resume(tmp_path):
    ckpt, cuts, metrics = tmp_path / "ckpt", tmp_path / "cuts.jsonl", tmp_path / "m.jsonl"
    args = ["--mode", "ps", "--num-ps", 2, "--async", "--hidden", 64, "--steps", STEPS, "--log-every", 1000,
            "--checkpoint-dir", ckpt, "--checkpoint-every", 50, "--keep-checkpoints", 1000, "--metrics", metrics]
    env = {"PROBE_CUTS": str(cuts)}
    # Open MPI's mpirun turns SIGTERM into killing the ranks; it relays USR1.
    sig = signal.SIGUSR1 if OPEN_MPI else signal.SIGTERM
    rc, out, err = run_and_signal(args, env, ckpt, sig)
    assert rc == EXIT_PREEMPTED, (rc, out[-2000:], err[-3000:])
    lines = [line for line in err.splitlines() if line.startswith("hpctrain: error:")]
    assert len(lines) == 1, err
    m = re.fullmatch(rf"hpctrain: error: stopped by {sig.name} after step (\d+); checkpoint (\S+); "
                     r"run the same command again to resume", lines[0])
    assert m, lines[0]
    step = int(m.group(1))
    assert 0 < step < STEPS and m.group(2) == str(checkpoint_path(ckpt, step))
    # Every cut the chief took is a checkpoint, the stop's (the final state) included.
    records = [json.loads(line) for line in cuts.read_text().splitlines()]
    assert records[-1]["kind"] == "final" and records[-1]["versions"][0] == step
    assert {rec['versions'][0] for rec in records} == set(checkpoint_steps(ckpt)) and only_checkpoints(ckpt)
    assert "not written" not in out

    done = subprocess.run([MPIRUN, "-n", "4", sys.executable, "-m", "hpctrain.mnist", *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=child_env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert f"resumed from {checkpoint_path(ckpt, step)} at step {step}" in done.stdout
    final = json.loads(metrics.read_text().splitlines()[-1])
    assert final["event"] == "final" and final["steps"] == STEPS
    assert STEPS in checkpoint_steps(ckpt)
