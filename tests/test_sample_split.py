"""--thread-split samples (hpctrain/nn/sample_split.py): a batch cut into a
fixed number of slices, each through whole layers on one compute thread,
gives the same bits on 1, 2 and 3 threads (a GPT with tied embeddings and
dropout, and an MLP; uneven slices), the one-thread model's loss and
gradient within float32 rounding, and the same saved parameters through the
command line at 1 and 2 threads; the settings it cannot take are one line.

    .venv/bin/python -m pytest -q tests/test_sample_split.py
"""
import json

import numpy as np
import pytest

from conftest import prepared_plays, same_bytes
from hpctrain.base.errors import HpctrainError
from hpctrain.flags.cli import build_parser, validate
from hpctrain.nn import BatchNorm2d, Channels, Conv2d, Dense, Flatten, ModelSpec, ReLU, gpt, threads
from hpctrain.nn.sample_split import SampleSplit
from hpctrain.run.plan import thread_slices


@pytest.fixture
def spied():
    """The number of parts of every threads.run call (one thread again afterwards)."""
    calls = []
    run = threads.run

    def spy(fn, parts):
        calls.append(len(parts))
        return run(fn, parts)
    threads.run = spy
    yield calls
    threads.run = run
    threads.configure(1)


def _split_step(spec, count, slices, x, y):
    """(loss, gradient) of one forward_backward cut into `slices`, on `count` threads."""
    assert threads.configure(count) == count
    model = spec.build(np)
    model.init(3)
    loss = SampleSplit(spec, model, slices).forward_backward(x, y, noise=(0, 0, np.arange(len(x))))
    return np.float32(loss), model.grads.copy()


def _whole_step(spec, x, y):
    threads.configure(1)
    model = spec.build(np)
    model.init(3)
    return np.float32(model.forward_backward(x, y, noise=(0, 0, np.arange(len(x))))), model.grads.copy()


