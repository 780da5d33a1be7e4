"""--recompute (nn/sequential.LayerRange: each transformer Block's
activations dropped after its forward, recomputed before its backward):
the parameters of a run without it, bit for bit, in ring mode with dropout,
with --accumulate-steps, in a 2-stage pipeline and on ps workers; a slot
holding less, the memory check's estimate smaller and close to what the
runner holds; a model without a block refused in one line.

    .venv/bin/python -m pytest -q tests/test_recompute.py
"""
import json

import numpy as np
import pytest

from conftest import saved
from hpctrain import data
from hpctrain.nn.gpt import gpt

GPT = "gpt:layers=2,heads=2,width=16,dropout=0.1"
FLAGS = ["--model", GPT, "--block-size", 16, "--batch-size", 4, "--steps", 4, "--lr", 1e-3]


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    """The first 20,000 characters of the bundled plays, prepared as characters."""
    root = tmp_path_factory.mktemp("text")
    source = root / "plays.txt"
    source.write_bytes(open(data.bundled_text_path(), "rb").read()[:20_000])
    out = root / "chars"
    data.prepare_text(str(source), str(out), "chars", log=lambda *a, **k: None)
    return str(out)


def same_parameters(a, b):
    a, b = saved(a), saved(b)
    return set(a) == set(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)


@pytest.mark.parametrize("n, flags, recomputed", [
    (2, [], 2 * 4),                                            # ring, dropout in every block: 2 blocks, 4 steps
    (2, ["--accumulate-steps", 2], 2 * 4 * 2),
    (2, ["--pipeline-stages", 2, "--micro-batches", 2], None),     # 1F1B: two slots in flight on stage 0
    (2, ["--pipeline-stages", 2, "--micro-batches", 4, "--pipeline-schedule", "interleaved",
         "--virtual-stages", 2], None),                         # two chunks a stage, the tie between stages
    (3, ["--mode", "ps", "--optimizer", "sgd"], None),          # 2 workers, 1 server
], ids=["ring", "accumulate", "pipeline", "interleaved", "ps"])
def test_recompute_trains_the_bits_of_a_run_without(job, text_dir, tmp_path, n, flags, recomputed):
    """The same bits, and the final record counts the chief's block forwards
    run again (recomputed_forwards: a loop that ignored the flag has none)."""
    finals = {}
    for name, extra in (("plain", []), ("recompute", ["--recompute"])):
        metrics = tmp_path / f"{name}.jsonl"
        r = job(n, "--data", text_dir, *FLAGS, *flags, *extra, "--save", tmp_path / f"{name}.h5",
                "--metrics", metrics)
        assert r.returncode == 0, r.stderr
        finals[name] = json.loads(metrics.read_text().splitlines()[-1])
    assert same_parameters(tmp_path / "plain.h5", tmp_path / "recompute.h5")
    assert "recomputed_forwards" not in finals["plain"]
    count = finals["recompute"]["recomputed_forwards"]
    assert count == recomputed if recomputed else count > 0, count


def _step(spec, batch, slots=1):
    """One training forward and backward of the spec's model on random
    tokens; (the model's gradient, bytes its runner holds after it: every
    buffer of a warm step)."""
    model = spec.build()
    model.init(0)
    run = model.run
    rng = np.random.default_rng(3)
    t, vocab = spec.input_shape[0], spec.classes
    ids, targets = rng.integers(0, vocab, (batch, t)), rng.integers(0, vocab, (batch, t))
    run.set_noise((0, 1, np.arange(batch)))
    _, d = run.loss_forward_backward(run.forward(ids, True), targets)
    run.backward(d)
    held = run.slots[0].held_bytes() + sum(ctx.held_bytes() for ctx in run.shared.values())
    return model.grads.copy(), held


def test_a_recomputing_runner_holds_less_and_gives_the_same_gradient():
    """In one process: a recomputing runner's forward leaves the blocks'
    inputs and one block's activations (its shared context) where the plain
    one leaves every block's, and its backward the same gradient bits."""
    spec = gpt(30, 32, layers=4, heads=2, width=16, dropout=0.2)
    grads, held = _step(spec, 4)
    spec.use_recompute()
    grads_again, held_recomputing = _step(spec, 4)
    assert np.array_equal(grads, grads_again)
    assert held_recomputing < 0.6 * held, (held_recomputing, held)


def _buffers(ctx):
    """Every array a context holds, its inner contexts' included."""
    return list(ctx._buffers.values()) + [buf for inner in ctx.inner for buf in _buffers(inner)]


def test_a_warm_recomputing_step_allocates_nothing():
    """The shared contexts, the slot's copies and the recompute's scratch
    are made by the first step and reused by every later one."""
    spec = gpt(30, 16, layers=2, heads=2, width=16, dropout=0.1)
    spec.use_recompute()
    model = spec.build()
    model.init(0)
    rng = np.random.default_rng(5)
    held = []
    for step in range(3):
        ids, targets = rng.integers(0, 30, (4, 16)), rng.integers(0, 30, (4, 16))
        model.forward_backward(ids, targets, noise=(0, step, np.arange(4 * step, 4 * step + 4)))
        run = model.run
        held.append({id(buf) for ctx in [run.slots[0], run._scratch, *run.shared.values()] for buf in _buffers(ctx)})
    assert held[1] == held[2] and held[1]


def test_the_memory_estimate_counts_attention_and_only_what_recompute_keeps():
    """The memory check's activations (spec.activation_floats): attention's
    grow with T^2 (at 4x the block size a block's grow more than 4x), and
    with --recompute a slot counts the blocks' outputs, the range one
    block's activations: the estimate under half the plain one, and each
    as close to the bytes the runner holds after a step."""
    small, large = gpt(30, 16, 1, 2, 16), gpt(30, 64, 1, 2, 16)
    assert large.layers[3].train_floats() > 4.5 * small.layers[3].train_floats()
    spec = gpt(30, 32, layers=4, heads=2, width=16)
    plain = spec.memory_bytes(4, 2)
    assert_counts_what_is_held(spec)
    spec.use_recompute()
    acts, once = spec.activation_floats()
    block = spec.layers[3]
    assert once == block.train_floats()
    assert acts == sum(layer.train_floats() for layer in spec.layers if layer is not block and
                       not layer.recompute_unit) + 4 * 32 * 16
    assert spec.memory_bytes(4, 2) < 0.5 * plain
    assert_counts_what_is_held(spec)


def assert_counts_what_is_held(spec, batch=4):
    """The activations' estimate (float32) at least what the runner holds
    after a step and at most 15% more (buffers a layer counts and its path
    does not make; a dropout at p = 0 once counted 28% more here)."""
    acts, once = spec.activation_floats()
    _, held = _step(spec, batch)
    assert held <= 4 * batch * (acts + once) <= 1.15 * held, (held, 4 * batch * (acts + once))


def test_recompute_of_a_model_without_a_block_is_one_line(job, bundled_shards):
    r = job(1, "--data", bundled_shards, "--steps", 1, "--recompute")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("hpctrain: error: --recompute: --model mlp: it has no layer"), \
        r.stderr
