"""Where the layer list is cut into pipeline stages, and which flags a
pipeline run refuses. Pure: the spec (nn/spec.py) and the flags in, layer
indices and parameter ranges out; never imports MPI.

Stage s runs layers [cut[s], cut[s + 1]) with cut[0] = 0 and cut[P] = the
number of layers; `--pipeline-split i,j,...` gives the inner cut points.
Without it the cut balances the spec's compute estimate,
`spec.train_flops()`: each layer's forward multiply-adds per sample (a
Dense's fan-in x units, a convolution's per output pixel; activations,
pooling and flattening count 0) times 3, forward plus a backward of twice
the forward (weights' and input's gradients), times 2 for the model's first
layer with parameters (no input gradient). The cut minimises the largest
stage's sum, every stage holding at least one layer with parameters (a stage
without any would have nothing to train or average).

Layers lie in the flat buffers in order, so a stage's parameters (and its
non-trainable state) are one slice: `ranges`. Ring mode's fused buckets,
cut to a stage's slice (comm/data_parallel.py), are what the replicas
average, as ring mode averages them, so that with R > 2 the sums are taken
in the same order.

    python -c "from hpctrain.nn import zoo; from hpctrain.pipeline.stages import balanced; print(balanced(zoo.mlp(), 2))"
"""
from bisect import bisect_left, bisect_right
from collections import deque

from ..base.errors import HpctrainError

MAX_TAGS = 30000   # message tags a step's transfers use, below the checkpoints' (pipeline/whole.py: 31000)


# Above this many steps (layers^2 x stages) the dynamic programme gives way to
# the bottleneck search: a 1,000-layer model's advice took a minute (issue 54, 3).
SMALL_CUT = 200_000


def balanced(spec, stages):
    """The cut points [0, ..., len(layers)] that minimise the largest stage's
    training multiply-adds, each stage with a layer that has parameters.
    Short layer lists: dynamic programming over every cut position (the
    cuts every run so far has used); long ones (above SMALL_CUT): the
    smallest feasible largest stage found by bisection (`bottleneck_cuts`),
    the same largest stage, the others cut as early as it allows."""
    flops, n = spec.train_flops(), len(spec.layers)
    has = [bool(spec.layer_tensors[i]) for i in range(n)]
    if n * n * stages > SMALL_CUT:
        return bottleneck_cuts([round(f) for f in flops], has, stages)   # bisection needs integers
    prefix = [0]
    for f in flops:
        prefix.append(prefix[-1] + f)
    inf = float("inf")
    # best[s][j]: (largest stage cost, cut points) for layers [0, j) in s stages
    best = [[(inf, None)] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0, [0])
    for s in range(1, stages + 1):
        for j in range(1, n + 1):
            for i in range(j):
                cost, cuts = best[s - 1][i]
                if cuts is None or not any(has[i:j]):
                    continue
                worst = max(cost, prefix[j] - prefix[i])
                if worst < best[s][j][0]:
                    best[s][j] = (worst, cuts + [j])
    return best[stages][n][1]


