"""Pipeline schedules as data: what one stage does during one optimizer step.

A schedule is a pure function `(stages, micro_batches, stage) -> actions`:
stage s's actions in the order it runs them. The stage's engine
(pipeline/engine.py) executes the list; nothing else decides the order. `simulate` runs every
stage's list together in a tick model, which checks that the sends and
receives pair up without a deadlock and gives the step's length;
`peak_activations` gives a stage's activation memory. Never imports MPI.

    python -m hpctrain.pipeline --stages 2 --micro-batches 4    # both tick diagrams (main below)

Actions. `Forward(m)` runs micro-batch m through the stage's layers and keeps
its activations until `Backward(m)`, which adds m's gradient to the stage's
gradient buffer; on the last stage the forward ends with the loss.
`SendActivation(m)` on stage s is received by `RecvActivation(m)` on stage
s + 1; `SendGrad(m)` on stage s (the loss's gradient with respect to the
stage's input) by `RecvGrad(m)` on stage s - 1. The first stage receives no
activations and sends no gradients; the last sends no activations and
receives no gradients.

Schedules (`SCHEDULES`), both ending with every stage's gradient summed over
the M micro-batches, in micro-batch order 0..M-1 on every stage, the order of
`--accumulate-steps M`, so that both give the same bits:

- `gpipe`: fill and drain (GPipe). All M forwards, then all M backwards;
  every stage holds M activation sets.
- `1f1b`: one forward, one backward (PipeDream-flush, as DeepSpeed's
  TrainSchedule and Megatron). Stage s runs min(P - s - 1, M) forwards
  (warm-up), then alternates the next forward with the oldest backward
  (steady state), then the remaining backwards (cool-down); it holds at most
  min(P - s, M) activation sets. M < P works: the warm-up takes every
  micro-batch and there is no steady state. P = 1 is gradient accumulation,
  forward m then backward m.

The tick model (`simulate`). Every stage's forward takes `forward_ticks`,
its backward `backward_ticks` (balanced stages, the same for every
micro-batch). Sends and receives take no time. A send never waits: it is
posted (MPI Isend) and its buffer kept until it completes. A receive waits
until its matching send is posted. A stage starts its next action as soon as
the one before is done. Under this model both schedules take
(M + P - 1)(forward_ticks + backward_ticks) ticks, 2(M + P - 1) at unit
costs; a stage computes M(forward_ticks + backward_ticks) of them and idles
the rest, the bubble (P - 1)/(M + P - 1) of the step.

A blocking send that waits for its receive (MPI_Send of a large buffer,
rendezvous) breaks this: 1F1B in this order deadlocks at P = 2, M = 2, stage 0
in SendActivation(1), stage 1 in SendGrad(0), each waiting for the other's
receive. The loop posts its sends (Isend), or pairs a send with the next
receive (Sendrecv, as Megatron's send_forward_recv_backward does).

P = 2, M = 4, unit costs, F = forward, B = backward, . = idle (`diagram`):

    gpipe
    tick      0  1  2  3  4  5  6  7  8  9
    stage 0  F0 F1 F2 F3  .  . B0 B1 B2 B3
    stage 1   . F0 F1 F2 F3 B0 B1 B2 B3  .

    1f1b
    tick      0  1  2  3  4  5  6  7  8  9
    stage 0  F0 F1  . B0 F2 B1 F3 B2  . B3
    stage 1   . F0 B0 F1 B1 F2 B2 F3 B3  .

Both take 10 ticks; GPipe holds 4 activation sets on each stage, 1F1B 2 on
stage 0 and 1 on stage 1.
"""
import numbers
from dataclasses import dataclass


@dataclass(frozen=True)
class Forward:
    """Run micro-batch `micro` through the stage and keep its activations."""
    micro: int


@dataclass(frozen=True)
class Backward:
    """Backprop micro-batch `micro` through the stage; its activations are freed."""
    micro: int


@dataclass(frozen=True)
class SendActivation:
    """Send the stage's output for `micro` to the next stage."""
    micro: int


