"""The pipeline measured (issue 22 §4): runs real `--pipeline-stages P` jobs
through mpirun (P ranks, one replica) for each schedule and micro-batch count,
with `--timeline`, and reports per stage, from the trace's spans
(pipeline/trace.py) and its metadata:

- bubble: the idle part of the stage's schedule phase, 1 - (its forward +
  backward seconds) / (the phase's seconds), the phase running from the
  step's first action to the end of the Waitall of its sends (sends,
  receives and their waits count as idle); the median over the steps after
  the first tenth (warm-up), against the tick model's (P - 1)/(M + P - 1);
  beside it the best of those steps (on a shared machine, the step that
  other jobs disturbed least).
- activations: the most micro-batches whose activations the stage holds at
  once (a forward's until its backward ends, counted from the spans' order),
  against the schedule's bound (schedule.peak_activations: GPipe M, 1F1B
  min(P - s, M)); in bytes, times one micro-batch's kept activations from the
  shapes (the stage's layers' train_floats(): outputs and their gradients,
  float32, batch B); copies: the model copies the stage allocates, each
  holding one micro-batch's activations (pipeline/stage.py: the bound).
- parameters + optimizer state on the stage's rank (the bytes its buffers
  hold), against one unpipelined rank's (--accumulate-steps M, the same
  model: its parameters and its final record's optimizer_state_bytes);
  beside them the stage's gradient buffers (one micro-batch's and the sum).
- peak resident memory of the stage's rank (the kernel's high-water mark,
  its final record's), in all and above the interpreter with its imports,
  against the unpipelined rank's (issue 29: a stage's rank at 1/P + 10% of
  it is the target); for a model whose parameters and Adam state dominate:
  `--hidden 4096,4096,4096,4096 --steps 6 --micro-batches 4 --stages 4`.

    python -m hpctrain.bench pipeline                      # P = 2, M = 4, 8, gpipe and 1f1b, --hidden 512,512
    python -m hpctrain.bench pipeline --hidden 774,774 --micro-batches 4,8 --steps 50
    python -m hpctrain.bench pipeline --quick              # seconds; its figures mean nothing
    python -m hpctrain.bench pipeline --schedules 1f1b,interleaved --hidden 512,512,512   # V = 2 chunks a stage

With the interleaved schedule (--virtual-stages V) a stage's row names its
chunks' layers, its activation sets are counted per chunk and summed (the
bound: schedule.chunk_peaks, each chunk's sets at its layers' bytes), and
the tick model's bubble is (P - 1)/(VM + P - 1) (column V beside it).

Flags after `--` go to every job (python -m hpctrain.train), e.g.
`-- --pipeline-split 3 --optimizer sgd`. The default model, 784-512-512-10,
gives both stages the same forward + backward multiply-adds per sample
(802,816 and 801,792: a layer's backward is twice its forward, except the
model's first layer, which computes no input gradient); `--hidden 774,774`
gives them the same spec.flops() (forward only, what the default cut
balances), and stage 1 half as much backward work again as stage 0.
"""
import json
import os
import statistics
import tempfile

from ..base.errors import HpctrainError
from ..pipeline import schedule as sched
from ..pipeline.stages import balanced, stage_chunks
from .common import launch, markdown
from .train import model_shape, run_failed

QUICK = {"micro_batches": [2], "steps": 4, "hidden": "32,32", "batch_size": 8}
DEFAULTS = {"micro_batches": [4, 8], "steps": 30, "hidden": "512,512", "batch_size": 64}
MB = 2**20


def settings(args):
    """args with the job's settings filled in: --quick's, or the defaults, where not given."""
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.micro_batches) < 1:
        raise HpctrainError(f"--micro-batches {','.join(map(str, args.micro_batches))}: each at least 1")
    schedules = args.schedules.split(",")
    for name in schedules:
        if name not in sched.SCHEDULES:
            raise HpctrainError(f"--schedules {args.schedules}: {name!r} is not one of {', '.join(sched.SCHEDULES)}")
    if "interleaved" in schedules:
        odd = [m for m in args.micro_batches if m % args.stages]
        if odd:   # its micro-batches go through the chunks in groups of P
            raise HpctrainError(f"--schedules {args.schedules}: the interleaved schedule needs --micro-batches "
                                f"multiples of --stages {args.stages}, not {','.join(map(str, odd))}")
    return schedules


def job_flags(args, extra):
    return ["--hidden", args.hidden, "--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--log-every", str(args.steps), *extra]


def final_record(path):
    with open(path) as f:
        return [json.loads(line) for line in f][-1]


def virtual(args, schedule):
    """V, the chunks a stage: --virtual-stages with the interleaved schedule, 1 with the others."""
    return args.virtual_stages if schedule == "interleaved" else 1


