"""Faults: temporary files that killed runs left behind are swept at the next
start (only our own names, only when their writer is gone); a running job's
are left alone.

    .venv/bin/python -m pytest tests/faults/test_temp_files.py
"""
import os
import subprocess
import time

from conftest import checkpoint_steps, only_checkpoints


def test_leftovers_of_killed_runs_are_swept_and_a_running_writers_kept(job, tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "out" / "ckpt"
    ckpt.mkdir(parents=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    running = subprocess.Popen(["sleep", "120"])
    try:
        stale = [out / f".p.h5.tmp-{gone.pid}-abcdefgh", out / f"m.jsonl.tmp-{gone.pid}",
                 ckpt / f".ckpt-00000010.h5.tmp-{gone.pid}"]
        kept = [out / f".p.h5.tmp-{running.pid}-abcdefgh", out / "notes.txt"]
        old = time.time() - 600
        for path in stale + kept:
            path.write_bytes(b"half a file")
            os.utime(path, (old, old))
        r = job(2, "--steps", "20", "--hidden", "64", "--log-every", "10", "--save", out / "p.h5",
                "--metrics", out / "m.jsonl", "--checkpoint-dir", ckpt, "--checkpoint-every", "10", timeout=120)
        assert r.returncode == 0, r.stderr
        assert [s for s in r.stderr.splitlines() if s.strip()] == []
        assert sorted(os.listdir(out)) == sorted(["ckpt", "m.jsonl", "p.h5", "notes.txt", kept[0].name])
        assert checkpoint_steps(ckpt) == [10, 20] and only_checkpoints(ckpt), os.listdir(ckpt)
    finally:
        running.kill()
        running.wait()