@dataclass(frozen=True)
class RecvActivation:
    """Receive the stage's input for `micro` from the previous stage."""
    micro: int


@dataclass(frozen=True)
class SendGrad:
    """Send the gradient with respect to the stage's input for `micro` to the previous stage."""
    micro: int


@dataclass(frozen=True)
class RecvGrad:
    """Receive the gradient with respect to the stage's output for `micro` from the next stage."""
    micro: int


class ScheduleError(RuntimeError):
    """A schedule that cannot run: a deadlock, a message nobody receives, a backward before its forward."""


def _positive(name, value):
    if not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check(stages, micro_batches, stage):
    _positive("pipeline stages", stages)
    _positive("micro-batches", micro_batches)
    if not isinstance(stage, numbers.Integral) or not 0 <= stage < stages:
        raise ValueError(f"stage must be in 0..{stages - 1} for {stages} pipeline stages, got {stage!r}")


def _forward(micro, first, last):
    receive = [] if first else [RecvActivation(micro)]
    send = [] if last else [SendActivation(micro)]
    return receive + [Forward(micro)] + send


def _backward(micro, first, last):
    receive = [] if last else [RecvGrad(micro)]
    send = [] if first else [SendGrad(micro)]
    return receive + [Backward(micro)] + send


def gpipe(stages, micro_batches, stage):
    """GPipe's fill and drain: stage `stage`'s M forwards, then its M backwards."""
    _check(stages, micro_batches, stage)
    first, last = stage == 0, stage == stages - 1
    steps = [_forward(m, first, last) for m in range(micro_batches)]
    steps += [_backward(m, first, last) for m in range(micro_batches)]
    return tuple(action for step in steps for action in step)


def one_f_one_b(stages, micro_batches, stage):
    """PipeDream-flush 1F1B: warm-up forwards, steady forward/backward pairs, cool-down backwards."""
    _check(stages, micro_batches, stage)
    first, last = stage == 0, stage == stages - 1
    warmup = min(stages - stage - 1, micro_batches)
    steady = micro_batches - warmup
    steps = [_forward(m, first, last) for m in range(warmup)]
    for m in range(steady):
        steps += [_forward(warmup + m, first, last), _backward(m, first, last)]
    steps += [_backward(m, first, last) for m in range(steady, micro_batches)]
    return tuple(action for step in steps for action in step)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


@dataclass(frozen=True)
class Span:
    """A forward or backward on one stage, from tick `start` to tick `end` (exclusive)."""
    start: int
    end: int
    action: object


@dataclass(frozen=True)
class Ticks:
    """Every stage's spans in order, the step's length in ticks, and each stage's activation peak."""
    stages: tuple
    ticks: int
    activations: tuple


def _delivery(stage, send):
    """The (stage, receive) that takes `send` posted on `stage`."""
    if isinstance(send, SendActivation):
        return stage + 1, RecvActivation(send.micro)
    return stage - 1, RecvGrad(send.micro)


def _advance(stage, plan, at, clock, posted, spans, costs):
    """Run `stage`'s actions from index `at` until a receive has no send yet; the new index."""
    while at < len(plan):
        action = plan[at]
        if isinstance(action, (RecvActivation, RecvGrad)):
            if (stage, action) not in posted:
                return at
            clock[stage] = max(clock[stage], posted.pop((stage, action))[0])
        elif isinstance(action, (SendActivation, SendGrad)):
            if _delivery(stage, action) in posted:
                raise ScheduleError(f"stage {stage} posts {action} twice")
            posted[_delivery(stage, action)] = (clock[stage], stage, action)
        else:
            cost = costs[type(action)]
            spans.append(Span(clock[stage], clock[stage] + cost, action))
            clock[stage] += cost
        at += 1
    return at


