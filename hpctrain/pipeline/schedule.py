"""Pipeline schedules as data: what one stage does during one optimizer step.

A schedule is a pure function `(stages, micro_batches, stage, virtual_stages)
-> actions`: stage s's actions in the order it runs them. The stage's engine
(pipeline/engine.py) executes the list; nothing else decides the order. `simulate` runs every
stage's list together in a tick model, which checks that the sends and
receives pair up without a deadlock and gives the step's length;
`peak_activations` gives a stage's activation memory. Never imports MPI.

    python -m hpctrain.pipeline --stages 2 --micro-batches 4    # every tick diagram (main below)

Actions. `Forward(m)` runs micro-batch m through the stage's layers and keeps
its activations until `Backward(m)`, which adds m's gradient to the stage's
gradient buffer; on the last stage the forward ends with the loss.
`SendActivation(m)` on stage s is received by `RecvActivation(m)` on stage
s + 1; `SendGrad(m)` on stage s (the loss's gradient with respect to the
stage's input) by `RecvGrad(m)` on stage s - 1. The first stage receives no
activations and sends no gradients; the last sends no activations and
receives no gradients. Every action names a chunk too, the stage's local
chunk (0 in the schedules of one chunk per stage): with V virtual stages
the layer list is cut into PV chunks and stage s holds chunks s, s + P, ...,
s + (V - 1)P, its local chunks 0..V-1 (`chunk_index`); an activation then
goes from chunk c to chunk c + 1, from the last stage back to stage 0's
next chunk, a gradient the other way (`delivery`). The model's first chunk
(stage 0's chunk 0) receives no activations and sends no gradients, its
last (stage P - 1's chunk V - 1) sends no activations, receives no
gradients and ends its forward with the loss.

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
- `interleaved`: Megatron's interleaved 1F1B over V chunks per stage
  (`interleaved`): groups of P micro-batches through the stage's chunks in
  turn, 2(P - s - 1) + (V - 1)P forwards of warm-up (at most VM), then one
  forward and one backward in turn. M must be a multiple of P, as in
  Megatron; each chunk then backprops micro-batches 0..M-1 in order.

The tick model (`simulate`). Every stage's forward takes `forward_ticks`,
its backward `backward_ticks` (balanced stages, the same for every
micro-batch). Sends and receives take no time. A send never waits: it is
posted (MPI Isend) and its buffer kept until it completes. A receive waits
until its matching send is posted. A stage starts its next action as soon as
the one before is done. Under this model both schedules take
(M + P - 1)(forward_ticks + backward_ticks) ticks, 2(M + P - 1) at unit
costs; a stage computes M(forward_ticks + backward_ticks) of them and idles
the rest, the bubble (P - 1)/(M + P - 1) of the step. With V chunks the
ticks are a chunk's (a V-th of a stage's work, balanced): the interleaved
schedule takes (VM + P - 1)(forward_ticks + backward_ticks), a stage
computes VM(forward_ticks + backward_ticks) of them, and the bubble is
(P - 1)/(VM + P - 1): the fill and the drain take P - 1 chunk steps, V
times shorter than a stage's (checked for P <= 5, V <= 4, M <= 5P, several
costs: tests/test_pipeline_schedule.py).

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

    interleaved
    tick       0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15  16  17
    stage 0  F0a F1a F0b F1b F2a B0b F3a B1b F2b B0a F3b B1a   . B2b   . B3b B2a B3a
    stage 1    . F0a F1a F0b B0b F1b B1b F2a B0a F3a B1a F2b B2b F3b B3b B2a B3a   .

Both take 10 ticks; GPipe holds 4 activation sets on each stage, 1F1B 2 on
stage 0 and 1 on stage 1. Interleaved with V = 2 (a, b: the stage's first
and second chunk, a tick half a stage's): 18 half-ticks, 9 of the others'
ticks, the bubble 1/9 against 1/5; it holds 5 and 3 chunk activation sets
(2.5 and 1.5 stages' worth: min(2(P - s - 1) + (V - 1)P + 1, VM) chunk
sets), and sends V times as many messages.
"""
import numbers
from dataclasses import dataclass


@dataclass(frozen=True)
class Forward:
    """Run micro-batch `micro` through the stage and keep its activations."""
    micro: int
    chunk: int = 0


@dataclass(frozen=True)
class Backward:
    """Backprop micro-batch `micro` through the stage; its activations are freed."""
    micro: int
    chunk: int = 0


@dataclass(frozen=True)
class SendActivation:
    """Send the stage's output for `micro` to the next stage."""
    micro: int
    chunk: int = 0


@dataclass(frozen=True)
class RecvActivation:
    """Receive the stage's input for `micro` from the previous stage."""
    micro: int
    chunk: int = 0