CASES = {
    # tied embedding and head (the slices' tied parts summed too), dropout (its draws by sample id)
    "gpt": (lambda: gpt(65, 16, 2, 4, 32, dropout=0.1), lambda rng: (rng.integers(0, 65, (10, 16)),
                                                                    rng.integers(0, 65, (10, 16)))),
    "mlp": (lambda: ModelSpec([Flatten(), Dense(32), ReLU(), Dense(10)], (6, 6), 10),
            lambda rng: (rng.standard_normal((10, 6, 6)).astype(np.float32), rng.integers(0, 10, 10))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_same_bits_on_any_number_of_threads_and_the_model_within_rounding(name, spied):
    make, data = CASES[name]
    spec, (x, y) = make(), data(np.random.default_rng(1))
    # 10 samples in 3 slices: 3, 3 and 4, weighted by their sizes
    results = [_split_step(spec, count, 3, x, y) for count in (1, 2, 3)]
    assert 2 in spied and 3 in spied, "the slices never ran on several threads: the test would prove nothing"
    for loss, grads in results[1:]:
        assert loss.tobytes() == results[0][0].tobytes() and grads.tobytes() == results[0][1].tobytes()
    loss, grads = _whole_step(spec, x, y)
    np.testing.assert_allclose(results[0][0], loss, rtol=1e-6)
    np.testing.assert_allclose(results[0][1], grads, rtol=1e-4, atol=1e-6 * np.abs(grads).max())
    assert np.abs(grads).max() > 0


def test_the_slices_meet_once_a_step(spied):
    """Each thread runs its slices forward and backward in one hand-off (a
    slice's backward needs its own loss only) and then adds up the layers
    every slice has finished: one meeting a step, none after the forwards
    and none for the gradients' sum, though this one (188,000 floats) is
    large enough to split over the threads."""
    spec = ModelSpec([Flatten(), Dense(4096), ReLU(), Dense(10)], (6, 6), 10)
    x, y = CASES["mlp"][1](np.random.default_rng(2))
    loss, grads = _split_step(spec, 2, 2, x, y)
    assert spied == [2]
    assert grads.tobytes() == _split_step(spec, 1, 2, x, y)[1].tobytes()


def test_an_error_in_one_slice_is_raised_not_waited_for(monkeypatch):
    """The thread whose slice failed tells the others to wait for none of its
    layers: the error comes back, nothing hangs."""
    assert threads.configure(2) == 2
    spec, (x, y) = CASES["mlp"][0](), CASES["mlp"][1](np.random.default_rng(2))
    model = spec.build(np)
    split = SampleSplit(spec, model, 2)

    def broken(*args, **kwargs):
        raise RuntimeError("slice 0 broke")
    monkeypatch.setattr(split.copies[0].run, "backward", broken)   # slice 0: the worker's
    try:
        with pytest.raises(RuntimeError, match="slice 0 broke"):
            split.forward_backward(x, y)
    finally:
        threads.configure(1)


def test_one_slice_is_the_model():
    spec, (x, y) = CASES["mlp"][0](), CASES["mlp"][1](np.random.default_rng(2))
    loss, grads = _split_step(spec, 2, 1, x, y)
    threads.configure(1)
    whole = _whole_step(spec, x, y)
    assert loss.tobytes() == whole[0].tobytes() and grads.tobytes() == whole[1].tobytes()


@pytest.mark.parametrize("flags, named", [
    (["--zero", "2"], "--zero 2"), (["--mode", "ps"], "--mode ps"), (["--pipeline-stages", "2"], "--pipeline-stages 2"),
    (["--tensor-parallel", "2"], "--tensor-parallel 2"), (["--device", "gpu"], "--device gpu")])
def test_settings_it_cannot_take_are_one_line(flags, named):
    args = build_parser().parse_args(["--thread-split", "samples", *flags])
    with pytest.raises(HpctrainError, match=f"--thread-split samples does not work with {named}"):
        validate(args, 4)


def test_batch_norm_is_refused_in_one_line():
    args = build_parser().parse_args(["--thread-split", "samples", "--thread-slices", "3"])
    bn = ModelSpec([Channels(), Conv2d(4, 3), BatchNorm2d(), Flatten(), Dense(10)], (8, 8, 1), 10)
    with pytest.raises(HpctrainError, match="cannot split batch norm"):
        thread_slices(args, bn, np)
    assert thread_slices(args, CASES["mlp"][0](), np) == 3
    assert thread_slices(build_parser().parse_args([]), bn, np) == 1


def test_training_saves_the_same_bits_on_one_and_two_threads(job, tmp_path_factory, tmp_path):
    """The flags through ring mode, accumulated micro-batches (their tied
    parts kept apart, combine=False) each cut into slices, with --recompute:
    the record counts the slices' recomputed blocks (3 steps x 2
    micro-batches x 3 slices x 2 blocks)."""
    text = prepared_plays(tmp_path_factory, 20_000)
    common = ["--data", text, "--model", "gpt:layers=2,heads=2,width=32", "--block-size", "16", "--batch-size", "6",
              "--steps", "3", "--accumulate-steps", "2", "--eval-tokens", "256", "--thread-split", "samples",
              "--thread-slices", "3", "--recompute"]
    for count in (1, 2):
        r = job(1, *common, "--threads", str(count), "--save", tmp_path / f"t{count}.h5",
                "--metrics", tmp_path / f"m{count}.jsonl", env={"OPENBLAS_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr
    assert same_bytes(tmp_path / "t1.h5", tmp_path / "t2.h5")
    final = json.loads((tmp_path / "m2.jsonl").read_text().splitlines()[-1])
    assert final["recomputed_forwards"] == 3 * 2 * 3 * 2, final


def test_the_memory_check_counts_each_slices_gradient():
    from hpctrain.run.memory_check import ring_needs
    spec = CASES["gpt"][0]()
    need = {s: ring_needs(build_parser().parse_args(["--thread-split", s, "--thread-slices", "3"]), spec, 1, 0)
            for s in ("ops", "samples")}
    assert need["samples"] - need["ops"] == 2 * 4 * spec.num_params
