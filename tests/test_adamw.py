"""nanoGPT's optimizer recipe: --adam-betas, and weight decay on matrices
only (--weight-decay-on matrices|all, a layer's `decays`, nn/spec.py
decay_ranges).

Units: which tensors of an MLP and of the GPT decay, a user's layer that
names a tensor it lacks, an update over part of the buffer against a
float64 reference, the betas a resume compares. Then real mpirun jobs:
SGD decays the weights and leaves the biases alone, sharded equals
unsharded and a pipeline equals accumulation with betas and decay, sync ps
on two servers equals ring, bad betas and a resume with other betas are one
line and exit 2.

    .venv/bin/python -m pytest -q tests/test_adamw.py
"""
import math

import numpy as np
import pytest

from conftest import same_bytes, saved
from hpctrain.nn.layers import ReLU
from hpctrain.nn.layer_errors import LayerCodeError
from hpctrain.nn.linear import Dense
from hpctrain.nn.spec import ModelSpec
from hpctrain.nn.gpt import gpt
from hpctrain.nn.zoo import mlp
from hpctrain.optim.optimizers import make_optimizer

SMALL = ["--hidden", "64", "--log-every", "1000"]


def ok(r):
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def decayed_names(spec):
    return [name for name, lo, hi in spec.tensor_ranges() if any(a <= lo and hi <= b for a, b in spec.decay_ranges)]


# --- which tensors decay --------------------------------------------------------

def test_an_mlp_decays_its_dense_weights_not_its_biases():
    spec = mlp((28, 28), 10, [64, 32])
    assert decayed_names(spec) == ["layer0/W", "layer1/W", "layer2/W"]
    ranges = dict(((name, (lo, hi)) for name, lo, hi in spec.tensor_ranges()))
    assert spec.decay_ranges == (ranges["layer0/W"], ranges["layer1/W"], ranges["layer2/W"])


def test_the_gpt_decays_embedding_and_block_matrices_not_biases_norms_or_positions():
    spec = gpt(65, 16, 2, 2, 8)
    per_block = ["attn.Wqkv", "attn.Wo", "fc.W", "proj.W"]
    assert decayed_names(spec) == ["embedding/E"] + [f"blocks.{k}/{t}" for k in (0, 1) for t in per_block]
    # the tied head's W is the embedding's E: laid out (and decayed) once
    assert sum(hi - lo for lo, hi in spec.decay_ranges) == 65 * 8 + 2 * (8 * 24 + 8 * 8 + 8 * 32 + 32 * 8)
    assert all(a < b <= c for (a, b), (c, _) in zip(spec.decay_ranges, spec.decay_ranges[1:]))


def test_a_layer_that_decays_a_tensor_it_lacks_is_refused_in_one_line():
    class Odd(Dense):
        decays = ("V",)
    with pytest.raises(LayerCodeError,
                       match=r"^layer 2 \(Dense\(4\)\): decays names 'V', not one of its tensors \(W, b\)$"):
        ModelSpec([Dense(8), ReLU(), Odd(4)], (5,), 4)


# --- the update over part of the buffer ------------------------------------------

def adamw_reference(p, grads, lr, wd, betas, decayed):
    """AdamW in float64, decay on the elements where `decayed` (a mask: fine in a test)."""
    b1, b2 = betas
    p = p.astype(np.float64).copy()
    m, v = np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads, 1):
        g = g.astype(np.float64)
        p[decayed] *= 1 - lr * wd
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p -= lr / (1 - b1 ** t) * m / (np.sqrt(v) / math.sqrt(1 - b2 ** t) + 1e-8)
    return p


