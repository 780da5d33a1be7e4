"""Convolutional models through every distributed path, each held to a
simpler one: N ranks equal one process over the same N*B samples (dropout
included: its masks follow the samples, not the ranks), sync ps equals the
ring, the sharded optimizer equals the unsharded bit for bit, and a run
stopped and resumed ends bit-exactly where an uninterrupted one does, with
dropout and batch norm, in ring and ps mode. The models: tests/models/tiny_cnn.py.

    .venv/bin/python -m pytest -q tests/test_models_train.py
"""
import os

import numpy as np
import pytest

from conftest import REPO, saved, same_bytes

TINY = os.path.join(REPO, "tests", "models", "tiny_cnn.py")
COMMON = ["--steps", "20", "--log-every", "10", "--batch-size", "8"]


def ok(r):
    assert r.returncode == 0, r.stderr
    return r


def test_n_ranks_equal_one_process_over_the_same_samples(job, tmp_path):
    sgd = ["--model", f"{TINY}:without_batch_norm", "--optimizer", "sgd", "--lr", "0.05", "--steps", "20",
           "--log-every", "10"]
    ok(job(2, *sgd, "--batch-size", "8", "--save", tmp_path / "two.h5"))
    ok(job(1, *sgd, "--batch-size", "16", "--save", tmp_path / "one.h5"))
    two, one = saved(tmp_path / "two.h5"), saved(tmp_path / "one.h5")
    assert set(two) == set(one)
    assert max(float(np.abs(two[k] - one[k]).max()) for k in two) < 1e-5


def test_sync_ps_equals_the_ring_for_a_cnn(job, tmp_path):
    sgd = ["--model", f"{TINY}:build", "--optimizer", "sgd", "--lr", "0.05", *COMMON]
    ok(job(3, "--mode", "ps", *sgd, "--save", tmp_path / "ps.h5"))
    ok(job(2, *sgd, "--save", tmp_path / "ring.h5"))
    ps, ring = saved(tmp_path / "ps.h5"), saved(tmp_path / "ring.h5")
    assert set(ps) == set(ring) and any(k.endswith("running_var") for k in ps)
    assert max(float(np.abs(ps[k] - ring[k]).max()) for k in ps) < 1e-5


def test_the_sharded_optimizer_gives_the_bits_of_the_unsharded_for_a_cnn(job, tmp_path):
    for flag in ("off", "on"):
        ok(job(2, "--model", f"{TINY}:build", *COMMON, "--shard-optimizer", flag, "--save", tmp_path / f"{flag}.h5"))
    assert same_bytes(tmp_path / "off.h5", tmp_path / "on.h5")


@pytest.mark.parametrize("mode", ["ring", "ps"])
def test_resume_is_bit_exact_with_dropout_and_batch_norm(job, tmp_path, mode):
    ranks, flags = (2, []) if mode == "ring" else (3, ["--mode", "ps"])
    flags = [*flags, "--model", f"{TINY}:build", *COMMON]
    ok(job(ranks, *flags, "--save", tmp_path / "through.h5"))
    ckpt = tmp_path / "ckpt"
    stopped = [*flags, "--checkpoint-dir", ckpt, "--checkpoint-every", "10", "--save", tmp_path / "resumed.h5"]
    ok(job(ranks, *stopped))
    (ckpt / "ckpt-00000020.h5").unlink()
    r = ok(job(ranks, *stopped))
    assert "at step 10" in r.stdout, r.stdout
    assert same_bytes(tmp_path / "through.h5", tmp_path / "resumed.h5")
    names = saved(tmp_path / "resumed.h5")
    assert any(k.endswith("running_mean") for k in names)   # the statistics are saved beside the parameters
