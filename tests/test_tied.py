"""Tied tensors (nn/tied.py, pipeline/tied.py) and the Embedding
(nn/embedding.py): finite differences in float64 through a tied
embedding/head pair; bad ties refused at build with one line; a tied model
(examples/tied_model.py) in ring mode on 2 ranks equal to one process over
the same samples (SGD, within rounding), across a 2-stage cut equal to
--accumulate-steps M on one rank bit for bit, the copies of the tied
tensor bit-identical after training and the saved file holding it once.

    .venv/bin/python -m pytest -q tests/test_tied.py
"""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, checkpoint_path, remove_checkpoint, saved, same_bytes
from hpctrain.nn import Dense, Embedding, Flatten, LayerError, ModelSpec, ReLU
from hpctrain.nn.layer_errors import LayerCodeError
from test_layers import bound, rel_error

TIED = os.path.join(REPO, "examples", "tied_model.py")
SHORT = ["--steps", "6", "--batch-size", "8", "--log-every", "3"]


def ok(r):
    assert r.returncode == 0, r.stderr
    return r


def tied_layers(vocab=10, dim=4):
    emb = Embedding(vocab, dim)
    return [emb, Flatten(), Dense(6), ReLU(), Dense(dim), Dense(vocab).tie("W", emb, "E", transposed=True)]


def test_embedding_gradient_matches_finite_differences():
    """The matrix's gradient against central differences (a token repeated
    in a sample adds up); the ids get none."""
    slot, params, grads = bound(Embedding(5, 3), (4,))
    x = np.array([[0, 1, 1, 4], [2, 2, 2, 3], [4, 0, 0, 0]])
    r = np.random.default_rng(0).standard_normal((3, 4, 3))

    def loss():
        return float((slot.forward(x, True) * r).sum())
    loss()
    assert not np.abs(slot.backward(r.copy(), True)).any()
    analytic = grads.copy()
    numeric = np.empty(params.size)
    for k in range(params.size):
        old = params[k]
        params[k] = old + 1e-6
        up = loss()
        params[k] = old - 1e-6
        down = loss()
        params[k] = old
        numeric[k] = (up - down) / 2e-6
    assert rel_error(numeric, analytic) < 1e-8 and np.abs(analytic).max() > 0


def test_embedding_takes_whole_numbers_as_floats_and_refuses_ids_out_of_range():
    slot, _, _ = bound(Embedding(5, 3), (2,))
    assert np.array_equal(slot.forward(np.array([[1.0, 4.0]]), False), slot.forward(np.array([[1, 4]]), False))
    with pytest.raises(LayerError, match=r"token id 5 is outside \[0, 5\)"):
        slot.forward(np.array([[1, 5]]), False)
    assert ModelSpec([Embedding(5, 3), Flatten(), Dense(5)], (2,), 5).input_kind == "tokens"


def test_tied_pair_in_a_spec_matches_finite_differences_and_lies_once():
    """Both uses' gradients summed into the one tensor: the whole model's
    gradient against central differences, float64."""
    spec = ModelSpec(tied_layers(), (5,), 10)
    assert [name for name, *_ in spec.tensors] == ["layer0/E", "layer1/W", "layer1/b", "layer2/W", "layer2/b",
                                                   "layer3/b"]
    # what a checkpoint's index records of the tie: the tensor once, the name that reads it and how
    assert spec.aliases() == {"layer0/E": [{"name": "layer3/W", "transpose": True}]}
    m = spec.build(dtype=np.float64)
    m.init(3)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 10, (7, 5)), rng.integers(0, 10, 7)
    m.forward_backward(x, y)
    analytic = m.grads.copy()
    numeric = np.empty(spec.num_params)
    for k in range(spec.num_params):
        old = m.params[k]
        m.params[k] = old + 1e-6
        up = float(m.forward_backward(x, y))
        m.params[k] = old - 1e-6
        down = float(m.forward_backward(x, y))
        m.params[k] = old
        numeric[k] = (up - down) / 2e-6
    assert rel_error(numeric, analytic) < 1e-7


def test_the_owners_range_is_reported_once_both_uses_are_in():
    """on_layer_done for the embedding's range comes after the head's backward and carries the sum."""
    spec = ModelSpec(tied_layers(), (5,), 10)
    m = spec.build()
    m.init(1)
    x, y = np.random.default_rng(1).integers(0, 10, (4, 5)), np.arange(4)
    seen = []
    m.forward_backward(x, y, on_layer_done=lambda k: seen.append((k, m.grads[0:40].copy())))
    assert [k for k, _ in seen] == [3, 2, 1, 0]
    m.forward_backward(x, y, combine=False)
    assert not np.array_equal(seen[-1][1], m.grads[0:40])   # the head's use alone
    assert np.array_equal(seen[-1][1], m.grads[0:40] + m.extra)


def _bad(layers, shape=(5,)):
    with pytest.raises(LayerCodeError) as e:
        ModelSpec(layers, shape, 10)
    return str(e.value)