def test_decay_on_part_of_the_buffer_matches_float64_in_buckets_shards_and_slices():
    rng = np.random.default_rng(3)
    n, betas, wd, lr = 1000, (0.8, 0.95), 0.3, 0.05
    ranges = [(10, 200), (350, 360), (600, 1000)]
    decayed = np.zeros(n, bool)
    for lo, hi in ranges:
        decayed[lo:hi] = True
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
    whole, buckets, shards = (p0.copy() for _ in range(3))
    plain = make_optimizer("adam", n, weight_decay=wd, betas=betas, decay_ranges=ranges)
    cut = make_optimizer("adam", n, weight_decay=wd, betas=betas, decay_ranges=ranges)
    owned = [(100, 355), (500, 800)]   # one rank's shards: its state compact, 555 elements
    sharded = make_optimizer("adam", n, weight_decay=wd, betas=betas, decay_ranges=ranges, owned=owned)
    # a server's or a pipeline stage's buffer: pieces of the model, laid one after another
    pieces = [(600, 700), (0, 355)]
    sliced = np.concatenate([p0[lo:hi] for lo, hi in pieces])
    server = make_optimizer("adam", sliced.size, weight_decay=wd, betas=betas, decay_ranges=ranges, at=pieces)
    for g in grads:
        plain.step(whole, g, lr)
        for opt, p, parts in ((cut, buckets, [(700, 1000), (355, 700), (0, 355)]), (sharded, shards, owned)):
            opt.begin(lr)
            for lo, hi in parts:
                opt.update(p, g, lo, hi)
        server.step(sliced, np.concatenate([g[lo:hi] for lo, hi in pieces]), lr)
    np.testing.assert_allclose(whole, adamw_reference(p0, grads, lr, wd, betas, decayed), rtol=1e-5, atol=1e-6)
    assert whole.tobytes() == buckets.tobytes()
    for lo, hi in owned:
        assert shards[lo:hi].tobytes() == whole[lo:hi].tobytes()
    assert sliced.tobytes() == np.concatenate([whole[lo:hi] for lo, hi in pieces]).tobytes()


# --- jobs -----------------------------------------------------------------------

def test_sgd_decays_the_weights_and_leaves_the_biases_alone(job, tmp_path):
    # Biases start at 0, so step 1 leaves them equal in every run and gives
    # step 2 the same gradient with and without their decay: step 2's
    # biases then differ by the decay of step 1's alone (lr * wd * b1), and
    # the weights, decayed under either rule, not at all.
    common = [*SMALL, "--optimizer", "sgd", "--lr", 0.1]
    ok(job(2, "--steps", 1, *common, "--save", tmp_path / "first.h5"))
    ok(job(2, "--steps", 2, *common, "--weight-decay", 0.5, "--save", tmp_path / "matrices.h5"))
    ok(job(2, "--steps", 2, *common, "--weight-decay", 0.5, "--weight-decay-on", "all", "--save", tmp_path / "all.h5"))
    first, matrices, every = (saved(tmp_path / f"{n}.h5") for n in ("first", "matrices", "all"))
    for name in ("layer0/W", "layer1/W"):
        assert matrices[name].tobytes() == every[name].tobytes()
    for name in ("layer0/b", "layer1/b"):
        assert np.abs(first[name]).min() > 0
        np.testing.assert_allclose(matrices[name] - every[name], 0.1 * 0.5 * first[name], rtol=1e-3, atol=1e-9)


def test_betas_and_matrix_decay_sharded_equal_unsharded(job, tmp_path):
    # small buckets: several per step, each rank owning part of each (and of the decayed ranges)
    common = ["--steps", 20, *SMALL, "--lr", 1e-3, "--fusion-mb", 0.02, "--weight-decay", 0.5]
    ok(job(2, *common, "--adam-betas", "0.8,0.95", "--shard-optimizer", "off", "--save", tmp_path / "off.h5"))
    ok(job(2, *common, "--adam-betas", "0.8,0.95", "--shard-optimizer", "on", "--save", tmp_path / "on.h5"))
    ok(job(2, *common, "--shard-optimizer", "on", "--save", tmp_path / "default.h5"))
    assert same_bytes(tmp_path / "off.h5", tmp_path / "on.h5")
    assert not same_bytes(tmp_path / "on.h5", tmp_path / "default.h5")   # the betas reached the optimizer


