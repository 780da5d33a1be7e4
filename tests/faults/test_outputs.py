"""Faults: outputs that cannot be written. Checked before the first step, and
a result that still fails to be written at the end is kept somewhere named.

    .venv/bin/python -m pytest tests/faults/test_outputs.py
"""
import json
import os
import time

import h5py
import pytest

FAULTS = os.path.dirname(os.path.abspath(__file__))


def one_error_line(r):
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert len(lines) == 1 and lines[0].startswith("hpctrain: error: "), r.stderr
    return lines[0][len("hpctrain: error: "):]


@pytest.mark.parametrize("case", ["save is a directory", "save in a missing directory",
                                  "save and metrics the same file", "metrics is a directory",
                                  "checkpoint dir is a file", "timeline is the checkpoint dir"])
def test_bad_outputs_fail_before_training(job, tmp_path, case):
    out = tmp_path / "out"
    out.mkdir()
    a_file = out / "file"
    a_file.write_text("kept")
    flags, expect = {
        "save is a directory": (["--save", out], f"--save {out}: is a directory; name a file in it"),
        "save in a missing directory": (["--save", out / "no" / "p.h5"],
                                        f"--save {out / 'no' / 'p.h5'}: directory {out / 'no'} does not exist"),
        "save and metrics the same file": (["--save", out / "x", "--metrics", out / "x"],
                                           f"--metrics and --save both name {out / 'x'}: give each its own file"),
        "metrics is a directory": (["--metrics", out], f"--metrics {out}: is a directory; name a file in it"),
        "checkpoint dir is a file": (["--checkpoint-dir", a_file],
                                     f"--checkpoint-dir {a_file}: exists and is not a directory"),
        "timeline is the checkpoint dir": (["--timeline", out / "c", "--checkpoint-dir", out / "c"],
                                           f"--checkpoint-dir and --timeline both name {out / 'c'}"),
    }[case]
    t0 = time.monotonic()
    # 100000 steps: a run that got past start-up would not end within the timeout.
    r = job(2, "--steps", "100000", *flags, timeout=60)
    assert r.returncode == 2 and one_error_line(r) == expect, r.stderr
    assert time.monotonic() - t0 < 60
    assert "step " not in r.stdout
    assert sorted(os.listdir(out)) == ["file"] and a_file.read_text() == "kept"


@pytest.mark.parametrize("with_checkpoint, mode", [(True, "ring"), (False, "ps")])
def test_save_failing_at_the_end_keeps_the_parameters(job, tmp_path, with_checkpoint, mode):
    save, metrics, ckpt = tmp_path / "p.h5", tmp_path / "m.jsonl", tmp_path / "ckpt"
    rescue_dir = tmp_path / "tmp"
    rescue_dir.mkdir()
    flags = ["--mode", mode, "--steps", "20", "--log-every", "10", "--save", save, "--metrics", metrics]
    if with_checkpoint:
        flags += ["--checkpoint-dir", ckpt]
    env = {"PYTHONPATH": FAULTS, "TMPDIR": str(rescue_dir)}
    r = job(2 if mode == "ring" else 3, *flags, module="disk_full_on_save", env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    line = one_error_line(r)
    failed = f"--save {save}: cannot write (No space left on device); the parameters of step 20 "
    if with_checkpoint:
        kept = ckpt / "ckpt-00000020.h5"
        assert line == failed + f"are in checkpoint {kept}"
        assert os.listdir(rescue_dir) == []
        with h5py.File(kept) as f:
            assert f.attrs["step"] == 20
    else:
        [name] = os.listdir(rescue_dir)
        kept = rescue_dir / name
        assert line == failed + f"are kept in {kept}"
        with h5py.File(kept) as f:
            assert f.attrs["step"] == 20 and f["layer0/W"].shape == (784, 500)
    # The run itself finished: its final record is written, nothing half-written is left.
    final = json.loads(metrics.read_text().splitlines()[-1])
    assert final["event"] == "final" and final["steps"] == 20
    assert sorted(os.listdir(tmp_path)) == sorted(["m.jsonl", "tmp"] + (["ckpt"] if with_checkpoint else []))
