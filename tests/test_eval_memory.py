"""Evaluation in a training step's memory (issue 60 §3): the evaluation's
forward batches are the training step's (nn/sequential.eval_forward, in
whole row tiles), each layer's buffers let go once it has run, and the
loss summed over the same groups as before, so the results keep their bits;
the start-up memory check counts what the evaluation holds.

    .venv/bin/python -m pytest -q tests/test_eval_memory.py
"""
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

from hpctrain.nn import gpt, mlp
from hpctrain.nn.sequential import eval_forward
from hpctrain.run.memory_check import held_batch


def _traced_peak(fn):
    """Bytes NumPy allocated at most while fn ran, above what was held before."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_evaluation_in_training_batches_gives_the_whole_groups_bits(name):
    """Sums of 300 samples (groups of 128 images, of 8192 // 64 windows)
    run forward a training batch at a time: the bits of each group run
    whole. The MLP's batch of 16 goes 48 at a time: 16 rows a product gave
    other bits (OpenBLAS sums a row in another tile shape)."""
    rng = np.random.default_rng(0)
    if name == "mlp":
        spec, batch = mlp((28, 28), 10, [64, 32]), 16
        x, y = rng.integers(0, 256, (300, 28, 28), dtype=np.uint8), rng.integers(0, 10, 300)
    else:
        spec, batch = gpt(65, 64, 2, 2, 32), 12
        x, y = rng.integers(0, 65, (300, 64)), rng.integers(0, 65, (300, 64))
    model = spec.build(np)
    model.init(3)
    forward = eval_forward(spec, batch)
    assert forward == (48 if name == "mlp" else 12)
    whole = model.evaluate(x, y)
    assert model.evaluate(x, y, forward=forward) == whole
    assert whole["count"] == (300 if name == "mlp" else 300 * 64)


def test_an_evaluation_holds_no_more_than_a_training_step():
    """The GPT at nanoGPT's CPU batch shape (width 32 here): evaluating 300
    windows a training batch at a time allocates less at its peak than the
    training step did, and leaves the step's slot as it was (its buffers are
    its own: nothing kept for a backward)."""
    rng = np.random.default_rng(1)
    spec = gpt(65, 64, 2, 2, 32)
    model = spec.build(np)
    model.init(0)
    x, y = rng.integers(0, 65, (12, 64)), rng.integers(0, 65, (12, 64))
    step = _traced_peak(lambda: model.forward_backward(x, y))
    held = model.ctx.held_bytes()
    xe, ye = rng.integers(0, 65, (300, 64)), rng.integers(0, 65, (300, 64))
    evaluation = _traced_peak(lambda: model.evaluate(xe, ye, forward=eval_forward(spec, 12)))
    assert 0 < evaluation < step, (evaluation, step)
    assert model.ctx.held_bytes() == held


def test_the_memory_check_counts_the_evaluations_batch():
    """run/memory_check.held_batch: a training batch, or the evaluation's
    where that is larger (whole row tiles: 48 images for a batch of 16)."""
    args = SimpleNamespace(batch_size=16)
    assert held_batch(args, mlp((28, 28), 10, [64])) == 48
    assert held_batch(SimpleNamespace(batch_size=64), mlp((28, 28), 10, [64])) == 64
    assert held_batch(SimpleNamespace(batch_size=4), gpt(65, 128, 2, 2, 32)) == 4   # evaluates 3 at a time
