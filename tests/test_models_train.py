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

from conftest import REPO, checkpoint_path, remove_checkpoint, same_bytes, saved

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
    ckpt = tmp_path / "ckpt"
    stopped = [*flags, "--checkpoint-dir", ckpt, "--checkpoint-every", "10", "--save", tmp_path / "resumed.h5"]
    # the run through writes the checkpoints the resume starts from (one job, not two)
    ok(job(ranks, *stopped[:-1], tmp_path / "through.h5"))
    remove_checkpoint(checkpoint_path(ckpt, 20))
    r = ok(job(ranks, *stopped))
    assert "at step 10" in r.stdout, r.stdout
    assert same_bytes(tmp_path / "through.h5", tmp_path / "resumed.h5")
    names = saved(tmp_path / "resumed.h5")
    assert any(k.endswith("running_mean") for k in names)   # the statistics are saved beside the parameters


def test_a_cifar_shaped_file_trains_the_cnn_and_a_dense_only_model_is_refused_on_it(job, tmp_path):
    """CIFAR-10 cannot be downloaded here: a file in its binary format,
    written by the test, proves the path (32x32x3 HWC shards -> Channels ->
    the zoo's cnn, sized from the image shape)."""
    from hpctrain import data
    from test_datasets import cifar_batches
    src = cifar_batches(tmp_path / "cifar", per_batch=40, batches=2, test=20)
    data.prepare(src, tmp_path / "shards", shards=2, log=lambda *a, **k: None)
    r = ok(job(2, "--model", "cnn", "--data", tmp_path / "shards", "--steps", "4", "--log-every", "2",
               "--batch-size", "8", "--save", tmp_path / "p.h5"))
    assert "input 32x32x3" in r.stdout and "test accuracy" in r.stdout, r.stdout
    mine = tmp_path / "dense.py"
    mine.write_text("from hpctrain.nn import Dense\n\ndef build(shape, classes):\n    return [Dense(classes)]\n")
    r = job(2, "--model", f"{mine}:build", "--data", tmp_path / "shards", "--steps", "4", timeout=60)
    assert r.returncode == 2 and "gives 32x32x10 outputs per sample, the data has 10 classes: put Flatten()" in r.stderr, r.stderr


def test_a_cnn_that_cannot_fit_is_refused_up_front(job, tmp_path):
    """The memory check counts a convolution's activations and im2col columns
    (nn/spec.py memory_bytes), not only the parameters."""
    r = job(2, "--model", "cnn", "--batch-size", "2000000", "--steps", "5", "--save", tmp_path / "p.h5", timeout=60)
    errors = [line for line in r.stderr.splitlines() if line.startswith("hpctrain: error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr
    assert "--model cnn with --batch-size 2000000 needs at least" in errors[0], errors
    assert not (tmp_path / "p.h5").exists()
