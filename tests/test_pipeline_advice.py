"""The pipeline a memory refusal names (run/memory_check.py fitting_pipeline)
and the cut it is measured on (pipeline/stages.py balanced): bounded work
for a deep model (issue 54, 3: every P's dynamic programme took a minute
for 1,000 layers and never answered for 100,000), the same answers as the
exhaustive search where that one answered. No MPI, no timing.

    .venv/bin/python -m pytest -q tests/test_pipeline_advice.py
"""
import itertools
import math
import random
from types import SimpleNamespace

import pytest

from hpctrain.pipeline import stages as stages_mod
from hpctrain.pipeline.stages import bottleneck_cuts
from hpctrain.run import memory_check


def _largest(flops, cuts):
    return max(sum(flops[a:b]) for a, b in zip(cuts, cuts[1:]))


def test_the_bisected_cut_has_the_least_largest_stage_of_any_cut():
    # Against every cut by brute force, layers without parameters (and
    # work) among them: the same largest stage, each stage with parameters.
    rng = random.Random(1)
    for _ in range(400):
        n = rng.randint(1, 8)
        flops = [rng.choice([0, 0, 1, 2, 3, 5, 8, 13]) for _ in range(n)]
        has = [rng.random() < 0.6 for _ in range(n)]
        for stages in range(1, n + 2):
            every = [[0, *inner, n] for inner in itertools.combinations(range(1, n), stages - 1)]
            valid = [cuts for cuts in every if all(any(has[a:b]) for a, b in zip(cuts, cuts[1:]))]
            got = bottleneck_cuts(flops, has, stages)
            if not valid:
                assert got is None, (flops, has, stages)
                continue
            assert len(got) == stages + 1 and all(any(has[a:b]) for a, b in zip(got, got[1:])), got
            assert _largest(flops, got) == min(_largest(flops, c) for c in valid), (flops, has, stages, got)


def _args(schedule="1f1b", micro_batches=1):
    return SimpleNamespace(pipeline_schedule=schedule, micro_batches=micro_batches, virtual_stages=None,
                           optimizer="adam", batch_size=4)


def _exhaustive(args, spec, budget, base):
    """The search before issue 54: every P from 2 up."""
    virtual = stages_mod.virtual_stages(args)
    for p in range(2, len(spec.param_layers) // virtual + 1):
        if args.pipeline_schedule == "interleaved" and args.micro_batches % p:
            continue
        need = max(memory_check.stage_needs(args, spec, stages_mod.balanced(spec, p * virtual)))
        if base + need <= budget:
            return p, need
    return None


@pytest.mark.parametrize("schedule, micro", [("1f1b", 1), ("gpipe", 4), ("interleaved", 4)])
def test_the_advice_is_the_exhaustive_searchs(schedule, micro):
    from hpctrain.nn.gpt import gpt
    spec = gpt(11, 8, 12, 2, 8)
    args = _args(schedule, micro)
    whole = spec.memory_bytes(args.batch_size, 2, buffers=3)
    for part in (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.2):
        budget = 1000 + part * whole
        assert memory_check.fitting_pipeline(args, spec, budget, 1000) == _exhaustive(args, spec, budget, 1000), part


def test_a_deep_models_advice_cuts_a_bounded_number_of_times(monkeypatch):
    # 400 blocks: the exhaustive search cut the model ~400 times, each an
    # O(stages x layers^2) programme; the bounded one a dozen, each linear.
    from hpctrain.nn.gpt import gpt
    spec = gpt(11, 8, 400, 1, 4)
    args = _args()
    calls, balanced = [], stages_mod.balanced
    bound = memory_check.MOST_TRIED + 1 + math.ceil(math.log2(len(spec.layers)))

    def counted(spec, stages):
        calls.append(stages)
        assert len(calls) <= bound, f"more than {bound} cuts"   # fail at once, not after the old search's minutes
        return balanced(spec, stages)
    monkeypatch.setattr(stages_mod, "balanced", counted)
    whole = spec.memory_bytes(memory_check.held_batch(args, spec), 2, buffers=3)   # as the check counts it
    for budget in (whole / 1000, whole / 40, whole / 300):   # none fits; one fits at once; one a search away
        calls.clear()
        memory_check.fitting_pipeline(args, spec, budget, 0)
    calls.clear()
    assert memory_check.fitting_pipeline(args, spec, whole / 40, 0)[0] < 50