def pipeline_job(args, extra, schedule, micro, tmp):
    """One pipeline run: (its trace's events, its final record)."""
    trace, metrics = os.path.join(tmp, "t.json"), os.path.join(tmp, "m.jsonl")
    chunks = ["--virtual-stages", str(args.virtual_stages)] if schedule == "interleaved" else []
    flags = ["-m", "hpctrain.train", "--pipeline-stages", str(args.stages), "--micro-batches", str(micro),
             "--pipeline-schedule", schedule, *chunks, "--timeline", trace, "--timeline-steps", "0",
             "--metrics", metrics, *job_flags(args, extra)]
    r = launch(args.stages, flags)
    if r.returncode != 0:
        raise run_failed(args.stages, flags, r)
    with open(trace) as f:
        return json.load(f)["traceEvents"], final_record(metrics)


def unpipelined(args, extra, spec, tmp):
    """One rank training the whole model: (parameters + optimizer state bytes, its final record)."""
    metrics = os.path.join(tmp, "one.jsonl")
    flags = ["-m", "hpctrain.train", "--accumulate-steps", str(max(args.micro_batches)), "--shard-optimizer", "off",
             "--metrics", metrics, *job_flags(args, extra), "--steps", "2"]   # its buffers, not its speed
    r = launch(1, flags)
    if r.returncode != 0:
        raise run_failed(1, flags, r)
    record = final_record(metrics)
    return 4 * spec.num_params + record["optimizer_state_bytes"], record


def per_step(spans):
    """{step: [spans in time order]} of one rank."""
    steps = {}
    for e in sorted(spans, key=lambda e: e["ts"]):
        steps.setdefault(e["args"]["step"], []).append(e)
    return steps


def held_at_once(spans, chunk=None):
    """The most micro-batches between a forward's start and its backward's end
    (chunk: of that local chunk only, its spans named `forward 3b`)."""
    live, most = set(), 0
    for e in spans:
        kind, _, micro = e["name"].rpartition(" ")
        if chunk is not None and kind in ("forward", "backward") and _chunk_of(micro) != chunk:
            continue
        if kind == "forward":
            live.add(micro)
            most = max(most, len(live))
        elif kind == "backward":
            live.discard(micro)
    return most


def _chunk_of(micro):
    """The local chunk of a span's micro-batch as trace.py names it: `3` chunk 0, `3b` chunk 1."""
    return ord(micro[-1]) - ord("a") if micro[-1].isalpha() else 0


def stage_ranges(spec, record, args, schedule, stage):
    """The layer ranges [(a, b)] of `stage`'s chunks (one without chunks), from the run's cut."""
    split = record.get("pipeline_split") or ""
    cuts = [0, *(int(c) for c in split.split(",") if c), len(spec.layers)]
    return stage_chunks(cuts, args.stages, stage)