def simulate(schedule, stages, micro_batches, forward_ticks=1, backward_ticks=1):
    """Run `schedule`'s lists for every stage together in the tick model (module docstring); a Ticks.

    Raises ScheduleError on a backward before its forward, on a deadlock
    (naming every stage that waits and for what) or on a message that no
    stage receives."""
    _positive("pipeline stages", stages)
    _positive("micro-batches", micro_batches)
    _positive("forward ticks", forward_ticks)
    _positive("backward ticks", backward_ticks)
    plans = [schedule(stages, micro_batches, s) for s in range(stages)]
    activations = tuple(peak_activations(plan) for plan in plans)
    costs = {Forward: forward_ticks, Backward: backward_ticks}
    at, clock, posted, spans = [0] * stages, [0] * stages, {}, [[] for _ in range(stages)]
    moved = True
    while moved:
        moved = False
        for s in range(stages):
            was, at[s] = at[s], _advance(s, plans[s], at[s], clock, posted, spans[s], costs)
            moved = moved or at[s] != was
    waiting = [f"stage {s} waits for {plans[s][at[s]]}" for s in range(stages) if at[s] < len(plans[s])]
    if waiting:
        raise ScheduleError("deadlock: " + ", ".join(waiting))
    if posted:
        (to, receive), (_, sender, send) = next(iter(posted.items()))
        raise ScheduleError(f"stage {sender}'s {send} is never received (no {receive} on stage {to})")
    return Ticks(tuple(tuple(row) for row in spans), max(clock), activations)


def peak_activations(actions):
    """The most activation sets a stage holds at once running `actions` (a forward's until its backward)."""
    held, peak = set(), 0
    for action in actions:
        if isinstance(action, Forward):
            if action.micro in held:
                raise ScheduleError(f"{action} twice before its backward")
            held.add(action.micro)
            peak = max(peak, len(held))
        elif isinstance(action, Backward):
            if action.micro not in held:
                raise ScheduleError(f"{action} without its forward before it")
            held.remove(action.micro)
    return peak


def bubble_fraction(stages, micro_batches):
    """The idle part of a step on every stage in the tick model: (P - 1)/(M + P - 1)."""
    _positive("pipeline stages", stages)
    _positive("micro-batches", micro_batches)
    return (stages - 1) / (micro_batches + stages - 1)


def diagram(timeline):
    """The timeline as text: a row per stage, a column per tick, F3/B3 for micro-batch 3's forward/backward."""
    rows = [["."] * timeline.ticks for _ in timeline.stages]
    for row, spans in zip(rows, timeline.stages):
        for span in spans:
            label = ("F" if isinstance(span.action, Forward) else "B") + str(span.action.micro)
            row[span.start:span.end] = [label] * (span.end - span.start)
    width = max([len(str(timeline.ticks - 1))] + [len(cell) for row in rows for cell in row]) + 1
    lines = ["tick    " + "".join(f"{t:>{width}}" for t in range(timeline.ticks))]
    lines += [f"stage {s:<2}" + "".join(f"{cell:>{width}}" for cell in row) for s, row in enumerate(rows)]
    return "\n".join(lines)


def main(argv=None):
    """Both schedules' tick diagrams, step length, activation peaks per stage and the bubble."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m hpctrain.pipeline", description=main.__doc__)
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages P (default: %(default)s)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches M (default: %(default)s)")
    parser.add_argument("--forward-ticks", type=int, default=1, help="ticks a forward takes (default: %(default)s)")
    parser.add_argument("--backward-ticks", type=int, default=1, help="ticks a backward takes (default: %(default)s)")
    args = parser.parse_args(argv)
    P, M = args.stages, args.micro_batches
    try:
        for name, schedule in SCHEDULES.items():
            ticks = simulate(schedule, P, M, args.forward_ticks, args.backward_ticks)
            print(f"{name}\n{diagram(ticks)}\n{ticks.ticks} ticks, "
                  f"activation sets held per stage {list(ticks.activations)}\n")
        print(f"bubble (P - 1)/(M + P - 1) = {bubble_fraction(P, M):.3f}")
    except ValueError as e:
        parser.error(str(e))
    return 0