def test_bad_ties_are_refused_with_one_line():
    emb = Embedding(10, 4)
    assert "the owner (Embedding(10, 4)) is not a layer of the model's list" in \
        _bad([Embedding(10, 4), Flatten(), Dense(4), Dense(10).tie("W", emb, "E", transposed=True)])
    emb = Embedding(10, 4)
    assert "its 'W' is 4x10, layer 0's 'E' is 10x4" in \
        _bad([emb, Flatten(), Dense(4), Dense(10).tie("W", emb, "E")])
    emb = Embedding(10, 4)
    assert "layer 0 has no tensor 'F' of its own (its tensors: E)" in \
        _bad([emb, Flatten(), Dense(4), Dense(10).tie("W", emb, "F", transposed=True)])
    emb = Embedding(10, 4)
    assert "it has no tensor 'V'" in _bad([emb, Flatten(), Dense(4), Dense(10).tie("V", emb, "E")])
    head = Dense(10)
    assert "comes after it" in _bad([Flatten(), Dense(10).tie("W", head, "W"), head], shape=(2, 5))
    head = Dense(10)
    assert "to itself" in _bad([Flatten(), head.tie("b", head, "b")], shape=(2, 5))
    emb = Embedding(10, 4)
    assert "'W' is tied twice" in _bad([emb, Flatten(), Dense(4), Dense(10).tie("W", emb, "E", True)
                                        .tie("W", emb, "E", True)])
    # one layer object twice is still refused, and says how to share a tensor
    d = Dense(10)
    assert "tie it" in _bad([Flatten(), d, d], shape=(2, 5))


SGD = ["--model", f"{TIED}:build", "--optimizer", "sgd", "--lr", "0.05", "--steps", 6]


def ring_sgd(job, once, more):
    """--save file of the tied model under SGD on 2 ranks with `more`:
    launched once for the tests that compare with it (two ranks against
    one with --accumulate-steps, and sync ps, run the same one)."""
    def make(out):
        ok(job(2, *SGD, *more, "--save", out / "ring.h5"))
        return out / "ring.h5"
    return once(("test_tied ring sgd", *map(str, more)), make)


def accumulated(job, once, ranks, micro):
    """--save file of the tied model (Adam, the default) on `ranks` ranks
    with --accumulate-steps micro: what a pipeline of these replicas must
    end as, launched once for every test that compares with it (the
    p2-gpipe and p3 cuts and the virtual stages share one)."""
    def make(out):
        ok(job(ranks, "--model", f"{TIED}:build", *SHORT, "--accumulate-steps", micro, "--save", out / "acc.h5"))
        return out / "acc.h5"
    return once(("test_tied accumulated", ranks, micro), make)