def timing(steps):
    """The bubble (median and best), forward + backward and schedule ms per step, after the warm-up."""
    kept = sorted(steps)[max(1, len(steps) // 10):] if len(steps) > 1 else sorted(steps)
    phase = [sum(e["dur"] for e in steps[n] if e["name"] == "schedule") for n in kept]
    compute = [sum(e["dur"] for e in steps[n] if e["name"].startswith(("forward ", "backward "))) for n in kept]
    bubbles = [1 - c / p for c, p in zip(compute, phase)]
    return {"bubble": statistics.median(bubbles), "bubble_best": min(bubbles),
            "compute_ms": statistics.median(compute) / 1e3, "schedule_ms": statistics.median(phase) / 1e3}


def memory(steps, meta, args, schedule, micro, spec, whole_bytes, chunks):
    """Activations held (measured and the schedule's bound), parameters + optimizer state against unpipelined.
    With V chunks a stage each chunk's (its sets, its layers' bytes), summed over the stage's chunks."""
    v = virtual(args, schedule)
    act_bytes = [4 * args.batch_size * sum(spec.layers[i].train_floats() for i in range(a, b)) for a, b in chunks]
    bounds = sched.chunk_peaks(sched.actions_for(schedule, args.stages, micro, meta["stage"], v), v)
    helds = [max(held_at_once(spans, k if v > 1 else None) for spans in steps.values()) for k in range(v)]
    held, bound = sum(helds), sum(bounds)
    act_mb = sum(h * n for h, n in zip(helds, act_bytes)) / MB
    bound_mb = sum(h * n for h, n in zip(bounds, act_bytes)) / MB
    mine = meta["params_bytes"] + meta["optimizer_state_bytes"]
    return {"held": held, "copies": meta["model_copies"], "held_bound": bound, "act_mb": act_mb, "act_bound_mb": bound_mb,
            "params_opt_mb": mine / MB, "unpipelined_mb": whole_bytes / MB, "vs_unpipelined": mine / whole_bytes,
            "grads_mb": meta["grads_bytes"] / MB}


def stage_rows(events, record, args, schedule, micro, spec, whole_bytes, whole_record):
    """One row per rank (stage) of one run; its peak resident memory (the
    kernel's high-water mark, from its final record), in all and above the
    interpreter with its imports, against the unpipelined rank's."""
    about = {e["pid"]: e["args"] for e in events if e["name"] == "process_name"}
    rows = []
    for pid in sorted(about):
        meta = about[pid]
        steps = per_step(e for e in events if e["ph"] == "X" and e["pid"] == pid)
        peak, above = record["peak_rss_mb_by_worker"][pid], record["peak_rss_above_base_mb_by_worker"][pid]
        chunks, v = stage_ranges(spec, record, args, schedule, meta["stage"]), virtual(args, schedule)
        rows.append({"schedule": schedule, "micro_batches": micro, "stage": meta["stage"],
                     "layers": " ".join("[{},{})".format(a, b) for a, b in chunks), "virtual_stages": v,
                     "bubble_bound": sched.bubble_fraction(args.stages, micro),
                     "bubble_bound_v": sched.bubble_fraction(args.stages, micro, v), **timing(steps),
                     **memory(steps, meta, args, schedule, micro, spec, whole_bytes, chunks),
                     "peak_mb": peak, "peak_above_mb": above,
                     "vs_unpipelined_peak": above / max(whole_record["peak_rss_above_base_mb"], 1e-9),
                     "unpipelined_peak_mb": whole_record["peak_rss_mb"],
                     "unpipelined_peak_above_mb": whole_record["peak_rss_above_base_mb"]})
    return rows


def stage_cuts(events):
    """[0, cut, ..., layers] from the trace's stage metadata."""
    layers = sorted(tuple(e["args"]["layers"]) for e in events if e["name"] == "process_name")
    return [0] + sorted({b for _, b in layers})


def work_per_stage(spec, cuts):
    """(spec.flops() per stage, forward + backward multiply-adds per stage) per sample."""
    flops, work = spec.flops(), spec.train_flops()
    return [sum(flops[a:b]) for a, b in zip(cuts, cuts[1:])], [sum(work[a:b]) for a, b in zip(cuts, cuts[1:])]


COLUMNS = [("schedule", "schedule", "{}"), ("M", "micro_batches", "{}"), ("stage", "stage", "{}"),
           ("layers", "layers", "{}"), ("bubble", "bubble", "{:.3f}"), ("best step", "bubble_best", "{:.3f}"),
           ("(P-1)/(M+P-1)", "bubble_bound", "{:.3f}"), ("V", "virtual_stages", "{}"),
           ("(P-1)/(VM+P-1)", "bubble_bound_v", "{:.3f}"),
           ("F+B ms/step", "compute_ms", "{:.2f}"), ("schedule ms/step", "schedule_ms", "{:.2f}"),
           ("act held", "held", "{}"), ("copies", "copies", "{}"), ("bound", "held_bound", "{}"), ("act MB", "act_mb", "{:.3f}"),
           ("bound MB", "act_bound_mb", "{:.3f}"), ("params+opt MB", "params_opt_mb", "{:.2f}"),
           ("unpipelined MB", "unpipelined_mb", "{:.2f}"), ("x unpipelined", "vs_unpipelined", "{:.2f}"),
           ("grads MB", "grads_mb", "{:.2f}"), ("peak MB", "peak_mb", "{:.1f}"),
           ("above base MB", "peak_above_mb", "{:.1f}"), ("unpipelined peak MB", "unpipelined_peak_mb", "{:.1f}"),
           ("its above base MB", "unpipelined_peak_above_mb", "{:.1f}"),
           ("x unpipelined (above base)", "vs_unpipelined_peak", "{:.2f}")]


def main(args, extra):
    schedules = settings(args)
    from ..flags.cli import parse
    from ..nn import spec_for
    flags = parse(job_flags(args, extra))
    spec = spec_for(flags, *model_shape(flags))
    rows, cuts = [], None
    with tempfile.TemporaryDirectory() as tmp:
        whole, whole_record = unpipelined(args, extra, spec, tmp)
        for micro in args.micro_batches:
            for schedule in schedules:
                events, record = pipeline_job(args, extra, schedule, micro, tmp)
                if schedule != "interleaved":   # its tracks' layers span chunks of other stages
                    cuts = cuts or stage_cuts(events)
                rows += stage_rows(events, record, args, schedule, micro, spec, whole, whole_record)
    flops, work = work_per_stage(spec, cuts or balanced(spec, args.stages))
    if args.json:
        print(json.dumps({"bench": "pipeline", "stages": args.stages, "steps": args.steps, "hidden": args.hidden,
                          "batch_size": args.batch_size, "flags": extra, "stage_flops": flops, "stage_work": work,
                          "rows": rows}))
        return 0
    print(f"pipeline, P = {args.stages}, model {spec.name} --hidden {args.hidden}, micro-batch {args.batch_size}, "
          f"{args.steps} steps (medians after the first tenth)" + (f", flags: {' '.join(extra)}" if extra else ""))
    print("per sample and stage: spec.flops() " + " / ".join(f"{f:,}" for f in flops)
          + "; forward + backward multiply-adds " + " / ".join(f"{w:,}" for w in work))
    print(markdown(rows, COLUMNS))
    return 0
