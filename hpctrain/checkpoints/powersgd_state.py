"""--compression powersgd's state in and out of checkpoints: each worker's
error feedback (what it has not sent yet: its own, so one row per worker)
and the warm-started Qs (the same on every rank), so that a resume on the
same number of workers is bit-exact. fp16 and bf16 keep no state.

In a checkpoint folder (checkpoints/named.py):
- `powersgd.error`, a named tensor (W, n) of the parameters' dtype (W
  workers, n the model's num_params; named as the optimizer's state is,
  `adam.m/...`: its owner's name, a dot, the key), written by its owners
  like any sharded tensor: worker r writes the box of row r into its own
  rank file (a pipeline: the rank of replica r and stage s the row's
  slice of its stage, [lo, hi) of the model's flat parameters), so the
  chief writes its own row and no other; on resume at the same W each
  worker reads back its own box;
- `compression/q` (the Qs of every compressed matrix in model order),
  written once by the chief into the index, and the attributes
  `compression_state` (the index's datasets: `q`), `compression_workers`
  (W) and `compression_layout` (which matrices at which rank:
  optim/compression_math.powersgd_layout's key).
A checkpoint without them (an older one, or one of another --compression)
loads as before. The old layout (a flat file, or a folder an hpctrain
before this one wrote): the error feedback as one flat `compression/error`
(W x n floats, worker order) that the chief wrote whole and that the chief
alone reads and scatters (`decide` says which layout a checkpoint has).

On resume the chief decides, in one line when anything is not carried over:
- another number of workers: the error feedback starts at zero (each row
  was one worker's own remainder), the Qs are kept;
- another --powersgd-rank or --powersgd-min-rate (another layout): the Qs
  are drawn afresh from the seed;
- a checkpoint of another --compression: PowerSGD starts afresh (error at
  zero, Qs from the seed); a PowerSGD checkpoint resumed with another
  --compression: its state is not used.
Nothing is refused: each case is a run that goes on, said so.

Raw float32 buffers through Scatter/Bcast (and the parts' files), no
pickle; every wait under the watchdog.

    mpirun -n 2 python -m hpctrain.mnist --compression powersgd --checkpoint-dir ckpt --checkpoint-every 50
"""
import sys
from typing import NamedTuple

import numpy as np

from ..base import device
from ..state.parts import Part

ERROR = "powersgd.error"


class Saved(NamedTuple):
    """PowerSGD's state as Checkpoints.save_parts takes it: this rank's
    `parts` (its box of ERROR, written beside its other parts), `tensors`
    ({name: shape}: ERROR's whole shape), and the chief's `arrays` (the
    index's `compression/<name>`) and `attrs` (nothing elsewhere)."""
    parts: list
    tensors: dict
    arrays: dict
    attrs: dict


def error_part(error, row, lo=0):
    """A worker's box of ERROR: row `row`'s [lo, lo + error.size), held in
    `error` (its error feedback: the whole row in ring mode, a stage's
    slice of it in a pipeline)."""
    return Part(ERROR, ((row, row + 1), (lo, lo + int(error.size))), error.reshape(1, -1), True)


def saved(world, error, row, workers, n, q, layout, lo=0):
    """PowerSGD's state of this rank, a Saved (not collective): error its
    error feedback (None: --powersgd-error-feedback off) over [lo, lo +
    error.size) of row `row` of W = `workers` rows of n floats; q: the
    whole Qs on the chief (ignored elsewhere); layout: the layout's key."""
    parts = [error_part(error, row, lo)] if error is not None else []
    tensors = {ERROR: (int(workers), int(n))} if error is not None else {}
    if not world.chief:
        return Saved(parts, tensors, {}, {})
    device.synchronize(world.xp)
    return Saved(parts, tensors, {"q": np.ascontiguousarray(device.to_host(q))},
                 {"compression_workers": int(workers), "compression_layout": layout})


def of_ring(world, comm, exchange, error, layout):
    """saved() of a ring worker (comm: the workers), or None for an exchange without state."""
    if getattr(exchange, "kind", None) != "powersgd":
        return None
    return saved(world, error, comm.Get_rank(), comm.Get_size(), 0 if error is None else error.size,
                 exchange.q, layout)


def held_error(ckpt):
    """(rows, floats, by box) of checkpoint `ckpt`'s error feedback (the
    chief's read_back.Checkpoint), or None: the named tensor ERROR (each
    worker reads its own box), or the old flat `compression/error` (its
    rows the `compression_workers` attribute; the chief scatters it)."""
    if ckpt.named and ERROR in ckpt.source.tensors:
        shape = ckpt.source.tensors[ERROR][0]
        return int(shape[0]), int(np.prod(shape, dtype=np.int64)), True
    if "error" in ckpt.compression_state:
        return ckpt.attrs.get("compression_workers"), int(ckpt.compression_state["error"].size), False
    return None