@pytest.mark.parametrize("two, one", [
    (["--batch-size", 8], ["--batch-size", 16]),
    (["--batch-size", 8, "--accumulate-steps", 2], ["--batch-size", 8, "--accumulate-steps", 4]),
], ids=["2x8=16", "2x8x2=8x4"])
def test_tied_model_trains_in_ring_mode_and_two_ranks_equal_one(job, once, tmp_path, two, one):
    """Two ranks equal one process over the same samples (SGD: within
    float32 rounding: the embedding's gradient adds 784 positions a sample,
    and the batch split changes the order), with
    --accumulate-steps too (each use summed over the micro-batches apart);
    the saved file holds the tied tensor once."""
    ok(job(1, *SGD, *one, "--save", tmp_path / "one.h5"))
    a, b = saved(ring_sgd(job, once, two)), saved(tmp_path / "one.h5")
    assert sorted(a) == ["layer0/E", "layer1/W", "layer1/b", "layer2/W", "layer2/b", "layer3/b"]
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("ranks, stages, micro, schedule, split", [
    (2, 2, 3, "1f1b", "3"), (2, 2, 2, "gpipe", "3"), (4, 2, 2, "1f1b", "3"),
    (3, 3, 2, "1f1b", "3,6"),   # a stage between the two uses, which holds neither
], ids=["p2-1f1b", "p2-gpipe", "p2r2", "p3"])
def test_a_cut_between_the_uses_equals_accumulation_and_keeps_the_copies_identical(job, once, tmp_path, ranks, stages,
                                                                                 micro, schedule, split):
    """--pipeline-split 3 puts the embedding on stage 0 and the tied head on
    a later stage: the parameters equal --accumulate-steps M on R ranks bit
    for bit, and after training the head's stage's copy of the embedding's
    matrix is stage 0's, bit for bit (on every replica)."""
    flags = ["--model", f"{TIED}:build", "--optimizer", "adam", *SHORT]
    copies = tmp_path / "copies"
    copies.mkdir()
    ok(job(ranks, *flags, "--pipeline-stages", stages, "--pipeline-split", split, "--micro-batches", micro,
           "--pipeline-schedule", schedule, "--save", tmp_path / "pipe.h5", module="tied_copies",
           env={"PYTHONPATH": os.path.dirname(os.path.abspath(__file__)), "TIED_COPIES": str(copies)}))
    acc = accumulated(job, once, ranks // stages, micro)
    assert same_bytes(tmp_path / "pipe.h5", acc)
    holding = [rank for rank in range(ranks) if (copies / f"{rank}.npy").exists()]
    assert len(holding) == 2 * ranks // stages, holding   # the owner's stage's ranks and the head's
    bits = {rank: np.load(copies / f"{rank}.npy") for rank in holding}
    assert all(b.tobytes() == bits[0].tobytes() for b in bits.values()), {r: b.ravel()[:3] for r, b in bits.items()}
    assert bits[0].tobytes() == saved(acc)["layer0/E"].astype(np.float32).tobytes()


def test_virtual_stages_that_cut_a_tie_apart_equal_accumulation(job, once, tmp_path):
    """--virtual-stages 2: the embedding on chunk 0 (stage 0), the tied head
    on chunk 3 (stage 1): the tied gradient summed between those chunks'
    stages, the bits of --accumulate-steps 2 on one rank."""
    flags = ["--model", f"{TIED}:build", *SHORT]
    ok(job(2, *flags, "--pipeline-stages", 2, "--pipeline-schedule", "interleaved", "--virtual-stages", 2,
           "--micro-batches", 2, "--pipeline-split", "2,4,6", "--save", tmp_path / "pipe.h5"))
    assert same_bytes(tmp_path / "pipe.h5", accumulated(job, once, 1, 2))


def test_the_spec_tool_checks_the_tied_model_layer_by_layer():
    """python -m hpctrain.nn --check: the embedding on token ids, the head
    with its tied weight as a tensor of its own, and the whole model."""
    r = subprocess.run([sys.executable, "-m", "hpctrain.nn", "--model", f"{TIED}:build", "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("passed: gradients within") == 7 and "model passed" in r.stdout, r.stdout
    assert "W is layer 1's E transposed (tied)" in r.stdout


def test_a_resumed_cut_ends_with_the_bits_of_one_run_through(job, tmp_path):
    """The checkpoint holds the tied tensor once (the owner's stage's slice);
    on resume the head's stage takes its copy from it: the same bits as a
    run through, and as a ring run resumed from the same file."""
    flags = ["--model", f"{TIED}:build", "--batch-size", 8, "--log-every", 6, "--pipeline-stages", 2,
             "--pipeline-split", 3, "--micro-batches", 2]
    ck = ["--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", 4]
    # the run through writes the checkpoints the resumes start from (one job, not two)
    ok(job(2, *flags, "--steps", 8, *ck, "--save", tmp_path / "through.h5"))
    remove_checkpoint(checkpoint_path(tmp_path / "ck", 8))
    shutil.copytree(tmp_path / "ck", tmp_path / "ck-ring")
    r = ok(job(2, *flags, "--steps", 8, *ck, "--save", tmp_path / "resumed.h5"))
    assert "resumed from" in r.stdout, r.stdout
    assert same_bytes(tmp_path / "through.h5", tmp_path / "resumed.h5")
    ring = ["--model", f"{TIED}:build", "--batch-size", 8, "--log-every", 6, "--accumulate-steps", 2]
    ok(job(1, *ring, "--steps", 8, "--checkpoint-dir", tmp_path / "ck-ring", "--checkpoint-every", 4,
           "--save", tmp_path / "ring.h5"))
    assert same_bytes(tmp_path / "through.h5", tmp_path / "ring.h5")


def test_sync_ps_trains_the_tied_model_as_the_ring_does(job, once, tmp_path):
    """A ps worker sums a tied tensor's uses over --accumulate-steps apart
    too: its parameters are ring mode's within rounding (SGD)."""
    more = ["--batch-size", 8, "--accumulate-steps", 2]   # the ring run of "2x8x2=8x4" above
    ok(job(3, "--mode", "ps", *SGD, *more, "--save", tmp_path / "ps.h5"))
    a, b = saved(tmp_path / "ps.h5"), saved(ring_sgd(job, once, more))
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=0, atol=1e-5, err_msg=name)


def test_layers_named_where_the_model_is_built_name_their_tensors_and_two_of_one_name_are_one_line():
    spec = ModelSpec([Embedding(10, 8).named("wte"), Flatten(), Dense(6).named("fc")], (5,), 6)
    assert [name for name, *_ in spec.tensors] == ["wte/E", "fc/W", "fc/b"]
    assert spec.name_in_file({"layer0/E"})("adam.m/fc/W") == "adam.m/layer1/W"   # an older file's names
    assert spec.name_in_file({"wte/E"})("fc/W") == "fc/W"
    with pytest.raises(LayerCodeError, match=r"layer 2 \(Dense\(6\)\): its name 'wte' is layer 0's too"):
        ModelSpec([Embedding(10, 8).named("wte"), Flatten(), Dense(6).named("wte")], (5,), 6)
