"""Faults in a pipeline: a stage that stops mid-training ends the whole job
within --timeout with one line naming its rank and its coordinates on the
mesh, "rank 3 (pipeline 1, data 1, tensor 0)" (exit 3),
never a hang of the stages waiting for its activations or gradients; SIGTERM
on one stage's rank stops every rank after the same step (exit 75; with a
checkpoint and its resume: tests/test_pipeline_checkpoint.py); the same with
the interleaved schedule's chunks.

    .venv/bin/python -m pytest -q tests/faults/test_pipeline_stall.py
"""
import os
import re
import signal
import subprocess

import pytest

from conftest import MPIRUN, REPO
from hpctrain.run.cluster import child_env
from ranks import rank_pid
from test_stalls import PY, errors, stall


INTERLEAVED = ["--pipeline-schedule", "interleaved", "--hidden", "64,32,16"]   # 2 chunks a stage


@pytest.mark.parametrize("ranks, stages, victim, role, extra", [
    (3, "3", 1, "pipeline 1, data 0, tensor 0", []),
    (4, "2", 3, "pipeline 1, data 1, tensor 0", []),   # R = 2: world rank 3 is stage 1's second replica
    (2, "2", 1, "pipeline 1, data 0, tensor 0", INTERLEAVED),   # stage 0's second chunk waits for stage 1's first
], ids=["p3-middle", "p2r2-last", "p2-interleaved"])
def test_a_stopped_stage_is_named_within_the_deadline(job, ranks, stages, victim, role, extra):
    rc, out, err, took = stall(ranks, victim, ["--pipeline-stages", stages, "--micro-batches", "2", "--hidden", "64,32",
                                               "--steps", "1000000", "--timeout", "4", "--log-every", "1", *extra],
                               in_training=True)
    assert rc == 3, err
    lines = errors(err)
    assert len(lines) == 1, err
    assert lines[0].startswith(f"hpctrain: error: rank {victim} ({role}) stopped responding"), lines
    assert re.search(r"; rank \d \(pipeline \d, data \d, tensor 0\) waited \d+ s for ", lines[0]), lines   # so is the waiter
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


@pytest.mark.parametrize("where, flags", [
    ("eval", ["--eval-every", "3"]),
    ("checkpoint", ["--checkpoint-dir", None, "--checkpoint-every", "3"]),
    ("eval", ["--eval-every", "3", *INTERLEAVED]),
    ("checkpoint", ["--checkpoint-dir", None, "--checkpoint-every", "3", *INTERLEAVED]),
], ids=["evaluation", "checkpoint", "interleaved-evaluation", "interleaved-checkpoint"])
def test_a_stage_stopped_in_a_pipelined_evaluation_or_checkpoint_is_named(tmp_path, where, flags):
    # Issue 29, 5: evaluations run through the stages and checkpoints go a
    # stage at a time: a stage that stops there is named within the deadline.
    # --timeout 3, not 4 (the suite's time), as the other 2-rank stalls (test_stalls.py).
    from test_stalls import with_faults
    flags = [str(tmp_path / "ckpt") if f is None else f for f in flags]
    rc, out, err, took = with_faults(tmp_path, ["--pipeline-stages", "2", "--micro-batches", "2", "--hidden", "32",
                                                "--steps", "30", "--timeout", "3", *flags],
                                     FAULT_STAGE_STOP=f"1:{where}")
    assert rc == 3, err
    lines = errors(err)
    assert len(lines) == 1, err
    assert lines[0].startswith("hpctrain: error: rank 1 (pipeline 1, data 0, tensor 0) stopped responding"), lines
    assert took < 40
