"""Pipeline schedules as pure data, without MPI, as DeepSpeed tests its
TrainSchedule: counts, order, pairing across neighbours, the tick model's
step length and bubble, activation memory; bad arguments refused."""
import itertools
from pathlib import Path

import pytest

from hpctrain import pipeline
from hpctrain.pipeline import (SCHEDULES, Backward, Forward, RecvActivation, RecvGrad, ScheduleError,
                               SendActivation, SendGrad, bubble_fraction, chunk_index, chunk_peaks, delivery,
                               diagram, gpipe, interleaved, one_f_one_b, peak_activations, simulate)

ONE_CHUNK = ("1f1b", "gpipe")
GRID = list(itertools.product(ONE_CHUNK, range(1, 6), range(1, 10)))   # schedule, P, M
# the interleaved schedule: P, V, M (a multiple of P)
IGRID = [(P, V, M) for P in range(1, 6) for V in range(1, 5) for M in range(P, 4 * P + 1, P)]


def plans(name, stages, micro_batches):
    return [SCHEDULES[name](stages, micro_batches, s) for s in range(stages)]


def of_kind(actions, kind):
    return [a.micro for a in actions if isinstance(a, kind)]


@pytest.mark.parametrize("name,stages,micro_batches", GRID)
def test_each_stage_runs_every_micro_batch_forward_then_backward(name, stages, micro_batches):
    for actions in plans(name, stages, micro_batches):
        forwards, backwards = of_kind(actions, Forward), of_kind(actions, Backward)
        assert sorted(forwards) == sorted(backwards) == list(range(micro_batches))
        # the order --accumulate-steps sums the gradients in
        assert backwards == list(range(micro_batches))
        for m in range(micro_batches):
            assert actions.index(Forward(m)) < actions.index(Backward(m))


@pytest.mark.parametrize("name,stages,micro_batches", GRID)
def test_sends_and_receives_pair_up_across_neighbours(name, stages, micro_batches):
    every = plans(name, stages, micro_batches)
    assert not of_kind(every[0], RecvActivation) and not of_kind(every[0], SendGrad)
    assert not of_kind(every[-1], SendActivation) and not of_kind(every[-1], RecvGrad)
    for here, there in zip(every, every[1:]):
        assert of_kind(here, SendActivation) == of_kind(there, RecvActivation) == list(range(micro_batches))
        assert of_kind(there, SendGrad) == of_kind(here, RecvGrad) == list(range(micro_batches))
    for actions in every:
        # a stage sends what it just computed and computes on what it received
        for m in range(micro_batches):
            if SendActivation(m) in actions:
                assert actions.index(SendActivation(m)) == actions.index(Forward(m)) + 1
            if RecvGrad(m) in actions:
                assert actions.index(RecvGrad(m)) == actions.index(Backward(m)) - 1


@pytest.mark.parametrize("name,stages,micro_batches", GRID)
def test_step_takes_2_m_plus_p_minus_1_ticks_without_deadlock(name, stages, micro_batches):
    timeline = simulate(SCHEDULES[name], stages, micro_batches)
    assert timeline.ticks == 2 * (micro_batches + stages - 1)
    for spans in timeline.stages:
        busy = sum(span.end - span.start for span in spans)
        assert busy == 2 * micro_batches
        assert (timeline.ticks - busy) / timeline.ticks == pytest.approx(bubble_fraction(stages, micro_batches))
        assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("name", ONE_CHUNK)
@pytest.mark.parametrize("forward_ticks,backward_ticks", [(1, 2), (2, 3)])
def test_uneven_forward_and_backward_costs_keep_the_bubble(name, forward_ticks, backward_ticks):
    for stages, micro_batches in [(2, 4), (3, 2), (4, 8), (5, 3)]:
        timeline = simulate(SCHEDULES[name], stages, micro_batches, forward_ticks, backward_ticks)
        assert timeline.ticks == (micro_batches + stages - 1) * (forward_ticks + backward_ticks)


@pytest.mark.parametrize("name,stages,micro_batches", GRID)
def test_activation_peak_per_stage(name, stages, micro_batches):
    bounds = [micro_batches if name == "gpipe" else min(stages - s, micro_batches) for s in range(stages)]
    assert [peak_activations(actions) for actions in plans(name, stages, micro_batches)] == bounds
    assert list(simulate(SCHEDULES[name], stages, micro_batches).activations) == bounds


def test_bubble_fraction():
    assert bubble_fraction(1, 7) == 0
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)


def test_one_stage_is_gradient_accumulation():
    assert one_f_one_b(1, 3, 0) == (Forward(0), Backward(0), Forward(1), Backward(1), Forward(2), Backward(2))
    assert gpipe(1, 2, 0) == (Forward(0), Forward(1), Backward(0), Backward(1))