@dataclass(frozen=True)
class SendGrad:
    """Send the gradient with respect to the stage's input for `micro` to the previous stage."""
    micro: int
    chunk: int = 0


@dataclass(frozen=True)
class RecvGrad:
    """Receive the gradient with respect to the stage's output for `micro` from the next stage."""
    micro: int
    chunk: int = 0


class ScheduleError(RuntimeError):
    """A schedule that cannot run: a deadlock, a message nobody receives, a backward before its forward."""




def _positive(name, value):
    if not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check(stages, micro_batches, stage, virtual_stages=1):
    _positive("pipeline stages", stages)
    _positive("micro-batches", micro_batches)
    _positive("virtual stages", virtual_stages)
    if not isinstance(stage, numbers.Integral) or not 0 <= stage < stages:
        raise ValueError(f"stage must be in 0..{stages - 1} for {stages} pipeline stages, got {stage!r}")


def _one_chunk(name, virtual_stages):
    if virtual_stages != 1:
        raise ValueError(f"the {name} schedule runs one chunk per stage (virtual stages 1), got {virtual_stages!r}")


def _forward(micro, first, last, chunk=0):
    receive = [] if first else [RecvActivation(micro, chunk)]
    send = [] if last else [SendActivation(micro, chunk)]
    return receive + [Forward(micro, chunk)] + send


def _backward(micro, first, last, chunk=0):
    receive = [] if last else [RecvGrad(micro, chunk)]
    send = [] if first else [SendGrad(micro, chunk)]
    return receive + [Backward(micro, chunk)] + send


def gpipe(stages, micro_batches, stage, virtual_stages=1):
    """GPipe's fill and drain: stage `stage`'s M forwards, then its M backwards."""
    _check(stages, micro_batches, stage, virtual_stages)
    _one_chunk("gpipe", virtual_stages)
    first, last = stage == 0, stage == stages - 1
    steps = [_forward(m, first, last) for m in range(micro_batches)]
    steps += [_backward(m, first, last) for m in range(micro_batches)]
    return tuple(action for step in steps for action in step)


def one_f_one_b(stages, micro_batches, stage, virtual_stages=1):
    """PipeDream-flush 1F1B: warm-up forwards, steady forward/backward pairs, cool-down backwards."""
    _check(stages, micro_batches, stage, virtual_stages)
    _one_chunk("1f1b", virtual_stages)
    first, last = stage == 0, stage == stages - 1
    warmup = min(stages - stage - 1, micro_batches)
    steady = micro_batches - warmup
    steps = [_forward(m, first, last) for m in range(warmup)]
    for m in range(steady):
        steps += [_forward(warmup + m, first, last), _backward(m, first, last)]
    steps += [_backward(m, first, last) for m in range(steady, micro_batches)]
    return tuple(action for step in steps for action in step)


def interleaved(stages, micro_batches, stage, virtual_stages=2):
    """Megatron's interleaved 1F1B over V chunks per stage (virtual stages):
    stage s holds the model's chunks s, s + P, ..., s + (V - 1)P (its local
    chunks 0..V-1). Virtual micro-batch k (0..VM-1) is micro-batch
    (k // PV)P + k mod P on local chunk (k mod PV) // P forward, chunk V - 1 -
    that backward: groups of P micro-batches go through the chunks in turn.
    Warm-up min(2(P - s - 1) + (V - 1)P, VM) forwards, then one forward and
    one backward in turn, then the remaining backwards. M must be a multiple
    of P (as Megatron's): each chunk then backprops its micro-batches in order
    0..M-1, the order --accumulate-steps sums them."""
    _check(stages, micro_batches, stage, virtual_stages)
    P, M, V = stages, micro_batches, virtual_stages
    if M % P:
        raise ValueError(f"the interleaved schedule needs micro-batches a multiple of the pipeline stages "
                         f"({M} micro-batches, {P} stages)")
    total = V * M

    def at(k, forward):
        group, inside = divmod(k, P * V)
        chunk = inside // P
        return group * P + k % P, chunk if forward else V - 1 - chunk

    def first(chunk):   # the model's first chunk: its input is the batch
        return stage == 0 and chunk == 0

    def last(chunk):    # the model's last chunk: its output is the loss
        return stage == P - 1 and chunk == V - 1

    def fwd(k):
        m, c = at(k, True)
        return _forward(m, first(c), last(c), c)

    def bwd(k):
        m, c = at(k, False)
        return _backward(m, first(c), last(c), c)

    warmup = min(2 * (P - stage - 1) + (V - 1) * P, total)
    steps = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        steps += [fwd(warmup + k), bwd(k)]
    steps += [bwd(k) for k in range(total - warmup, total)]
    return tuple(action for step in steps for action in step)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved}


