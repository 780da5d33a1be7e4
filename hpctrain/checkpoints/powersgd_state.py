"""--compression powersgd's state in and out of checkpoints: each worker's
error feedback (what it has not sent yet: its own, so one row per worker)
and the warm-started Qs (the same on every rank), so that a resume on the
same number of workers is bit-exact. fp16 and bf16 keep no state.

In the file (checkpoints/file.py): `compression/error` (float32, W rows of
the model's num_params, worker order), `compression/q` (float32, every
compressed matrix's Q in model order), and the attributes
`compression_workers` (W) and `compression_layout` (which matrices at which
rank: optim/compression_math.powersgd_layout's key). A checkpoint without them (an
older one, or one of another --compression) loads as before.

On resume the chief decides, in one line when anything is not carried over:
- another number of workers: the error feedback starts at zero (each row
  was one worker's own remainder), the Qs are kept;
- another --powersgd-rank or --powersgd-min-rate (another layout): the Qs
  are drawn afresh from the seed;
- a checkpoint of another --compression: PowerSGD starts afresh (error at
  zero, Qs from the seed); a PowerSGD checkpoint resumed with another
  --compression: its state is not used.
Nothing is refused: each case is a run that goes on, said so.

Raw float32 buffers through Gather/Scatter/Bcast, no pickle; every wait
under the watchdog.

    mpirun -n 2 python -m hpctrain.mnist --compression powersgd --checkpoint-dir ckpt --checkpoint-every 50
"""
import sys

import numpy as np

from ..base import device


def gather(world, comm, exchange, error, layout):
    """Collective over comm (the workers, the chief its rank world.chief_in):
    (arrays, attributes) for Checkpoints.save on the chief, ({}, {}) elsewhere
    and for an exchange without state. error: this rank's error over the
    model's parameters (a view of exchange.error), or None; layout: the
    layout's key."""
    if getattr(exchange, "kind", None) != "powersgd":
        return {}, {}
    root, workers = world.chief_in(comm), comm.Get_size()
    arrays = {}
    device.synchronize(world.xp)
    if error is not None:
        mine = np.ascontiguousarray(device.to_host(error))
        rows = np.empty(workers * mine.size, mine.dtype) if world.chief else None
        with world.waiting("checkpoint gather (compression error feedback)", peer=world.cluster.chief_rank):
            comm.Gather(mine, rows, root=root)
        arrays["error"] = rows
    if not world.chief:
        return {}, {}
    arrays["q"] = np.ascontiguousarray(device.to_host(exchange.q))
    return arrays, {"compression_workers": int(workers), "compression_layout": layout}


def decide(ckpt, kind, has_error, layout, workers, n, q_size):
    """(keep the error rows, keep the Qs, the line or None): what of
    checkpoint `ckpt`'s state this run (--compression `kind`, `workers`
    workers, n parameters, its layout key and Q size) goes on from."""
    state, attrs = ckpt.compression_state, ckpt.attrs
    was = attrs.get("compression", "none")
    if kind != "powersgd":
        line = (f"{ckpt.name} holds --compression powersgd's state (error feedback, Q); this run has "
                f"--compression {kind}: it is not used") if state else None
        return False, False, line
    if not state:
        return False, False, (f"{ckpt.name} was written with --compression {was}: PowerSGD starts afresh "
                              f"(error feedback at zero, Q from the seed)")
    notes = []
    rows = attrs.get("compression_workers")
    keep_error = has_error and "error" in state and rows == workers and state["error"].size == workers * n
    if has_error and not keep_error:
        if "error" not in state:
            notes.append("it has no error feedback (written with --powersgd-error-feedback off): it starts at zero")
        elif rows != workers:
            notes.append(f"its error feedback is {rows} workers' own, this run has {workers}: it starts at zero")
        else:
            notes.append(f"its error feedback holds {state['error'].size} floats, not {workers} x {n}: "
                         f"it starts at zero")
    elif not has_error and "error" in state:
        notes.append("this run has --powersgd-error-feedback off: its error feedback is dropped")
    keep_q = "q" in state and attrs.get("compression_layout") == layout and state["q"].size == q_size
    if not keep_q:
        notes.append("its Qs are of other matrices or another rank (--powersgd-rank, --powersgd-min-rate): "
                     "drawn afresh from the seed")
    line = f"{ckpt.name}: PowerSGD state: {'; '.join(notes)}" if notes else None
    return keep_error, keep_q, line


def restore(world, comm, resume, exchange, error, layout, kind):
    """Collective over comm: the checkpoint's state (the chief's
    resume.checkpoint) into every rank's exchange, as `decide` says: each
    worker its own error row (Scatter), every rank the Qs (Bcast). kind: this
    run's --compression; error: this rank's error view or None."""
    ckpt = resume.checkpoint
    stateful = getattr(exchange, "kind", None) == "powersgd"
    decision = np.zeros(2, np.int64)
    n = 0 if error is None else int(error.size)
    if world.chief:
        keep_error, keep_q, line = decide(ckpt, kind, error is not None, layout, comm.Get_size(), n,
                                          int(exchange.q.size) if stateful else 0)
        decision[:] = keep_error, keep_q
        if line:
            print(f"hpctrain: warning: {line}", file=sys.stderr, flush=True)
    if not stateful:
        return
    root, xp = world.chief_in(comm), world.xp
    with world.waiting("checkpoint broadcast (compression decision)", peer=world.cluster.chief_rank):
        comm.Bcast(decision, root=root)
    if decision[0]:
        mine = np.empty(n, error.dtype)
        rows = np.ascontiguousarray(ckpt.compression_state["error"], error.dtype) if world.chief else None
        with world.waiting("checkpoint scatter (compression error feedback)", peer=world.cluster.chief_rank):
            comm.Scatter(rows, mine, root=root)
        error[...] = xp.asarray(mine)
    if decision[1]:
        q = np.ascontiguousarray(ckpt.compression_state["q"], exchange.q.dtype) if world.chief \
            else np.empty(exchange.q.size, exchange.q.dtype)
        with world.waiting("checkpoint broadcast (compression Q)", peer=world.cluster.chief_rank):
            comm.Bcast(q, root=root)
        exchange.q[...] = xp.asarray(q)
    device.synchronize(xp)