def decide(ckpt, kind, has_error, layout, workers, n, q_size):
    """(keep the error rows, keep the Qs, the line or None): what of
    checkpoint `ckpt`'s state this run (--compression `kind`, `workers`
    workers, n parameters, its layout key and Q size) goes on from."""
    state, attrs = ckpt.compression_state, ckpt.attrs
    held = held_error(ckpt)
    was = attrs.get("compression", "none")
    if kind != "powersgd":
        line = (f"{ckpt.name} holds --compression powersgd's state (error feedback, Q); this run has "
                f"--compression {kind}: it is not used") if state or held else None
        return False, False, line
    if not state and not held:
        return False, False, (f"{ckpt.name} was written with --compression {was}: PowerSGD starts afresh "
                              f"(error feedback at zero, Q from the seed)")
    notes = []
    rows, size, _ = held or (None, 0, False)
    keep_error = has_error and held is not None and rows == workers and size == workers * n
    if has_error and not keep_error:
        if held is None:
            notes.append("it has no error feedback (written with --powersgd-error-feedback off): it starts at zero")
        elif rows != workers:
            notes.append(f"its error feedback is {rows} workers' own, this run has {workers}: it starts at zero")
        else:
            notes.append(f"its error feedback holds {size} floats, not {workers} x {n}: it starts at zero")
    elif not has_error and held is not None:
        notes.append("this run has --powersgd-error-feedback off: its error feedback is dropped")
    keep_q = "q" in state and attrs.get("compression_layout") == layout and state["q"].size == q_size
    if not keep_q:
        notes.append("its Qs are of other matrices or another rank (--powersgd-rank, --powersgd-min-rate): "
                     "drawn afresh from the seed")
    line = f"{ckpt.name}: PowerSGD state: {'; '.join(notes)}" if notes else None
    return keep_error, keep_q, line


def decided(world, comm, resume, kind, has_error, layout, workers, n, q_size):
    """Collective over comm: the chief's `decide` (its line printed) on
    every rank, as (keep the error, keep the Qs, each worker reads its own
    box of ERROR: else the chief scatters the old flat rows)."""
    decision = np.zeros(3, np.int64)
    if world.chief:
        keep_error, keep_q, line = decide(resume.checkpoint, kind, has_error, layout, workers, n, q_size)
        held = held_error(resume.checkpoint)
        decision[:] = keep_error, keep_q, bool(held and held[2])
        if line:
            print(f"hpctrain: warning: {line}", file=sys.stderr, flush=True)
    with world.waiting("checkpoint broadcast (compression decision)", peer=world.cluster.chief_rank):
        comm.Bcast(decision, root=world.chief_in(comm))
    return tuple(bool(d) for d in decision)


def restore(world, comm, resume, exchange, error, layout, kind, checkpoints):
    """Collective over comm (the workers): the checkpoint's state into
    every rank's exchange, as `decide` says: each worker its own error row
    (its box of ERROR, read by `checkpoints`, checkpoints/resume.Checkpoints,
    as every part is; an old flat one: the chief's Scatter), every rank the
    Qs (Bcast). kind: this run's --compression; error: this rank's error
    view or None."""
    stateful = getattr(exchange, "kind", None) == "powersgd"
    n = 0 if error is None else int(error.size)
    keep_error, keep_q, by_box = decided(world, comm, resume, kind, error is not None, layout, comm.Get_size(), n,
                                         int(exchange.q.size) if stateful else 0)
    if not stateful:
        return
    root, xp, ckpt = world.chief_in(comm), world.xp, resume.checkpoint
    if keep_error and by_box:
        checkpoints.restore(comm, resume, [error_part(error, comm.Get_rank())])
    elif keep_error:
        mine = np.empty(n, error.dtype)
        rows = np.ascontiguousarray(ckpt.compression_state["error"], error.dtype) if world.chief else None
        with world.waiting("checkpoint scatter (compression error feedback)", peer=world.cluster.chief_rank):
            comm.Scatter(rows, mine, root=root)
        error[...] = xp.asarray(mine)
    if keep_q:
        q = np.ascontiguousarray(ckpt.compression_state["q"], exchange.q.dtype) if world.chief \
            else np.empty(exchange.q.size, exchange.q.dtype)
        with world.waiting("checkpoint broadcast (compression Q)", peer=world.cluster.chief_rank):
            comm.Bcast(q, root=root)
        exchange.q[...] = xp.asarray(q)
    device.synchronize(xp)
