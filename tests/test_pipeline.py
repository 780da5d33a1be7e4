"""--pipeline-stages P --micro-batches M: the layers cut into P stages on P x R
ranks end with the parameters of --accumulate-steps M on R ranks, bit for
bit (both schedules, even and uneven cuts, R = 1 and 2, an MLP and a CNN with
dropout); under SGD M = 1, 2, 4 agree within 1e-6; flags a pipeline cannot run
with are one line, exit 2, on the whole job.

    .venv/bin/python -m pytest -q tests/test_pipeline.py
"""
import json
import os

import numpy as np
import pytest

from conftest import REPO, saved, same_bytes

TINY = os.path.join(REPO, "tests", "models", "tiny_cnn.py")
MLP = ["--hidden", "64,32,16"]   # Flatten, then Dense/ReLU x 3, Dense: 8 layers, 4 with parameters
SHORT = ["--steps", "6", "--batch-size", "8", "--log-every", "3"]


def ok(r):
    assert r.returncode == 0, r.stderr
    return r


@pytest.mark.parametrize("ranks, flags, expect", [
    (3, ["--pipeline-stages", "2"], "--pipeline-stages 2 does not divide the 3 ranks"),
    (3, ["--pipeline-stages", "3", "--hidden", "64"], "the model has 2 layers with parameters"),
    (2, ["--pipeline-stages", "2", "--pipeline-split", "9"], "cut points must be layer indices in 1..7"),
    (3, ["--pipeline-stages", "3", "--pipeline-split", "6,2"], "cut points must increase"),
    (2, ["--pipeline-stages", "2", "--pipeline-split", "1"], "stage 0 (layers 0..0) has no layer with parameters"),
    (2, ["--pipeline-stages", "2", "--pipeline-split", "2,4"], "2 stages need 1 cut points, got 2"),
    (3, ["--pipeline-stages", "2", "--mode", "ps"], "--pipeline-stages is for --mode ring"),
    (2, ["--pipeline-stages", "2", "--accumulate-steps", "2"], "use --micro-batches M instead"),
    (2, ["--pipeline-stages", "2", "--checkpoint-dir", "CKPT"], "does not work with --checkpoint-dir"),
    (2, ["--micro-batches", "2"], "--micro-batches needs --pipeline-stages P > 1"),
], ids=["p-not-dividing", "more-stages-than-layers", "cut-out-of-range", "cuts-not-increasing",
        "stage-without-parameters", "too-many-cuts", "ps-mode", "accumulate", "checkpoints", "micro-alone"])
def test_bad_pipeline_flags_are_one_line_exit_2(job, tmp_path, ranks, flags, expect):
    flags = [str(tmp_path / "ckpt") if f == "CKPT" else f for f in flags]
    r = job(ranks, *MLP, "--steps", "2", *flags, "--save", tmp_path / "out.h5")
    errors = [line for line in r.stderr.splitlines() if line.startswith("hpctrain: error:")]
    assert r.returncode == 2 and len(errors) == 1 and expect in errors[0], (r.returncode, r.stderr)
    assert not (tmp_path / "out.h5").exists() and not (tmp_path / "ckpt").exists()
