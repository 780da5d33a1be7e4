"""Faults in a pipeline: a stage that stops mid-training ends the whole job
within --timeout with one line naming its rank (exit 3), never a hang of the
stages waiting for its activations or gradients; SIGTERM on one stage's rank
stops every rank after the same step (exit 75; no checkpoints yet).

    .venv/bin/python -m pytest -q tests/faults/test_pipeline_stall.py
"""
import os
import signal
import subprocess

from conftest import MPIRUN, REPO
from hpctrain.cluster import child_env
from ranks import rank_pid
from test_stalls import PY, errors, stall


def test_a_stopped_stage_is_named_within_the_deadline(job):
    rc, out, err, took = stall(3, 1, ["--pipeline-stages", "3", "--micro-batches", "2", "--hidden", "64,32",
                                      "--steps", "1000000", "--log-every", "1000000", "--timeout", "4"],
                               after_s=3.0)
    assert rc == 3, err
    lines = errors(err)
    assert len(lines) == 1, err
    assert lines[0].startswith("hpctrain: error: rank 1 stopped responding"), lines
    assert took < 40


def test_sigterm_on_one_stage_stops_every_stage_after_the_same_step(job):
    proc = subprocess.Popen([MPIRUN, "-n", "2", *PY, "--pipeline-stages", "2", "--micro-batches", "2",
                             "--hidden", "64,32", "--steps", "1000000", "--log-every", "50", "--timeout", "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=REPO)
    try:
        pid = rank_pid(proc, 1)
        assert pid, "rank 1 not found"
        while not proc.stdout.readline().startswith("step "):   # training has begun
            assert proc.poll() is None, proc.stderr.read()
        os.kill(pid, signal.SIGTERM)   # the last stage's rank alone
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err
    lines = errors(err)
    assert len(lines) == 1 and "SIGTERM" in lines[0] and "no checkpoint written" in lines[0], err
    assert "stopping after step" in out, out