def test_fewer_micro_batches_than_stages():
    # warm-up min(P - s - 1, M): on stages 0 and 1 of 4 it takes both micro-batches
    assert one_f_one_b(4, 2, 0) == (Forward(0), SendActivation(0), Forward(1), SendActivation(1),
                                    RecvGrad(0), Backward(0), RecvGrad(1), Backward(1))
    assert one_f_one_b(4, 2, 3) == (RecvActivation(0), Forward(0), Backward(0), SendGrad(0),
                                    RecvActivation(1), Forward(1), Backward(1), SendGrad(1))


def test_the_documented_diagrams_are_the_simulated_ones():
    docs = Path(__file__).resolve().parents[1] / "docs" / "pipeline.md"
    for name, schedule in SCHEDULES.items():
        ticks = simulate(schedule, 2, 4, virtual_stages=2 if name == "interleaved" else 1)
        indented = "\n".join("    " + line for line in diagram(ticks).splitlines())
        assert f"    {name}\n{indented}\n" in pipeline.schedule.__doc__
        assert f"    {name}\n{indented}\n" in docs.read_text()


def _gpipe_backwards_first(stages, micro_batches, stage, virtual_stages=1):
    """GPipe with the last stage's micro-batch 0 backprop moved before its forward."""
    actions = list(gpipe(stages, micro_batches, stage))
    if stage == stages - 1:
        actions.remove(Backward(0))
        actions.insert(0, Backward(0))
    return tuple(actions)


def _receives_before_sending(stages, micro_batches, stage, virtual_stages=1):
    """1F1B with every stage's first gradient received before its forwards: a cycle."""
    actions = list(one_f_one_b(stages, micro_batches, stage))
    if stage < stages - 1:
        actions.remove(RecvGrad(0))
        actions.insert(0, RecvGrad(0))
    return tuple(actions)


def _lost_gradient(stages, micro_batches, stage, virtual_stages=1):
    return tuple(a for a in gpipe(stages, micro_batches, stage) if a != RecvGrad(1))


def test_broken_schedules_are_caught():
    with pytest.raises(ScheduleError, match=r"Backward\(micro=0, chunk=0\) without its forward"):
        peak_activations(_gpipe_backwards_first(2, 3, 1))
    with pytest.raises(ScheduleError, match=r"Backward\(micro=0, chunk=0\) without its forward"):
        simulate(_gpipe_backwards_first, 2, 3)
    with pytest.raises(ScheduleError, match=r"deadlock: stage 0 waits for RecvGrad\(micro=0, chunk=0\), "
                                            r"stage 1 waits for RecvActivation\(micro=0, chunk=0\)"):
        simulate(_receives_before_sending, 2, 3)
    with pytest.raises(ScheduleError, match=r"stage 1's SendGrad\(micro=1, chunk=0\) is never received "
                                            r"\(no RecvGrad\(micro=1, chunk=0\) on stage 0\)"):
        simulate(_lost_gradient, 2, 3)


def _blocking_sends_finish(every):
    """The same stages when a send waits for its receive (rendezvous): do they all finish?"""
    at = [0] * len(every)
    while True:
        moved = False
        for s, actions in enumerate(every):
            while at[s] < len(actions):
                action = actions[at[s]]
                if isinstance(action, (SendActivation, SendGrad, RecvActivation, RecvGrad)):
                    peer = s + (1 if isinstance(action, (SendActivation, RecvGrad)) else -1)
                    match = {SendActivation: RecvActivation, RecvActivation: SendActivation,
                             SendGrad: RecvGrad, RecvGrad: SendGrad}[type(action)](action.micro)
                    if at[peer] >= len(every[peer]) or every[peer][at[peer]] != match:
                        break
                    at[peer] += 1
                at[s] += 1
                moved = True
        if not moved:
            return all(a == len(actions) for a, actions in zip(at, every))


def test_1f1b_needs_sends_that_do_not_wait_for_their_receive():
    # the module docstring's warning: the loop must Isend (or Sendrecv)
    assert not _blocking_sends_finish(plans("1f1b", 2, 2))
    assert _blocking_sends_finish(plans("gpipe", 2, 2))


