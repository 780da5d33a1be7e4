"""The start-up memory check (run/startup.py calls check_memory): what one
rank will hold at least, for ring mode at its ZeRO stage (`ring_needs`) or
for a pipeline's heaviest stage (`stage_needs`), against --memory-budget or
this node's available memory shared among its ranks; a refusal is one line
naming what would fit (a higher ZeRO stage, more ranks, a pipeline). The
evaluations are counted: they run forward no more samples at once than
`held_batch`.

    mpirun -n 1 python -m hpctrain.train --hidden 4096,4096,4096 --memory-budget 0.45
"""
from ..comm.fusion import bucket_bounds, ready_from
from ..data.arrays import memory_available
from ..base.errors import HpctrainError
from ..nn import threads
from ..nn.grad_slots import slot_elements
from ..nn.sequential import eval_forward
from ..nn.sharded_store import zero3_slot_elements
from ..base.precision import FLOAT32

STATES = {"sgd": 0, "momentum": 1, "adam": 2}   # optimizer state buffers per parameter


def held_batch(args, spec):
    """Samples whose activations a rank holds at once: a training step's
    --batch-size, or where it is larger the evaluations' forward batch
    (nn/sequential.eval_forward: whole row tiles, so a batch of 16 images
    evaluates 48 at a time), which holds no more per sample than training."""
    return max(args.batch_size, eval_forward(spec, args.batch_size))


def stage_needs(args, spec, cuts, replicas=1, sharded=False):
    """Bytes each stage of a pipeline cut at `cuts` needs at least (nn/spec.py
    memory_bytes: its layers' three flat buffers and optimizer state, 1/R of
    it sharded over R replicas, and the schedule's micro-batches in flight:
    pipeline/schedule.py chunk_peaks; with --virtual-stages V, `cuts` the
    PV + 1 of the chunks, a stage's its chunks' sum)."""
    from ..pipeline.schedule import actions_for, chunk_peaks
    from ..pipeline.stages import stage_chunks, virtual_stages
    virtual = virtual_stages(args)
    stages = (len(cuts) - 1) // virtual
    states = STATES[args.optimizer] / (replicas if sharded else 1)
    needs = []
    for s in range(stages):
        copies = chunk_peaks(actions_for(args.pipeline_schedule, stages, args.micro_batches, s, virtual), virtual)
        needs.append(sum(spec.memory_bytes(held_batch(args, spec), states, a=a, b=b, buffers=3, copies=n,
                                           threads=threads.count())
                         for (a, b), n in zip(stage_chunks(cuts, stages, s), copies)))
    return needs


MOST_TRIED = 8   # stage counts fitting_pipeline tries one by one from its lower bound, before it bisects


