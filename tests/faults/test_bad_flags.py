"""Faults: flags that used to end in a traceback (or a hang) are one line and
exit 2 on the whole job, before anything is trained or written.

    .venv/bin/python -m pytest tests/faults/test_bad_flags.py
"""
import os
import time

import pytest

from hpctrain.base.errors import HpctrainError
from hpctrain.flags import cli


# Refused by the parser (flags/cli.py), the same on every rank before any
# rank trains: all of them in-process below, one of each kind of check (a
# number, a path, a flag argparse does not know) on the whole job as well.
PARSED = [
    (["--lr", "inf"], "argument --lr: must be a finite number, got inf"),
    (["--lr", "nan"], "argument --lr: must be a finite number, got nan"),
    (["--momentum=-inf"], "argument --momentum: must be a finite number, got -inf"),
    (["--fusion-mb", "inf"], "argument --fusion-mb: must be a finite number, got inf"),
    (["--dc-lambda", "nan"], "argument --dc-lambda: must be a finite number, got nan"),
    (["--timeout", "inf"], "argument --timeout: must be a finite number, got inf"),
    (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["--clip-norm", "nan"], "argument --clip-norm: must be a finite number, got nan"),
    (["--clip-norm", "0"], "argument --clip-norm: must be > 0, got 0"),
    # An empty path was taken for "not given": the run ended with no file, exit 0.
    (["--keep-best", "", "--eval-every", "2"], "argument --keep-best: expected a path, got ''"),
    (["--save", ""], "argument --save: expected a path, got ''"),
    (["--checkpoint-dir", " "], "argument --checkpoint-dir: expected a path, got ' '"),
    (["--steps", "10000000000000"], "argument --steps: must be at most 1,000,000,000,000, got 10000000000000"),
    # issue 41, 30: prefix matching took it as --epochs 3 (here "not allowed with --steps"; alone, 3 epochs)
    (["--epoch", "3"], "unrecognized arguments: --epoch 3; did you mean --epochs? (see --help)"),
]
ON_THE_JOB = [PARSED[0], PARSED[9], PARSED[-1]]   # --lr inf, --keep-best '', --epoch 3


@pytest.mark.parametrize("flags, expect", PARSED)
def test_bad_flag_is_refused_by_the_parser_in_one_line(tmp_path, capsys, flags, expect):
    with pytest.raises(HpctrainError) as refused:
        cli.parse(["--steps", "5", *flags, "--save", str(tmp_path / "p.h5"), "--metrics", str(tmp_path / "m.jsonl")])
    assert expect in str(refused.value) and "\n" not in str(refused.value)
    assert capsys.readouterr() == ("", "") and os.listdir(tmp_path) == []


# Refused at start-up, once the world and the data are known (the memory
# check, a step against the training samples): on the whole job alone.
AT_START_UP = [
    (["--batch-size", "10000000"], "--batch-size 10000000 needs at least"),
    (["--hidden", "100000,100000"], "--hidden 100000,100000 with --batch-size 32 needs at least"),
    # issue 27, 14: a step bigger than an epoch dealt the samples over and over, in silence
    (["--accumulate-steps", "1000000", "--steps", "1"], "4,500 training samples, fewer than one step takes (2 "
                                                        "workers x --batch-size 32 x --accumulate-steps 1000000 = "
                                                        "64,000,000); use a smaller --batch-size, --accumulate-steps"),
    (["--pipeline-stages", "2", "--micro-batches", "5", "--batch-size", "1000"],
     "4,500 training samples, fewer than one step takes (1 worker x --batch-size 1000 x --micro-batches 5 = 5,000)"),
]


@pytest.mark.parametrize("flags, expect", [*ON_THE_JOB, *AT_START_UP])
def test_bad_flag_is_one_line_and_exit_2(job, tmp_path, flags, expect):
    t0 = time.monotonic()
    r = job(2, "--steps", "5", *flags, "--save", tmp_path / "p.h5", "--metrics", tmp_path / "m.jsonl",
            timeout=60)
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("hpctrain: error: ") and expect in lines[0], lines
    assert time.monotonic() - t0 < 60 and os.listdir(tmp_path) == []


def test_epochs_past_any_meaning_is_one_line(job, tmp_path):
    # --epochs 1e300 was 7e303 steps, accepted.
    r = job(2, "--epochs", "1e300", "--save", tmp_path / "p.h5", timeout=60)
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert r.returncode == 2 and lines == [
        "hpctrain: error: argument --epochs: must be at most 1,000,000 passes over the data, "
        "got 1e300 (a long run: --steps N) (see --help)"], r.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("flags, expect", [
    (["--lr-min", "0.001"], "--lr-min 0.001 has no effect without --lr-schedule cosine"),
    (["--lr-decay-steps", "100"], "--lr-decay-steps 100 has no effect without --lr-schedule step"),
    (["--lr-schedule", "cosine", "--lr-decay", "0.5"], "--lr-decay 0.5 has no effect without --lr-schedule step"),
    (["--warmup-steps", "50"], "--warmup-steps 50 is longer than the run (5 steps): the learning rate "
                               "never reaches --lr 0.0001"),
    (["--hidden", ""], "--hidden gives no layer widths: the model is linear"),
])
def test_doubtful_setting_is_one_warning_and_the_run_goes_on(job, tmp_path, flags, expect):
    # Each was accepted without a word (or silently ignored).
    r = job(2, "--steps", "5", "--hidden", "16", *flags, "--save", tmp_path / "p.h5", timeout=60)
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert r.returncode == 0 and len(lines) == 1, r.stderr
    assert lines[0].startswith("hpctrain: warning: ") and expect in lines[0], lines
    assert os.listdir(tmp_path) == ["p.h5"]