@pytest.mark.parametrize("call,message", [
    (lambda: gpipe(0, 4, 0), "pipeline stages must be a positive integer, got 0"),
    (lambda: one_f_one_b(2, 0, 0), "micro-batches must be a positive integer, got 0"),
    (lambda: one_f_one_b(2.5, 4, 0), "pipeline stages must be a positive integer, got 2.5"),
    (lambda: gpipe(2, 4, 2), "stage must be in 0..1 for 2 pipeline stages, got 2"),
    (lambda: one_f_one_b(3, 4, -1), "stage must be in 0..2 for 3 pipeline stages, got -1"),
    (lambda: simulate(gpipe, 2, 4, backward_ticks=0), "backward ticks must be a positive integer, got 0"),
    (lambda: bubble_fraction(2, -1), "micro-batches must be a positive integer, got -1"),
    (lambda: interleaved(2, 3, 0, 2), "the interleaved schedule needs micro-batches a multiple of the pipeline "
                                      "stages (3 micro-batches, 2 stages)"),
    (lambda: interleaved(2, 4, 0, 0), "virtual stages must be a positive integer, got 0"),
    (lambda: one_f_one_b(2, 4, 0, 2), "the 1f1b schedule runs one chunk per stage (virtual stages 1), got 2"),
    (lambda: simulate(gpipe, 2, 4, virtual_stages=2), "the gpipe schedule runs one chunk per stage "
                                                      "(virtual stages 1), got 2"),
])
def test_bad_arguments_are_refused_with_one_line(call, message):
    with pytest.raises(ValueError) as caught:
        call()
    assert str(caught.value) == message


# ---------------------------------------------------------------------------
# the interleaved schedule (virtual stages)

def iplans(stages, virtual, micro_batches):
    return [interleaved(stages, micro_batches, s, virtual) for s in range(stages)]


@pytest.mark.parametrize("stages,virtual,micro_batches", IGRID)
def test_interleaved_every_chunk_backprops_every_micro_batch_in_order(stages, virtual, micro_batches):
    for actions in iplans(stages, virtual, micro_batches):
        for chunk in range(virtual):
            forwards = [a.micro for a in actions if isinstance(a, Forward) and a.chunk == chunk]
            backwards = [a.micro for a in actions if isinstance(a, Backward) and a.chunk == chunk]
            # each chunk's gradient summed in the order of --accumulate-steps
            assert sorted(forwards) == backwards == list(range(micro_batches)), (chunk, forwards, backwards)
            for m in range(micro_batches):
                assert actions.index(Forward(m, chunk)) < actions.index(Backward(m, chunk))
        assert {a.chunk for a in actions} == set(range(virtual))


@pytest.mark.parametrize("stages,virtual,micro_batches", IGRID)
def test_interleaved_messages_go_chunk_to_chunk_round_the_stages(stages, virtual, micro_batches):
    every = iplans(stages, virtual, micro_batches)
    last = stages - 1
    sent = {}
    for s, actions in enumerate(every):
        for a in actions:
            if isinstance(a, (SendActivation, SendGrad)):
                to, receive = delivery(stages, s, a)
                # the model's chunk c's output goes to chunk c + 1, its input gradient to chunk c - 1
                step = 1 if isinstance(a, SendActivation) else -1
                assert chunk_index(stages, to, receive.chunk) == chunk_index(stages, s, a.chunk) + step
                sent[(to, receive)] = sent.get((to, receive), 0) + 1
    received = {(s, a): 1 for s, actions in enumerate(every) for a in actions
                if isinstance(a, (RecvActivation, RecvGrad))}
    assert sent == received
    # the model's first chunk takes the batch, its last computes the loss
    assert not [a for a in every[0] if isinstance(a, (RecvActivation, SendGrad)) and a.chunk == 0]
    assert not [a for a in every[last] if isinstance(a, (SendActivation, RecvGrad)) and a.chunk == virtual - 1]
    n = virtual * stages - 1   # chunk boundaries, each crossed by M activations and M gradients
    assert len(sent) == 2 * n * micro_batches


@pytest.mark.parametrize("stages,virtual,micro_batches", IGRID)
def test_interleaved_step_and_bubble_shrink_by_v(stages, virtual, micro_batches):
    """A tick is a chunk's forward or backward (a V-th of a stage's): the
    step is 2(VM + P - 1) ticks, a stage busy 2VM of them, the bubble
    (P - 1)/(VM + P - 1), with no deadlock; uneven costs the same
    (VM + P - 1)(f + b)."""
    timeline = simulate(interleaved, stages, micro_batches, virtual_stages=virtual)
    assert timeline.ticks == 2 * (virtual * micro_batches + stages - 1)
    for spans in timeline.stages:
        busy = sum(span.end - span.start for span in spans)
        assert busy == 2 * virtual * micro_batches
        assert (timeline.ticks - busy) / timeline.ticks == pytest.approx(
            bubble_fraction(stages, micro_batches, virtual))
        assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))
    for f, b in [(1, 2), (2, 3)]:
        ticks = simulate(interleaved, stages, micro_batches, f, b, virtual_stages=virtual).ticks
        assert ticks == (virtual * micro_batches + stages - 1) * (f + b)