def fitting_pipeline(args, spec, budget, base):
    """(P, bytes of its heaviest stage) for the fewest balanced pipeline stages
    whose heaviest stage fits `budget` beside `base`, or None. A bounded
    search (trying every P took O(layers^4): a minute for 1,000 layers,
    never an answer for 100,000; issue 54, 3): the stages' needs add up to
    at least the whole model's with one copy of its activations, so no P
    below whole / room fits and the search starts there; it tries
    MOST_TRIED counts in turn, then the finest pipeline (one layer with
    parameters per chunk): if that does not fit, none does; else it bisects
    between (a stage's layers, and so its need, shrink as P grows, give or
    take the cut's rounding). At most MOST_TRIED + 1 + log2(layers) cuts."""
    from ..pipeline.stages import balanced, virtual_stages
    virtual = virtual_stages(args)
    room = budget - base
    if room <= 0:
        return None
    whole = spec.memory_bytes(held_batch(args, spec), STATES[args.optimizer], buffers=3, threads=threads.count())
    lowest = max(2, -(-int(whole) // int(room)))
    most = len(spec.param_layers) // virtual
    if args.pipeline_schedule == "interleaved":   # micro-batches in groups of P (pipeline/stages.py refuses others)
        counts = [p for p in range(lowest, min(most, args.micro_batches) + 1) if args.micro_batches % p == 0]
    else:
        counts = range(lowest, most + 1)

    def heaviest(stages):
        return max(stage_needs(args, spec, balanced(spec, stages * virtual)))

    for stages in counts[:MOST_TRIED]:
        need = heaviest(stages)
        if base + need <= budget:
            return stages, need
    rest = counts[MOST_TRIED:]
    if not rest:
        return None
    fits = heaviest(rest[-1])   # the need of rest[hi], which fits: kept, not cut again
    if base + fits > budget:
        return None
    lo, hi = 0, len(rest) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        need = heaviest(rest[mid])
        if base + need <= budget:
            hi, fits = mid, need
        else:
            lo = mid + 1
    return rest[hi], fits


def ring_needs(args, spec, replicas, stage, counted=None):
    """Bytes one rank of ring mode needs at least (nn/spec.py memory_bytes)
    at ZeRO stage `stage` over `replicas` ranks: the optimizer state 1/R
    from stage 1; from stage 2 the gradient's slots (nn/grad_slots.py: one,
    two with --overlap on) and with --clip-norm its 1/R shard; at stage 3 the
    parameters too (nn/sharded_store.py: shared slots and a tied home's;
    no gradient slot for a bucket of Linear layers, written over its parameters).
    counted: a dict that keeps the buckets and slots between calls for one
    model (fitting_stage asks for ~20 rank counts: seconds each at 100,000
    layers)."""
    buffers, n = 2, spec.num_params   # the parameters and the gradient
    counted = {} if counted is None else counted
    if stage >= 2 and n:
        if "buckets" not in counted:
            counted["buckets"] = bucket_bounds(n, int(args.fusion_mb * (1 << 20)) // FLOAT32.grads.itemsize,
                                               ready_from(spec.layer_ranges))
        buckets = counted["buckets"]
        shared = 2 if args.overlap == "on" and replicas > 1 and len(buckets) > 1 else 1
        if (stage, shared) not in counted:
            # stage 3: no gradient slot for a bucket whose gradient is written over its parameters
            counted[stage, shared] = zero3_slot_elements(spec, buckets, shared) if stage == 3 else \
                (slot_elements(spec, buckets, shared), 0)
        grad_slots, param_slots = counted[stage, shared]
        # the summed gradient's 1/R parts kept only for --clip-norm (comm/data_parallel.Summed)
        grad_shard = n / replicas if args.clip_norm is not None else 0
        buffers = (1 if stage == 2 else (param_slots + n / replicas) / n) + (grad_slots + grad_shard) / n
    if args.thread_split == "samples":   # every slice but the first its own gradient (nn/sample_split.py)
        buffers += args.thread_slices - 1
    return spec.memory_bytes(held_batch(args, spec), STATES[args.optimizer] / (replicas if stage else 1),
                             buffers=buffers, threads=threads.count())


MOST_RANKS = 1024   # how far fitting_stage looks for a number of ranks


def fitting_stage(args, spec, replicas, stage, budget, base):
    """What a refusal adds for ring mode: the smallest ZeRO stage above
    `stage` that fits `budget` per rank on these `replicas`, else the
    fewest ranks (a power of two) on which a stage 2 or 3 does, and the
    smaller of those stages; "" if none."""
    counted = {}
    for higher in range(stage + 1, 4):
        need = base + ring_needs(args, spec, replicas, higher, counted) if replicas > 1 else None
        if need is not None and need <= budget:
            return f"; --zero {higher} would fit ({need / 2**30:.2f} GiB per rank)"
    ranks = 2
    while ranks <= MOST_RANKS:
        for higher in (2, 3):
            need = base + ring_needs(args, spec, ranks, higher, counted)
            if ranks > replicas and need <= budget:
                return f"; --zero {higher} on {ranks} ranks would fit ({need / 2**30:.2f} GiB per rank)"
        ranks *= 2
    return ""


def check_memory(args, ranks_on_node, spec, cuts, replicas, sharded, steps=None):
    """Refuse up front a model or batch that cannot fit (a traceback from deep
    inside NumPy, or the OOM killer, an hour later is worse): what this rank
    holds already (the interpreter and its imports) and what it will (the
    model, or its pipeline stage's part: the heaviest) against its budget,
    --memory-budget or this node's available memory shared among its ranks.
    sharded: the ZeRO stage over the `replicas` (1: the optimizer state 1/R;
    2: the gradient too, its shard and its slots, nn/grad_slots.py; 3: the
    parameters too, nn/sharded_store.py). A
    refusal names the pipeline that would fit. Returns the bytes it expects
    this rank to need (where it fits)."""
    from ..optim.optimizers import prepare
    from ..pipeline.stages import ranges, stage_chunks, virtual_stages
    from ..report.step_stats import rss_bytes
    if cuts:
        needs = stage_needs(args, spec, cuts, replicas, sharded)
        heaviest = max(range(len(needs)), key=needs.__getitem__)
        model = needs[heaviest]
        stages = len(needs)
        lo, hi = ranges(spec, cuts[heaviest], cuts[heaviest + 1])   # its first chunk (the optimizers' size)
        prepare(args.optimizer, hi - lo, steps, args.single_pass)
    else:
        model = ring_needs(args, spec, replicas, sharded)
        prepare(args.optimizer, spec.num_params, steps, args.single_pass)
    base = rss_bytes()   # the interpreter, its imports, and what the optimizer will load (prepare)
    need = base + model
    if args.memory_budget is not None:
        budget = args.memory_budget * 2**30
        where = f"--memory-budget {args.memory_budget:g} GiB per rank"
    else:
        have = memory_available()
        if have is None:
            return need
        budget = have / ranks_on_node
        where = (f"this node has {have / 2**30:.1f} GiB available for {ranks_on_node} "
                 f"rank{'s' if ranks_on_node > 1 else ''}")
    if need <= budget:
        return need   # (the start-up line says it: run/startup.py)
    what = f"--hidden {','.join(map(str, args.hidden))}" if args.model == "mlp" else f"--model {args.model}"
    part = (f" for its heaviest stage ({heaviest}: layers "
            + " ".join(f"[{a},{b})" for a, b in stage_chunks(cuts, stages, heaviest)) + ")" if cuts else "")
    line = (f"{what} with --batch-size {args.batch_size} needs at least {need / 2**30:.2f} GiB per rank{part} "
            f"(parameters, gradients, optimizer state, activations, and {base / 2**30:.2f} GiB this process "
            f"holds already); {where}")
    if not cuts and args.mode == "ring":
        line += fitting_stage(args, spec, replicas, sharded, budget, base)
    fits = fitting_pipeline(args, spec, budget, base)
    if fits and fits[0] > (stages if cuts else 1):
        line += (f"; --pipeline-stages {fits[0]} would fit (its heaviest stage needs "
                 f"{(base + fits[1]) / 2**30:.2f} GiB)")
    elif not fits:
        line += ("; no pipeline of this model fits either (one layer with parameters per stage at most)"
                 if virtual_stages(args) == 1 else f"; no interleaved pipeline of this model with --virtual-stages "
                 f"{virtual_stages(args)} and --micro-batches {args.micro_batches} fits either (one layer with "
                 f"parameters per chunk at most, P dividing M)")
    raise HpctrainError(line)
