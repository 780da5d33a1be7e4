"""--accumulate-steps K: K micro-batches per optimizer step and one exchange
per step equal one step over the K x B samples (under SGD, up to the
summation order's rounding), in ring and ps mode, with dropout too; the
step counts samples as K x B (--epochs, the final record), a resume is
bit-exact, and a checkpoint of another K is refused with one line.

    .venv/bin/python -m pytest -q tests/test_accumulate.py
"""
import json
import os

import numpy as np
import pytest

from conftest import REPO, checkpoint_path, remove_checkpoint, same_bytes, saved

TINY = os.path.join(REPO, "tests", "models", "tiny_cnn.py")
SGD = ["--optimizer", "sgd", "--lr", "0.05", "--steps", "12", "--log-every", "6"]


def ok(r):
    assert r.returncode == 0, r.stderr
    return r


def max_diff(a, b):
    a, b = saved(a), saved(b)
    assert set(a) == set(b)
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def k3(job, once, model_flags):
    """--save file of 3 micro-batches of 8 a step on the ring at 2 ranks:
    the mlp's launched once for both tests below that compare with it."""
    def make(out):
        ok(job(2, *SGD, *model_flags, "--accumulate-steps", "3", "--batch-size", "8", "--save", out / "k3.h5"))
        return out / "k3.h5"
    return once(("test_accumulate k3", *model_flags), make)


@pytest.mark.parametrize("model", ["mlp", "tiny cnn with dropout"])
def test_k_micro_batches_equal_one_step_over_them(job, once, tmp_path, model):
    model_flags = ["--hidden", "64"] if model == "mlp" else ["--model", f"{TINY}:without_batch_norm"]
    ok(job(2, *SGD, *model_flags, "--batch-size", "24", "--save", tmp_path / "k1.h5"))
    assert max_diff(k3(job, once, model_flags), tmp_path / "k1.h5") < 1e-6


def test_sync_ps_accumulates_as_the_ring_does(job, once, tmp_path):
    ok(job(3, "--mode", "ps", *SGD, "--hidden", "64", "--accumulate-steps", "3", "--batch-size", "8",
           "--save", tmp_path / "ps.h5"))
    assert max_diff(tmp_path / "ps.h5", k3(job, once, ["--hidden", "64"])) < 1e-6


def test_a_step_counts_k_batches_and_resume_is_bit_exact(job, tmp_path):
    flags = ["--hidden", "32", "--accumulate-steps", "2", "--batch-size", "16", "--log-every", "20"]
    r = ok(job(2, *flags, "--epochs", "1", "--metrics", tmp_path / "m.jsonl"))
    final = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    # 4500 training samples at 2 workers x 2 x 16 a step
    assert final["steps"] == 71 and final["global_batch"] == 64, final
    assert "2 workers x 32 = 71 steps" in r.stdout, r.stdout
    flags = [*flags, "--steps", "20"]
    ckpt = ["--checkpoint-dir", tmp_path / "ckpt", "--checkpoint-every", "10", "--save", tmp_path / "resumed.h5"]
    # the run through writes the checkpoints the resume starts from (one job, not two)
    ok(job(2, *flags, *ckpt[:-1], tmp_path / "through.h5"))
    remove_checkpoint(checkpoint_path(tmp_path / "ckpt", 20))
    assert "at step 10" in ok(job(2, *flags, *ckpt)).stdout
    assert same_bytes(tmp_path / "through.h5", tmp_path / "resumed.h5")
    r = job(2, *flags[:-2], "--steps", "30", "--accumulate-steps", "3", *ckpt, timeout=60)
    errors = [line for line in r.stderr.splitlines() if line.startswith("hpctrain: error:")]
    assert r.returncode == 2 and len(errors) == 1 and "--accumulate-steps" in errors[0], r.stderr
