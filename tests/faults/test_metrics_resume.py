"""Faults: --metrics across a pre-emption and a resume. The file is live
(appended and flushed per record); a resumed run keeps the records up to its
checkpoint and drops what came after (and an earlier final record), so the
file ends with every logged step once, in order, and one final record.

    .venv/bin/python -m pytest tests/faults/test_metrics_resume.py
"""
import json
import os
import signal
import sys

import pytest

FAULTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(FAULTS))
from conftest import checkpoint_path, remove_checkpoint  # noqa: E402
from test_checkpoint import run_and_signal  # noqa: E402  (tests/ is on the path)

from hpctrain.base.errors import EXIT_PREEMPTED  # noqa: E402


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_each_step_once(path, steps, every):
    recs = records(path)
    finals = [r for r in recs if r.get("event") == "final"]
    assert len(finals) == 1 and recs[-1] is finals[0] and finals[0]["steps"] == steps, recs[-3:]
    logged = [r["step"] for r in recs[:-1]]
    assert all("event" not in r for r in recs[:-1]), recs
    assert logged == sorted(set(logged)), logged      # in order, no duplicates
    assert set(range(every, steps + 1, every)) <= set(logged), logged   # no gaps
    return logged


@pytest.mark.parametrize("mode", ["ring", "ps"])
def test_rerun_to_more_steps_and_after_a_killed_run(job, tmp_path, mode):
    n = 2 if mode == "ring" else 3
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    flags = ["--mode", mode, "--hidden", "64", "--log-every", "10", "--metrics", metrics,
             "--checkpoint-dir", ckpt, "--checkpoint-every", "10", "--optimizer", "sgd"]
    metrics.write_text('{"step": 999, "loss": 1.0}\n')   # another run's: a fresh run starts the file anew
    r = job(n, "--steps", "30", *flags, timeout=120)
    assert r.returncode == 0, r.stderr
    assert assert_each_step_once(metrics, 30, 10) == [10, 20, 30]

    # Run on to 50 steps: resumed at 30, the old final record goes.
    r = job(n, "--steps", "50", *flags, timeout=120)
    assert r.returncode == 0 and "at step 30" in r.stdout, r.stderr
    assert assert_each_step_once(metrics, 50, 10) == [10, 20, 30, 40, 50]

    # As if killed after step 50 with its last checkpoint at 40 and a record
    # half-written: resumed at 40, records past it and the torn line dropped.
    remove_checkpoint(checkpoint_path(ckpt, 50))
    with open(metrics, "a") as f:
        f.write('{"step": 60, "loss"')
    r = job(n, "--steps", "60", *flags, timeout=120)
    assert r.returncode == 0 and "at step 40" in r.stdout, r.stderr
    assert [s for s in r.stderr.splitlines() if s.strip()] == []
    assert assert_each_step_once(metrics, 60, 10) == [10, 20, 30, 40, 50, 60]
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "m.jsonl"]


def test_ring_stopped_by_sigterm_and_resumed(tmp_path):
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    # Rank 0 waits for the signal after the first checkpoint (run_and_signal):
    # the run stops after step 51 at any speed, so 100 steps, not 3000 of
    # margin for a signal that landed anywhere (most of the test's time).
    # A checkpoint every 50 steps, records every 10.
    steps = 100
    flags = ["--steps", steps, "--hidden", "64", "--log-every", "10", "--metrics", metrics,
             "--checkpoint-dir", ckpt, "--checkpoint-every", "50"]
    r = run_and_signal(2, signal.SIGTERM, ckpt, 0, *flags, timeout=120)
    assert r.returncode == EXIT_PREEMPTED, (r.returncode, r.stderr)
    stopped = [line for line in r.stderr.splitlines() if line.startswith("hpctrain: error: stopped by SIGTERM")]
    assert len(stopped) == 1, r.stderr
    at = int(stopped[0].split("after step ")[1].split(";")[0])
    logged = [rec["step"] for rec in records(metrics)]
    assert logged == list(range(10, at + 1, 10))   # live: everything up to the stop is there already

    r = run_and_signal(2, signal.SIGTERM, ckpt, steps, *flags, timeout=240)   # runs to the end
    assert r.returncode == 0, r.stderr
    assert assert_each_step_once(metrics, steps, 10) == list(range(10, steps + 1, 10))
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "m.jsonl"]