def actions_for(name, stages, micro_batches, stage, virtual_stages=1):
    """Stage `stage`'s actions under schedule `name` (SCHEDULES), with V chunks for the interleaved one;
    refused (backward_order) unless each chunk backprops micro-batches 0..M-1 in order."""
    actions = SCHEDULES[name](stages, micro_batches, stage, virtual_stages)
    backward_order(name, actions, micro_batches, virtual_stages)
    return actions


def backward_order(name, actions, micro_batches, virtual_stages):
    """Refuses a schedule in which a chunk's Backwards are not micro-batches 0..M-1 in order:
    a stage's gradient sum (stage.py) restarts at micro-batch 0 and adds as --accumulate-steps
    does, so another order would drop, carry over or reorder micro-batches' gradients silently."""
    for chunk in range(virtual_stages):
        order = [a.micro for a in actions if isinstance(a, Backward) and a.chunk == chunk]
        if order != list(range(micro_batches)):
            raise ScheduleError(f"the {name} schedule backprops chunk {chunk}'s micro-batches in the order "
                                f"{', '.join(map(str, order))}; the gradient sum needs 0..{micro_batches - 1}")


def chunk_index(stages, stage, chunk):
    """The model's chunk (0..PV-1) that stage `stage`'s local chunk `chunk` is: chunk P + stage."""
    return chunk * stages + stage


@dataclass(frozen=True)
class Span:
    """A forward or backward on one stage, from tick `start` to tick `end` (exclusive)."""
    start: int
    end: int
    action: object


@dataclass(frozen=True)
class Ticks:
    """Every stage's spans in order, the step's length in ticks, each stage's activation peak, its chunks."""
    stages: tuple
    ticks: int
    activations: tuple
    virtual_stages: int = 1


def delivery(stages, stage, send):
    """(stage, receive) that takes `send` posted on `stage`: the next chunk's
    (chunk c P + s + 1: stage s + 1's local chunk c, or stage 0's chunk c + 1
    after the last stage), or for a gradient the chunk before."""
    if isinstance(send, SendActivation):
        if stage == stages - 1:
            return 0, RecvActivation(send.micro, send.chunk + 1)
        return stage + 1, RecvActivation(send.micro, send.chunk)
    if stage == 0:
        return stages - 1, RecvGrad(send.micro, send.chunk - 1)
    return stage - 1, RecvGrad(send.micro, send.chunk)


def _advance(stage, plan, at, clock, posted, spans, costs, stages):
    """Run `stage`'s actions from index `at` until a receive has no send yet; the new index."""
    while at < len(plan):
        action = plan[at]
        if isinstance(action, (RecvActivation, RecvGrad)):
            if (stage, action) not in posted:
                return at
            clock[stage] = max(clock[stage], posted.pop((stage, action))[0])
        elif isinstance(action, (SendActivation, SendGrad)):
            to = delivery(stages, stage, action)
            if to in posted:
                raise ScheduleError(f"stage {stage} posts {action} twice")
            posted[to] = (clock[stage], stage, action)
        else:
            cost = costs[type(action)]
            spans.append(Span(clock[stage], clock[stage] + cost, action))
            clock[stage] += cost
        at += 1
    return at


def simulate(schedule, stages, micro_batches, forward_ticks=1, backward_ticks=1, virtual_stages=1):
    """Run `schedule`'s lists for every stage together in the tick model (module docstring); a Ticks.
    A forward or backward is one chunk's (with V chunks a stage's work is V of them).

    Raises ScheduleError on a backward before its forward, on a deadlock
    (naming every stage that waits and for what) or on a message that no
    stage receives."""
    _positive("pipeline stages", stages)
    _positive("micro-batches", micro_batches)
    _positive("forward ticks", forward_ticks)
    _positive("backward ticks", backward_ticks)
    _positive("virtual stages", virtual_stages)
    plans = [schedule(stages, micro_batches, s, virtual_stages) for s in range(stages)]
    activations = tuple(peak_activations(plan) for plan in plans)
    costs = {Forward: forward_ticks, Backward: backward_ticks}
    at, clock, posted, spans = [0] * stages, [0] * stages, {}, [[] for _ in range(stages)]
    moved = True
    while moved:
        moved = False
        for s in range(stages):
            was, at[s] = at[s], _advance(s, plans[s], at[s], clock, posted, spans[s], costs, stages)
            moved = moved or at[s] != was
    waiting = [f"stage {s} waits for {plans[s][at[s]]}" for s in range(stages) if at[s] < len(plans[s])]
    if waiting:
        raise ScheduleError("deadlock: " + ", ".join(waiting))
    if posted:
        (to, receive), (_, sender, send) = next(iter(posted.items()))
        raise ScheduleError(f"stage {sender}'s {send} is never received (no {receive} on stage {to})")
    return Ticks(tuple(tuple(row) for row in spans), max(clock), activations, virtual_stages)


