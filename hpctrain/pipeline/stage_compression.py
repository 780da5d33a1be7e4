"""--compression on a pipeline: a stage's replicas average its gradient
through ring mode's exchange (comm/compressed_exchange.py) over the stage's part of
its gradient slice, bucket by bucket (pipeline/engine.py); and PowerSGD's state in
the checkpoint ring mode writes (checkpoints/powersgd_state.py): the error
feedback as the same named tensor (R, n), replica r's row what worker r's
is in ring mode, each rank writing (and on resume reading) its own box, its
replica's row over its stage's slice of the model; and the Qs of every
compressed matrix, whole, gathered along replica 0's pipe to the chief, who
writes them once. So a pipeline's checkpoint resumes in ring mode on R
workers and back, and under another cut, its state carried over. A stage
with one replica exchanges nothing and so compresses nothing. Takes the
grid's communicators; never imports MPI.

    mpirun -n 4 python -m hpctrain.train --pipeline-stages 2 --micro-batches 2 --hidden 64,32 --steps 20 --compression powersgd --powersgd-start 5
"""

import numpy as np

from ..base import device
from ..checkpoints.powersgd_state import decided, error_part, saved
from ..comm.compressed_exchange import make_exchange
from ..optim.compression_math import powersgd_layout
from .stages import ranges


class StageCompression:
    """The exchange of one stage (None for --compression none or one
    replica), its error view over the stage's parameter slice, and where
    every stage's Qs lie (so the whole Q can be gathered and scattered)."""

    def __init__(self, compression, spec, cuts, stage, strategy):
        self.kind = compression.kind
        matrices, self.layout = ([], "")
        if compression.kind == "powersgd":
            matrices, self.layout = powersgd_layout(spec.tensors, compression.rank, compression.min_rate)
        self.q_spans = _q_spans(spec, cuts, matrices)
        self.lo = stage.lo   # where the stage's slice (its error's) lies in the model's flat parameters
        mine = [m for m in matrices if stage.lo <= m.lo and m.hi <= stage.hi]
        self.exchange = None
        if strategy is not None and compression.kind != "none":
            # the stage's slice of the gradient: the model's element j at j - lo
            self.exchange = make_exchange(compression, strategy, stage.grads, mine, offset=-stage.lo)
        self.error = getattr(self.exchange, "error", None)
        self.stateful = getattr(self.exchange, "kind", None) == "powersgd"


def _q_spans(spec, cuts, matrices):
    """(counts, displacements) of every stage's Qs in the whole Q buffer
    (matrices lie in model order, their Qs one after another)."""
    counts, displs = [], []
    for a, b in zip(cuts, cuts[1:]):
        lo, hi = ranges(spec, a, b)
        inside = [m for m in matrices if lo <= m.lo and m.hi <= hi]
        counts.append(sum(m.q_hi - m.q_lo for m in inside))
        displs.append(inside[0].q_lo if inside else 0)
    return counts, displs


def state(world, grid, mine, layouts):
    """Collective over the world: this rank's checkpoints/powersgd_state.Saved
    of the pipeline's PowerSGD state (its box of the error feedback, and on
    the chief the Qs, gathered along replica 0's pipe), or None without
    state. mine: this rank's StageCompression; layouts: whole.Layouts (the
    stages' parameter slices)."""
    if not mine.stateful:
        return None
    watchdog, xp = world.watchdog, world.xp
    device.synchronize(xp)
    q = None
    if grid.replica == 0:   # the Qs are the same on every replica: replica 0's
        q_counts, q_displs = mine.q_spans
        part = np.ascontiguousarray(device.to_host(mine.exchange.q))
        q = np.zeros(sum(q_counts), part.dtype) if grid.first else None
        with watchdog.waiting("checkpoint gather (compression Q)", peer=None):
            grid.pipe_comm.Gatherv(part, [q, (q_counts, q_displs)] if grid.first else None, root=0)
    return saved(world, mine.error, grid.replica, grid.replicas, sum(layouts.params[0]), q, mine.layout, mine.lo)


def restore(world, grid, mine, layouts, resume, checkpoints):
    """Collective over the world: the checkpoint's state back into every
    stage's exchange, as checkpoints/powersgd_state.decide says (one line
    when anything is not carried over): each rank its box of the error
    feedback, read by `checkpoints` (checkpoints/resume.Checkpoints) as
    every part is (an old flat one: scattered over the replicas from the
    chief, then along the pipe), the Qs along replica 0's pipe and over the
    replicas."""
    watchdog, xp, ckpt = world.watchdog, world.xp, resume.checkpoint
    counts, displs = layouts.params
    q_counts, q_displs = mine.q_spans
    n = sum(counts)
    # with one replica a stage exchanges nothing: no state to go on with
    kind = mine.kind if mine.stateful or mine.kind != "powersgd" else "powersgd and one replica a stage"
    keep_error, keep_q, by_box = decided(world, world.comm, resume, kind, mine.error is not None, mine.layout,
                                         grid.replicas, n, sum(q_counts))
    if not mine.stateful:
        return
    if keep_error and by_box:
        checkpoints.restore(world.comm, resume, [error_part(mine.error, grid.replica, mine.lo)]
                            if mine.error is not None else [])
    elif keep_error and mine.error is not None:
        row = np.empty(n, mine.error.dtype) if grid.first else None
        if grid.first:
            rows = np.ascontiguousarray(ckpt.compression_state["error"], row.dtype) if grid.replica == 0 else None
            with watchdog.waiting("checkpoint scatter (compression error feedback, over the replicas)", peer=None):
                grid.stage_comm.Scatter(rows, row, root=0)
        part = np.empty(mine.error.size, mine.error.dtype)
        with watchdog.waiting("checkpoint scatter (compression error feedback, along the pipe)", peer=None):
            grid.pipe_comm.Scatterv([row, (counts, displs)] if grid.first else None, part, root=0)
        mine.error[...] = xp.asarray(part)
    if keep_q:
        part = np.empty(mine.exchange.q.size, mine.exchange.q.dtype)
        if grid.replica == 0:
            whole = np.ascontiguousarray(ckpt.compression_state["q"], part.dtype) if grid.first else None
            with watchdog.waiting("checkpoint scatter (compression Q)", peer=None):
                grid.pipe_comm.Scatterv([whole, (q_counts, q_displs)] if grid.first else None, part, root=0)
        with watchdog.waiting("checkpoint broadcast (compression Q over the replicas)", peer=None):
            grid.stage_comm.Bcast(part, root=0)
        mine.exchange.q[...] = xp.asarray(part)
    device.synchronize(xp)