def test_betas_and_matrix_decay_in_a_pipeline_equal_accumulation(job, tmp_path):
    # one layer a bucket: each stage's slice of the model decays where the whole model would
    flags = ["--steps", 6, "--batch-size", 8, "--log-every", 3, "--hidden", "64,32,16", "--fusion-mb", 0.0001,
             "--weight-decay", 0.5, "--adam-betas", "0.8,0.95", "--lr", 1e-3]
    ok(job(2, *flags, "--pipeline-stages", 2, "--micro-batches", 3, "--save", tmp_path / "pipe.h5"))
    ok(job(1, *flags, "--accumulate-steps", 3, "--save", tmp_path / "acc.h5"))
    assert same_bytes(tmp_path / "pipe.h5", tmp_path / "acc.h5")


def test_matrix_decay_on_two_servers_equals_ring(job, tmp_path):
    # two servers: each decays the model's matrices as they fall in its slices
    common = ["--optimizer", "sgd", "--lr", 0.05, "--steps", 15, *SMALL, "--weight-decay", 0.5]
    ok(job(4, "--mode", "ps", "--num-ps", 2, "--sync", *common, "--save", tmp_path / "ps.h5"))
    ok(job(2, "--mode", "ring", *common, "--save", tmp_path / "ring.h5"))
    a, b = saved(tmp_path / "ps.h5"), saved(tmp_path / "ring.h5")
    assert set(a) == set(b)
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) < 1e-6


@pytest.mark.parametrize("value", ["0.9", "0.9,1", "0.9,-0.1", "a,b", "0.9,0.99,0.999"])
def test_bad_betas_are_one_line_and_exit_2(job, tmp_path, value):
    # The parser's line, in-process; one of them on the whole job (the same
    # path for every flag the parser refuses: tests/faults/test_bad_flags.py).
    from hpctrain.flags import cli
    from hpctrain.base.errors import HpctrainError
    line = f"argument --adam-betas: expected B1,B2, each in [0, 1), got {value!r} (see --help)"
    with pytest.raises(HpctrainError) as refused:
        cli.parse(["--adam-betas", value])
    assert str(refused.value) == line
    if value == "0.9":
        r = job(2, "--adam-betas", value, "--save", tmp_path / "p.h5", timeout=60)
        lines = [s for s in r.stderr.splitlines() if s.strip()]
        assert r.returncode == 2 and lines == [f"hpctrain: error: {line}"], r.stderr
        assert not (tmp_path / "p.h5").exists()


def test_a_negative_beta_gets_the_flags_own_line_not_argparses():
    # Issue 54, 10: "-0.1,0.9" was taken for a flag ("expected one argument").
    from hpctrain.flags import cli
    from hpctrain.base.errors import HpctrainError
    with pytest.raises(HpctrainError, match=r"^argument --adam-betas: expected B1,B2, each in \[0, 1\), got "
                                            r"'-0.1,0.9' \(see --help\)$"):
        cli.parse(["--adam-betas", "-0.1,0.9"])
    assert cli.parse(["--adam-betas", "0.8,0.95", "--lr", "1e-3"]).adam_betas == (0.8, 0.95)


def test_betas_must_match_on_resume_with_adam_only():
    from hpctrain.flags import cli
    from hpctrain.run import identity
    spec = mlp((28, 28), 10, [64])

    def key(*flags):
        return identity.same_on_resume(cli.parse(list(flags)), 2, spec, 100)
    assert key("--adam-betas", "0.8,0.95")["adam_betas"] == "0.8,0.95"
    assert key()["adam_betas"] == "0.9,0.999"
    assert "adam_betas" not in key("--optimizer", "sgd", "--adam-betas", "0.8,0.95")
    # --weight-decay-on, like --weight-decay, scales updates and shapes no state: it may change
    assert "weight_decay_on" not in key("--weight-decay-on", "all")


def test_a_resume_with_other_betas_is_refused_in_one_line(job, tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = [*SMALL, "--checkpoint-dir", ckpt, "--checkpoint-every", 2]
    ok(job(2, "--steps", 4, *flags, "--adam-betas", "0.8,0.95"))
    r = job(2, "--steps", 6, *flags, "--adam-betas", "0.9,0.99", timeout=60)
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "checkpoint was written with --adam-betas 0.8,0.95, this run has --adam-betas 0.9,0.99" in lines[0]
