"""Each layout's state as parts (the contract in state/__init__.py): one
function per way a rank holds the run's state, all built on one step, the
parts of a flat buffer laid out by a (possibly tensor-split) spec
(`buffer_parts`), and one rule for who writes a box (`writes`, over
`pieces` where every replica holds the same values).

- `ring`: ring mode, every rank a replica of the model: plain (each holds
  everything; replica r writes the r-th of N equal pieces of the flat
  layout, so writing is parallel and even without ZeRO, whatever the
  tensors' sizes), --zero 1/2 (the optimizer state: the owned
  ranges, `optimizer.ranges`), --zero 3 (the parameters too: the shard's
  ranges), and any of them with --tensor-parallel (a local tensor is
  `groups` boxes of the whole one along the cut's axis: a box of a ZeRO
  range of the local buffer -> boxes in local coordinates -> boxes of the
  whole tensor; a tensor every tensor rank holds alike is written by
  tensor rank 0's replicas alone);
- `pipeline`: a stage's chunks, each a contiguous range of the (split)
  spec's flat layout, the optimizer state sharded or not over the stage's
  replicas; a tied tensor's copy on a user's stage is held outside the
  chunk's buffer (pipeline/tied.py) and is not a part: its owner's is;
- `ps_server`: a parameter server's ranges of the flat parameters and its
  optimizer state (compact, as the server holds them); `ps_worker`: a
  worker's copy (written by no one) and the chief's non-trainable state.

The non-trainable state (batch-norm statistics) follows each replica's own
batches; the model's is the chief's, as checkpoints and --save always held
it: written by replica 0 (tensor rank 0, a pipeline stage's replica 0).

Names: the model's (`layer0/W`, `layer1/mean`) and the optimizer's state
under `<optimizer>.<key>/` (`adam.m/layer0/W`).

    mpirun -n 4 python -m mpi4py -m pytest -q --only-mpi tests/test_state_layouts.py
"""
from .parts import Part, flat_parts


def _whole(part, cut, t):
    """A part of tensor rank t's local tensor (cut by `cut`, nn/tensor_parallel.Cut)
    as parts of the whole tensor: along the axis, the local tensor is
    `groups` blocks, block g at [g·block + bounds[t], ... + width) of the whole."""
    lo, hi = part.box[cut.axis]
    width = cut.bounds[t + 1] - cut.bounds[t]
    out = []
    for g in range(cut.groups):
        a, b = max(lo, g * width), min(hi, (g + 1) * width)
        if a >= b:
            continue
        start = g * cut.block + cut.bounds[t] + a - g * width
        box = part.box[:cut.axis] + ((start, start + b - a),) + part.box[cut.axis + 1:]
        index = (slice(None),) * cut.axis + (slice(a - lo, b - lo),)
        out.append(Part(part.name, box, part.view[index], part.writer))
    return out


def buffer_parts(spec, ranges, buffer, prefix="", of="params"):
    """The parts of `buffer`, which holds back to back the ranges `ranges` of
    `spec`'s flat layout (of: "params" or "state"), as boxes of the whole
    model's tensors (spec: the rank's, tensor-split or not; a split spec's
    tensors are the whole ones' cuts, by the same names). Every part's
    writer flag is True: the layout's `writes` sets it."""
    tensors = spec.tensors if of == "params" else spec.state
    parts = flat_parts(tensors, ranges, buffer, True, prefix)
    cuts = spec.cuts if of == "params" else {}
    if not cuts:
        return parts
    t = spec.tensor.rank
    cut = {prefix + name: c for name, c in cuts.items()}
    return [q for p in parts for q in (_whole(p, cut[p.name], t) if p.name in cut else [p])]


def writes(parts, spec, mine, prefix=""):
    """The parts with their writer flags: `mine` (this rank writes them,
    of the replicas holding the same boxes: `pieces`' piece, a sharded
    layout's own boxes, or replica 0's), except that of a tensor group's
    ranks, a tensor that every rank holds whole (not cut) is written by
    tensor rank 0's alone. prefix: the parts' names' before the tensor's."""
    t = spec.tensor.rank if spec.tensor is not None else 0
    return [p._replace(writer=mine and not (t and p.name[len(prefix):] not in spec.cuts)) for p in parts]


