"""Faults: flags that used to end in a traceback (or a hang) are one line and
exit 2 on the whole job, before anything is trained or written.

    .venv/bin/python -m pytest tests/faults/test_bad_flags.py
"""
import os
import time

import pytest


@pytest.mark.parametrize("flags, expect", [
    (["--lr", "inf"], "argument --lr: must be a finite number, got inf"),
    (["--lr", "nan"], "argument --lr: must be a finite number, got nan"),
    (["--momentum=-inf"], "argument --momentum: must be a finite number, got -inf"),
    (["--fusion-mb", "inf"], "argument --fusion-mb: must be a finite number, got inf"),
    (["--dc-lambda", "nan"], "argument --dc-lambda: must be a finite number, got nan"),
    (["--timeout", "inf"], "argument --timeout: must be a finite number, got inf"),
    (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["--clip-norm", "nan"], "argument --clip-norm: must be a finite number, got nan"),
    (["--clip-norm", "0"], "argument --clip-norm: must be > 0, got 0"),
    (["--batch-size", "10000000"], "--batch-size 10000000 needs at least"),
    (["--hidden", "100000,100000"], "--hidden 100000,100000 with --batch-size 32 needs at least"),
])
def test_bad_flag_is_one_line_and_exit_2(job, tmp_path, flags, expect):
    t0 = time.monotonic()
    r = job(2, "--steps", "5", *flags, "--save", tmp_path / "p.h5", "--metrics", tmp_path / "m.jsonl",
            timeout=60)
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("hpctrain: error: ") and expect in lines[0], lines
    assert time.monotonic() - t0 < 60 and os.listdir(tmp_path) == []