def peak_activations(actions):
    """The most activation sets a stage holds at once running `actions` (a
    forward's until its backward; with chunks, a chunk's set each)."""
    return _peak(actions)


def _held(actions):
    """Every action's (micro-batch, chunk) sets held after it, checked."""
    held = set()
    for action in actions:
        if isinstance(action, Forward):
            if (action.micro, action.chunk) in held:
                raise ScheduleError(f"{action} twice before its backward")
            held.add((action.micro, action.chunk))
        elif isinstance(action, Backward):
            if (action.micro, action.chunk) not in held:
                raise ScheduleError(f"{action} without its forward before it")
            held.remove((action.micro, action.chunk))
        yield held


def _peak(actions):
    return max((len(held) for held in _held(actions)), default=0)


def _peaks(actions):
    peaks = {}
    for held in _held(actions):
        for chunk in {c for _, c in held} | set(peaks):
            peaks[chunk] = max(peaks.get(chunk, 0), sum(1 for _, c in held if c == chunk))
    return peaks


def chunk_peaks(actions, virtual_stages=1):
    """Per local chunk, the most of its activation sets held at once: the
    model copies each chunk needs (pipeline/stage.py)."""
    peaks = _peaks(actions)
    return [peaks.get(c, 0) for c in range(virtual_stages)]


def bubble_fraction(stages, micro_batches, virtual_stages=1):
    """The idle part of a step on every stage in the tick model: (P - 1)/(VM + P - 1)."""
    _positive("pipeline stages", stages)
    _positive("micro-batches", micro_batches)
    _positive("virtual stages", virtual_stages)
    return (stages - 1) / (virtual_stages * micro_batches + stages - 1)


def diagram(timeline):
    """The timeline as text: a row per stage, a column per tick, F3/B3 for
    micro-batch 3's forward/backward; with V chunks a stage's local chunk as
    a letter (F3a: chunk 0, F3b: chunk 1, ...)."""
    letters = timeline.virtual_stages > 1
    rows = [["."] * timeline.ticks for _ in timeline.stages]
    for row, spans in zip(rows, timeline.stages):
        for span in spans:
            label = ("F" if isinstance(span.action, Forward) else "B") + str(span.action.micro)
            if letters:
                label += "abcdefghijklmnopqrstuvwxyz"[span.action.chunk % 26]
            row[span.start:span.end] = [label] * (span.end - span.start)
    width = max([len(str(timeline.ticks - 1))] + [len(cell) for row in rows for cell in row]) + 1
    lines = ["tick    " + "".join(f"{t:>{width}}" for t in range(timeline.ticks))]
    lines += [f"stage {s:<2}" + "".join(f"{cell:>{width}}" for cell in row) for s, row in enumerate(rows)]
    return "\n".join(lines)


def main(argv=None):
    """Every schedule's tick diagram, step length, activation peaks per stage and the bubble."""
    import sys
    from ..flags.arguments import Parser
    from ..base.errors import HpctrainError
    parser = Parser(prog="python -m hpctrain.pipeline", description=main.__doc__)
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages P (default: %(default)s)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches M (default: %(default)s)")
    parser.add_argument("--virtual-stages", type=int, default=2,
                        help="chunks V per stage of the interleaved schedule (default: %(default)s)")
    parser.add_argument("--forward-ticks", type=int, default=1, help="ticks a forward takes (default: %(default)s)")
    parser.add_argument("--backward-ticks", type=int, default=1, help="ticks a backward takes (default: %(default)s)")
    try:
        args = parser.parse_args(argv)
        P, M, V = args.stages, args.micro_batches, args.virtual_stages
        for name, schedule in SCHEDULES.items():
            v = V if name == "interleaved" else 1
            if name == "interleaved" and M % P:
                print(f"{name}: needs micro-batches a multiple of the stages ({M}, {P})\n")
                continue
            ticks = simulate(schedule, P, M, args.forward_ticks, args.backward_ticks, v)
            unit = f" (a chunk's forward or backward {1 / v:g} of a stage's)" if v > 1 else ""
            print(f"{name}{f' V={v}' if v > 1 else ''}\n{diagram(ticks)}\n{ticks.ticks} ticks{unit}, "
                  f"activation sets held per stage {list(ticks.activations)}\n")
        print(f"bubble (P - 1)/(M + P - 1) = {bubble_fraction(P, M):.3f}; interleaved "
              f"(P - 1)/(VM + P - 1) = {bubble_fraction(P, M, V):.3f}")
    except ValueError as e:
        print(f"hpctrain: error: {e}", file=sys.stderr)
        return 2
    except HpctrainError as e:
        print(f"hpctrain: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0