def pieces(spec, lo, hi, buffer, replica, replicas, prefix="", spread=True):
    """The parts of `buffer`, which holds [lo, hi) of `spec`'s flat layout
    alike on every replica, each piece of it written by one replica: the
    range cut into `replicas` contiguous pieces of equal size, replica r
    writing the r-th, so each writes 1/N of the bytes whatever the
    tensors' sizes (one writer per whole tensor put an MLP's first layer,
    60% of it, on one rank). Not `spread`: one piece, replica 0's, where
    the writers send the chief their parts, which replica 0 then holds
    already."""
    n = replicas if spread else 1
    out = []
    for r in range(n):
        a, b = lo + (hi - lo) * r // n, lo + (hi - lo) * (r + 1) // n
        if a < b:
            out += writes(buffer_parts(spec, [(a, b)], buffer[a - lo:b - lo], prefix), spec, r == replica, prefix)
    return out


def state_parts(spec, buffer, ranges, replica):
    """The non-trainable state's parts: the chief's replica's (replica 0, tensor rank 0) written."""
    t = spec.tensor.rank if spec.tensor is not None else 0
    return [p._replace(writer=replica == 0 and t == 0) for p in buffer_parts(spec, ranges, buffer, of="state")]


def optimizer_parts(spec, optimizer, name, replica, replicas, base=0, size=None, spread=True):
    """The optimizer's state arrays as parts `<name>.<key>/<tensor>`: over the
    owned ranges of a sharded optimizer (compact; each replica writes its
    own), else the whole buffer [base, base + size) (size: the spec's
    num_params; written as `pieces` cuts it)."""
    size = spec.num_params if size is None else size
    if getattr(optimizer, "ranges", None) is None:
        return [p for key, array in sorted(optimizer.state().items())
                for p in pieces(spec, base, base + size, array, replica, replicas, f"{name}.{key}/", spread)]
    ranges = [(base + lo, base + hi) for lo, hi in optimizer.ranges]
    return [p for key, array in sorted(optimizer.state().items())
            for p in writes(buffer_parts(spec, ranges, array, prefix=f"{name}.{key}/"), spec, True, f"{name}.{key}/")]


def ring(spec, params, state, optimizer, name, replica, replicas, param_shard=None, spread=True):
    """Ring mode's parts on this rank (loops/ring_step.RingStep's buffers):
    params the model's (None with --zero 3: `param_shard`,
    nn/sharded_store.ParamShard), state its non-trainable state, optimizer
    ring.optimizer (sharded or not), name the optimizer's (plan.optimizer.name);
    replica, replicas: this rank's place among the data-parallel replicas;
    spread: `pieces`'."""
    out = writes(buffer_parts(spec, param_shard.ranges, param_shard.buf), spec, True) if param_shard is not None \
        else pieces(spec, 0, spec.num_params, params, replica, replicas, spread=spread)
    out += optimizer_parts(spec, optimizer, name, replica, replicas, spread=spread)
    return out + state_parts(spec, state, [(0, spec.num_state)], replica)


def pipeline(spec, chunks, optimizers, name, replica, replicas, spread=True):
    """A pipeline stage's parts (loops/pipe.py): its chunks (pipeline/stage.Stage:
    `params` over [lo, hi) of the (split) spec's flat layout, `state` over
    [state_lo, state_hi)), each chunk's optimizer (sharded over the stage's
    replicas or not, its ranges in the chunk's coordinates); replica,
    replicas: this rank's place among the stage's replicas; spread: `pieces`'."""
    out = []
    for chunk, optimizer in zip(chunks, optimizers):
        out += pieces(spec, chunk.lo, chunk.hi, chunk.params, replica, replicas, spread=spread)
        out += optimizer_parts(spec, optimizer, name, replica, replicas, chunk.lo, chunk.hi - chunk.lo, spread)
        out += state_parts(spec, chunk.state, [(chunk.state_lo, chunk.state_hi)], replica)
    return out


def ps_server(spec, ranges, params, state, name):
    """A parameter server's parts: `params`, its `ranges` of the flat
    parameters back to back (comm/ps/placement.place), and `state` {key:
    array in the same compact layout}, its optimizer's (name: the optimizer's)."""
    out = buffer_parts(spec, ranges, params)
    for key, array in sorted(state.items()):
        out += buffer_parts(spec, ranges, array, prefix=f"{name}.{key}/")
    return out


def ps_worker(spec, params, state, chief):
    """A ps worker's parts: its copy of the parameters (the servers write
    theirs) and its non-trainable state (the chief's written)."""
    return [p._replace(writer=False) for p in buffer_parts(spec, [(0, spec.num_params)], params)] + \
        [p._replace(writer=chief) for p in buffer_parts(spec, [(0, spec.num_state)], state, of="state")]