def bottleneck_cuts(flops, has, stages):
    """Cut points for `stages` stages of layers costing `flops` (integers),
    each stage with a layer that `has` parameters, whose largest stage is
    the least possible: bisection over that largest cost, each probe two
    farthest-reaching partitions by bisection of the prefix sums (`_jumps`:
    one without the parameters' rule, too few stages: it fails; one with
    it, enough: it fits) or, where they disagree, `fewest_stages` (linear);
    then the cuts from the last back, each as early as the bound and the
    stages left allow. At most O(n log(sum of flops)); None when there are
    fewer layers with parameters than stages."""
    n = len(flops)
    prefix, last, count = [0] * (n + 1), [-1] * (n + 1), [0] * (n + 1)
    for j in range(1, n + 1):
        prefix[j] = prefix[j - 1] + flops[j - 1]
        last[j] = j - 1 if has[j - 1] else last[j - 1]   # a stage [i, j) holds parameters iff i <= last[j]
        count[j] = count[j - 1] + bool(has[j - 1])
    if not 1 <= stages <= count[n]:
        return None
    # A stage with two layers with parameters splits between them at no cost
    # to the largest, so `stages` fit under a bound iff the fewest do.
    following = [n] * (n + 1)   # following[a]: the first layer with parameters at or after a (n: none)
    for a in range(n - 1, -1, -1):
        following[a] = a if has[a] else following[a + 1]

    def fits(bound):
        # two jumps of O(stages log n) settle most probes; the linear programme the rest
        if _jumps(prefix, bound, None, stages) is None:
            return False   # even without the parameters' rule more stages than `stages`
        if _jumps(prefix, bound, following, stages) is not None:
            return True    # a partition that keeps the rule
        return fewest_stages(prefix, last, bound)[n] <= stages

    lo, hi = max(-(-prefix[n] // stages), max(flops)), prefix[n]
    if lo + max(flops) < hi and fits(lo + max(flops)):
        hi = lo + max(flops)   # where layers with parameters are dense enough, the least is within a layer of lo
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    least = fewest_stages(prefix, last, lo)
    cuts = [n]
    for k in range(stages - 1, 0, -1):   # [0, i) must take k stages: least[i] <= k <= its layers with parameters
        j = cuts[-1]
        i = bisect_left(prefix, prefix[j] - lo, 0, j)
        while not least[i] <= k <= count[i]:
            i += 1
        cuts.append(i)
    return [0, *reversed(cuts)]


def _jumps(prefix, bound, following, stages):
    """Stages of at most `bound` each, every one reaching as far as it can
    (a bisection of the prefix sums), if at most `stages` cover the layers,
    else None. following None: no rule on parameters (no partition has
    fewer stages); else each stage holds the first layer with parameters
    from its start, and a tail without any joins the last stage (a
    partition that keeps the rule when it succeeds, not always the fewest)."""
    n, a, count = len(prefix) - 1, 0, 0
    while a < n:
        c = bisect_right(prefix, prefix[a] + bound, a, n + 1) - 1
        if following is not None:
            if following[a] >= c:
                return None   # the stage cannot reach a layer with parameters
            if c < n and following[c] == n:
                return None   # the rest has none: it would have to join this stage, past the bound
        if c == a:
            return None   # one layer over the bound
        count += 1
        if count > stages:
            return None
        a = c
    return count


def fewest_stages(prefix, last, bound):
    """least[j]: the fewest stages, each costing at most `bound` and holding
    a layer with parameters, that cover layers [0, j) (n + 1: none do): a
    sliding-window minimum, since a stage ending at j may start anywhere
    from the first i within the bound to last[j]."""
    n = len(prefix) - 1
    least = [n + 1] * (n + 1)
    least[0] = 0
    window, first, added = deque(), 0, 0
    for j in range(1, n + 1):
        while added <= last[j]:
            while window and least[window[-1]] >= least[added]:
                window.pop()
            window.append(added)
            added += 1
        while prefix[j] - prefix[first] > bound:
            first += 1
        while window and window[0] < first:
            window.popleft()
        if window and least[window[0]] <= n:
            least[j] = least[window[0]] + 1
    return least


def virtual_stages(args):
    """V, the chunks per stage: --virtual-stages, 2 by default with the
    interleaved schedule, 1 with the others."""
    if args.virtual_stages is not None:
        return args.virtual_stages
    return 2 if args.pipeline_schedule == "interleaved" else 1


def stage_chunks(cuts, stages, s):
    """Stage s's chunks as layer ranges [(a, b)], its local chunk k being the
    model's chunk kP + s (cuts: the PV + 1 cut points; one chunk for V = 1)."""
    chunks = len(cuts) - 1
    return [(cuts[c], cuts[c + 1]) for c in range(s, chunks, stages)]


def cut_points(args, spec):
    """This run's cut points [0, ..., len(layers)] (P + 1 of them, or PV + 1
    with V virtual stages: chunk c is layers [cut[c], cut[c + 1])), or
    HpctrainError (one line)."""
    stages, n, virtual = args.pipeline_stages, len(spec.layers), virtual_stages(args)
    chunks = stages * virtual
    with_params = len(spec.param_layers)
    if virtual > 1 and chunks > with_params:
        raise HpctrainError(f"--pipeline-stages {stages} --virtual-stages {virtual}: {chunks} chunks, but the model "
                            f"has {with_params} layers with parameters, one chunk needs at least one")
    if stages > with_params:
        raise HpctrainError(f"--pipeline-stages {stages}: the model has {with_params} layers with parameters, "
                            f"one stage needs at least one")
    if not args.pipeline_split:
        return tied_in_chunks(balanced(spec, chunks), spec, virtual)
    inner = [int(t) for t in args.pipeline_split.split(",")]
    if len(inner) != chunks - 1:
        what = f"{stages} stages x {virtual} virtual stages = {chunks} chunks" if virtual > 1 else f"{stages} stages"
        raise HpctrainError(f"--pipeline-split {args.pipeline_split}: {what} need {chunks - 1} cut "
                            f"points, got {len(inner)}")
    if any(not 0 < c < n for c in inner):
        raise HpctrainError(f"--pipeline-split {args.pipeline_split}: cut points must be layer indices in "
                            f"1..{n - 1} (the model has {n} layers)")
    cuts = [0, *inner, n]
    if any(a >= b for a, b in zip(cuts, cuts[1:])):
        raise HpctrainError(f"--pipeline-split {args.pipeline_split}: cut points must increase")
    for s, (a, b) in enumerate(zip(cuts, cuts[1:])):
        if not any(spec.layer_tensors[i] for i in range(a, b)):
            what = f"chunk {s} (stage {s % stages}'s chunk {s // stages}, " if virtual > 1 else f"stage {s} ("
            raise HpctrainError(f"--pipeline-split {args.pipeline_split}: {what}layers {a}..{b - 1}) "
                                f"has no layer with parameters")
    return tied_in_chunks(cuts, spec, virtual)


def tied_in_chunks(cuts, spec, virtual):
    """cuts, or HpctrainError where --virtual-stages V > 1 puts two chunks
    that use one tied tensor on the same stage (pipeline/tied.py sums a
    tied tensor's uses between stages, one chunk of each: the GPT's
    embedding on the first chunk and its head on the last are on the first
    and last stage, whatever V)."""
    if virtual == 1:
        return cuts
    stages = (len(cuts) - 1) // virtual
    chunk_of = {i: c for c, (a, b) in enumerate(zip(cuts, cuts[1:])) for i in range(a, b)}
    by_tensor = {}
    for t in spec.ties:
        by_tensor.setdefault((t.owner, t.tensor), {chunk_of[t.owner]}).add(chunk_of[t.user])
    for (owner, tensor), chunks in by_tensor.items():
        on_stage = {}
        for c in sorted(chunks):
            if c % stages in on_stage:
                raise HpctrainError(f"--virtual-stages {virtual}: chunks {on_stage[c % stages]} and {c}, both on "
                                    f"stage {c % stages}, use layer {owner}'s tied {tensor!r}; a tied tensor's "
                                    f"uses need one chunk a stage (another --virtual-stages, or --pipeline-split "
                                    f"keeping them together)")
            on_stage[c % stages] = c
    return cuts


def cuts_for(args, world, spec):
    """The cut points of a pipeline run (None without --pipeline-stages), or
    HpctrainError for flags it cannot run with. Every rank alike (run/startup.py)."""
    stages = args.pipeline_stages
    interleaved = args.pipeline_schedule == "interleaved"
    if args.virtual_stages is not None and not interleaved:
        raise HpctrainError(f"--virtual-stages {args.virtual_stages} needs --pipeline-schedule interleaved "
                            f"(the {args.pipeline_schedule} schedule runs one chunk per stage)")
    if interleaved and stages == 1:
        raise HpctrainError("--pipeline-schedule interleaved needs --pipeline-stages P > 1")
    if interleaved and virtual_stages(args) > 1 and getattr(args, "compression", "none") != "none":
        # a stage's replicas exchange one chunk's part of the wire compressed (pipeline/stage_compression.py)
        raise HpctrainError(f"--compression {args.compression} with --pipeline-schedule interleaved "
                            f"--virtual-stages {virtual_stages(args)}: not built (compression takes one chunk a "
                            f"stage; use 1f1b or gpipe, or --compression none)")
    if stages == 1:
        if args.micro_batches > 1:
            raise HpctrainError("--micro-batches needs --pipeline-stages P > 1 (one stage: --accumulate-steps)")
        if args.pipeline_split:
            raise HpctrainError("--pipeline-split needs --pipeline-stages P > 1")
        return None
    if args.mode == "ps":
        raise HpctrainError("--pipeline-stages is for --mode ring (a pipeline's stages average their "
                            "gradients over their replicas by allreduce)")
    if args.accumulate_steps > 1:
        raise HpctrainError("--pipeline-stages with --accumulate-steps: use --micro-batches M instead "
                            "(the same samples per step)")
    if world % stages:
        raise HpctrainError(f"--pipeline-stages {stages} does not divide the {world} ranks")
    if interleaved and args.micro_batches % stages:
        # Megatron's rule: groups of P micro-batches go through a stage's chunks in turn
        raise HpctrainError(f"--pipeline-schedule interleaved needs --micro-batches a multiple of "
                            f"--pipeline-stages (got --micro-batches {args.micro_batches}, --pipeline-stages "
                            f"{stages})")
    if 2 * virtual_stages(args) * args.micro_batches > MAX_TAGS:   # engine.py: a tag per message of a step
        raise HpctrainError(f"--virtual-stages {virtual_stages(args)} x --micro-batches {args.micro_batches}: more "
                            f"than {MAX_TAGS // 2} micro-batch chunks a step")
    if args.overlap == "on":   # auto: a pipeline runs without the thread
        raise HpctrainError("--pipeline-stages with --overlap on: a stage averages its gradient after its "
                            "last micro-batch's backward, with no communication thread to overlap it")
    return cut_points(args, spec)


def ranges(spec, a, b, of="params"):
    """(lo, hi) of layers [a, b)'s slice of the flat parameter (or state) buffer."""
    tensors = spec.layer_tensors if of == "params" else spec.layer_state
    before = [t for i in range(a) for t in tensors[i]]
    inside = [t for i in range(a, b) for t in tensors[i]]
    lo = before[-1][3] if before else 0
    return lo, inside[-1][3] if inside else lo
