"""A pipeline that holds a model bigger than one rank (issue 29): a stage
builds and initialises only its layers, to the bits of the whole model's.

    .venv/bin/python -m pytest -q tests/test_pipeline_memory.py
"""
import numpy as np
import pytest

from hpctrain.comm.step_gradient import StepGradient
from hpctrain.nn import MODELS, mlp
from hpctrain.pipeline.stage import Stage
from hpctrain.pipeline.stages import balanced


@pytest.mark.parametrize("spec", [
    lambda: mlp((28, 28), 10, (64, 32, 16)),
    lambda: MODELS["resnet"]((12, 12, 3), 10),   # batch-norm state, residual containers
    lambda: MODELS["cnn"]((12, 12, 3), 10),
], ids=["mlp", "resnet", "cnn"])
@pytest.mark.parametrize("stages", [2, 3])
def test_a_stage_initialises_its_layers_alone_to_the_whole_models_bits(spec, stages):
    spec = spec()
    whole = spec.build()
    whole.init(7)
    cuts = balanced(spec, stages)
    for s in range(stages):
        stage = Stage(spec, cuts, s, 1, np, np.float32, copies=1)
        stage.init(7)
        assert stage.params.tobytes() == whole.params[stage.lo:stage.hi].tobytes(), s
        assert stage.state.tobytes() == whole.state[stage.state_lo:stage.state_hi].tobytes(), s


def _tiny_cnn():
    """Every kind of per-call state: batch norm (running statistics), dropout
    (noise), max pooling, convolutions, ReLU in place (tests/models/tiny_cnn.py)."""
    from hpctrain.nn import ModelSpec
    from models.tiny_cnn import build
    return ModelSpec(build((8, 8, 3), 5), (8, 8, 3), 5)


def _micro_batches(spec, m, batch=4):
    rng = np.random.default_rng(3)
    return [(rng.random((batch, *spec.input_shape), dtype=np.float32), rng.integers(0, spec.classes, batch),
             (11, 2, np.arange(k * batch, (k + 1) * batch))) for k in range(m)]


def test_a_stage_holds_one_set_of_layers_and_a_slot_per_micro_batch():
    # issue 42, 1: a stage deep-copied its layers per micro-batch in flight;
    # now one LayerRange, M contexts. GPipe's order (every forward, then every
    # backward) keeps all 8 in flight at once: the stage's gradient sum and
    # batch-norm statistics are the whole model's, micro-batch by micro-batch.
    spec = _tiny_cnn()
    batches = _micro_batches(spec, 8)
    whole = spec.build()
    whole.init(5)
    step = np.zeros_like(whole.grads)
    from hpctrain.comm.step_gradient import Accumulation
    total = Accumulation(step)
    for x, y, noise in batches:
        whole.forward_backward(x, y, noise=noise)
        total.add(whole.grads)
    stage = Stage(spec, [0, len(spec.layers)], 0, 8, np, np.float32)
    stage.init(5)
    gradient = StepGradient(np, np.float32, [(stage.grads, stage.model.run.extra)])   # the engine's
    gradient.begin()
    run = stage.model.run
    assert stage.slots == 8 and len(run.slots) == 8 and len(run.layers) == len(spec.layers)
    for m, (x, y, noise) in enumerate(batches):
        stage.forward(m, x, y, noise)
    for m in range(8):
        assert stage.backward(m) is None
        gradient.add(stage.grad, stage.model.run.extra)
    assert stage.grads.tobytes() == step.tobytes()
    assert stage.state.tobytes() == whole.state.tobytes()


def test_each_layer_draws_from_a_stream_of_its_own():
    # a layer's initial values depend on (seed, its index), not on the layers before it
    a, b = mlp((28, 28), 10, (64, 32)).build(), mlp((28, 28), 10, (48, 32)).build()
    a.init(3)
    b.init(3)
    last_a, last_b = dict(a.tensors())["layer2/W"], dict(b.tensors())["layer2/W"]
    assert last_a.shape == last_b.shape and np.array_equal(last_a, last_b)


BIG = ["--hidden", "2048,2048,2048,2048", "--steps", "4", "--log-every", "4", "--batch-size", "16"]


def test_a_model_too_big_for_one_rank_trains_on_four_stages_under_the_same_budget(job, tmp_path):
    # Issue 29, 3: --memory-budget (GiB per rank) refuses the model on one
    # rank, naming the pipeline that fits; on 4 stages it trains, and every
    # rank's measured peak (the kernel's high-water mark) stays under it
    # (4 steps: numba's pass does not pay, so the NumPy blocks run, and the
    # process holds ~60 MB before the model).
    budget = 0.2
    r = job(1, *BIG, "--memory-budget", budget, timeout=120)
    lines = [s for s in r.stderr.splitlines() if s.startswith("hpctrain: error:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "needs at least" in lines[0] and f"--memory-budget {budget:g} GiB per rank" in lines[0], lines
    assert "--pipeline-stages" in lines[0] and "would fit" in lines[0], lines
    metrics = tmp_path / "m.jsonl"
    r = job(4, *BIG, "--memory-budget", budget, "--pipeline-stages", 4, "--micro-batches", 2, "--metrics", metrics,
            timeout=300)
    assert r.returncode == 0, r.stderr
    import json
    final = json.loads(metrics.read_text().splitlines()[-1])
    assert final["peak_rss_mb"] < budget * 1024, final["peak_rss_mb"]   # the largest of any rank


def test_a_pipeline_whose_heaviest_stage_does_not_fit_names_one_that_does(job):
    r = job(2, *BIG, "--memory-budget", 0.2, "--pipeline-stages", 2, timeout=120)
    lines = [s for s in r.stderr.splitlines() if s.startswith("hpctrain: error:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "for its heaviest stage (" in lines[0], lines
    assert "--pipeline-stages 3 would fit" in lines[0] or "--pipeline-stages 4 would fit" in lines[0], lines


WIDE = ["--hidden", "2048,2048,2048,2048,2048,2048,2048", "--steps", "2", "--batch-size", "16"]


@pytest.mark.parametrize("micro, expect", [
    (4, "--pipeline-stages 4 would fit"),
    # P = 3 would hold the chunks, but the interleaved schedule takes groups of P micro-batches
    (2, "no interleaved pipeline of this model with --virtual-stages 2 and --micro-batches 2 fits either"),
])
def test_an_interleaved_stage_counts_its_chunks_and_names_a_pipeline_that_fits(job, micro, expect):
    r = job(2, *WIDE, "--memory-budget", 0.25, "--pipeline-stages", 2, "--micro-batches", micro,
            "--pipeline-schedule", "interleaved", timeout=120)
    lines = [s for s in r.stderr.splitlines() if s.startswith("hpctrain: error:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "for its heaviest stage (0: layers [0,4) [8,12))" in lines[0] and expect in lines[0], lines