@pytest.mark.parametrize("stages,virtual,micro_batches", IGRID)
def test_interleaved_activation_peak(stages, virtual, micro_batches):
    every = iplans(stages, virtual, micro_batches)
    bounds = [min(2 * (stages - s - 1) + (virtual - 1) * stages + 1, virtual * micro_batches)
              for s in range(stages)]
    assert [peak_activations(actions) for actions in every] == bounds
    for actions in every:
        copies = chunk_peaks(actions, virtual)
        assert len(copies) == virtual and all(1 <= c <= micro_batches for c in copies)
        assert sum(copies) >= peak_activations(actions)


def test_interleaved_bubble_against_the_others():
    assert bubble_fraction(2, 4, 2) == pytest.approx(1 / 9)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction(4, 8, 1) == bubble_fraction(4, 8)
    ticks = simulate(interleaved, 2, 4, virtual_stages=2)
    # in a stage's ticks (V chunk ticks each): 9 against 1F1B's 10
    assert ticks.ticks / 2 == 9 and simulate(one_f_one_b, 2, 4).ticks == 10


def _interleaved_without_the_wrap(stages, micro_batches, stage, virtual_stages):
    """The last stage keeps its chunks' outputs: stage 0's later chunks wait for them."""
    return tuple(a for a in interleaved(stages, micro_batches, stage, virtual_stages)
                 if not (isinstance(a, SendActivation) and stage == stages - 1))


def test_a_lost_wrap_round_is_caught():
    with pytest.raises(ScheduleError, match=r"deadlock: stage 0 waits for RecvActivation\(micro=0, chunk=1\)"):
        simulate(_interleaved_without_the_wrap, 3, 3, virtual_stages=2)


# ---------------------------------------------------------------------------
# where the layer list is cut (pipeline/stages.py)

def _mlp(hidden):
    from hpctrain.flags import cli
    from hpctrain.nn import spec_for
    return spec_for(cli.parse(["--hidden", hidden]), (28, 28), 10)


@pytest.mark.parametrize("hidden, stages", [("16,16,1024", 2), ("64,32,16", 3), ("512,512", 2), ("100,200,300", 4)])
def test_the_default_cut_minimises_the_largest_stages_training_work(hidden, stages):
    """Against every cut by brute force: the largest stage's forward +
    backward multiply-adds (spec.train_flops) is the least possible, and
    every stage holds a layer with parameters."""
    from hpctrain.pipeline.stages import balanced
    spec = _mlp(hidden)
    work, n = spec.train_flops(), len(spec.layers)

    def cost(cuts):
        stages_ = list(zip(cuts, cuts[1:]))
        if not all(any(spec.layer_tensors[i] for i in range(a, b)) for a, b in stages_):
            return None
        return max(sum(work[a:b]) for a, b in stages_)

    best = min(c for inner in itertools.combinations(range(1, n), stages - 1)
               if (c := cost([0, *inner, n])) is not None)
    assert cost(balanced(spec, stages)) == best


def test_the_cut_counts_the_backward_the_first_layer_skips():
    # 784-16-16-1024-10: by forward work alone the cut falls after the second
    # Dense; counting the backward (3x, the first Dense 2x) after the third.
    from hpctrain.pipeline.stages import balanced
    spec = _mlp("16,16,1024")
    assert spec.train_flops()[1] == 2 * spec.flops()[1] and spec.train_flops()[3] == 3 * spec.flops()[3]
    assert balanced(spec, 2) == [0, 6, 8]


def test_a_backward_out_of_micro_batch_order_is_refused():
    """A stage's gradient sum restarts at micro-batch 0 and adds in --accumulate-steps' order:
    a schedule whose Backwards come in another order (here gpipe's, last first) is refused
    with the order it has, not run with a micro-batch's gradient dropped or carried over."""
    reordered = [a for a in gpipe(2, 3, 1) if not isinstance(a, Backward)] + [Backward(m) for m in (2, 1, 0)]
    with pytest.raises(ScheduleError, match=r"the reordered schedule backprops chunk 0's micro-batches in the "
                                            r"order 2, 1, 0; the gradient sum needs 0\.\.2"):
        pipeline.schedule.backward_order("reordered", reordered, 3, 1)
    for name in SCHEDULES:   # every schedule it ships passes
        for P, V, M in ((2, 1 if name in ONE_CHUNK else 2, 4), (3, 1 if name in ONE_CHUNK else 3, 6)):
            for s in range(P):
                pipeline.actions_for(name, P, M, s, V)
