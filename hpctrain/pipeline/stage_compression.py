"""--compression on a pipeline: a stage's replicas average its gradient
through ring mode's exchange (comm/compressed_exchange.py) over the stage's part of
its gradient slice, bucket by bucket (pipeline/engine.py); and PowerSGD's state in the
one checkpoint file ring mode writes (checkpoints/powersgd_state.py), whole:
each replica's error feedback over the whole model (its stages' slices, in
stage order: replica r's row is what worker r's is in ring mode) and the
Qs of every compressed matrix. So a pipeline's checkpoint resumes in ring
mode on R workers and back, its state carried over. A stage with one
replica exchanges nothing and so compresses nothing. Takes the grid's
communicators; never imports MPI.

    mpirun -n 4 python -m hpctrain.train --pipeline-stages 2 --micro-batches 2 --hidden 64,32 --steps 20 --compression powersgd --powersgd-start 5
"""
import sys

import numpy as np

from ..base import device
from ..checkpoints.powersgd_state import decide
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


def gather(world, grid, mine, layouts):
    """Collective over the world: (arrays, attributes) of the pipeline's
    PowerSGD state on the chief (checkpoints.compression's layout), ({}, {})
    elsewhere and without state. mine: this rank's StageCompression;
    layouts: whole.Layouts (the stages' parameter slices)."""
    if not mine.stateful:
        return {}, {}
    watchdog, xp = world.watchdog, world.xp
    device.synchronize(xp)
    arrays = {}
    counts, displs = layouts.params
    n = sum(counts)
    if mine.error is not None:
        part = np.ascontiguousarray(device.to_host(mine.error))
        row = np.zeros(n, part.dtype) if grid.first else None
        with watchdog.waiting("checkpoint gather (compression error feedback, along the pipe)", peer=None):
            grid.pipe_comm.Gatherv(part, [row, (counts, displs)] if grid.first else None, root=0)
        if grid.first:   # each replica's row, from its first stage, to the chief
            rows = np.empty(grid.replicas * n, row.dtype) if grid.replica == 0 else None
            with watchdog.waiting("checkpoint gather (compression error feedback, over the replicas)", peer=None):
                grid.stage_comm.Gather(row, rows, root=0)
            arrays["error"] = rows
    if grid.replica == 0:   # the Qs are the same on every replica: replica 0's
        q_counts, q_displs = mine.q_spans
        part = np.ascontiguousarray(device.to_host(mine.exchange.q))
        q = np.zeros(sum(q_counts), part.dtype) if grid.first else None
        with watchdog.waiting("checkpoint gather (compression Q)", peer=None):
            grid.pipe_comm.Gatherv(part, [q, (q_counts, q_displs)] if grid.first else None, root=0)
        arrays["q"] = q
    if not world.chief:
        return {}, {}
    return arrays, {"compression_workers": int(grid.replicas), "compression_layout": mine.layout}


def restore(world, grid, mine, layouts, resume):
    """Collective over the world: the chief's checkpoint state back into
    every stage's exchange, as checkpoints/powersgd_state.decide says (one line
    when anything is not carried over)."""
    watchdog, xp, ckpt = world.watchdog, world.xp, resume.checkpoint
    counts, displs = layouts.params
    q_counts, q_displs = mine.q_spans
    n = sum(counts)
    decision = np.zeros(2, np.int64)
    if world.chief:
        # with one replica a stage exchanges nothing: no state to go on with
        kind = mine.kind if mine.stateful or mine.kind != "powersgd" else "powersgd and one replica a stage"
        keep_error, keep_q, line = decide(ckpt, kind, mine.error is not None, mine.layout, grid.replicas, n,
                                          sum(q_counts))
        decision[:] = keep_error, keep_q
        if line:
            print(f"hpctrain: warning: {line}", file=sys.stderr, flush=True)
    with watchdog.waiting("checkpoint broadcast (compression decision)", peer=None):
        world.comm.Bcast(decision, root=0)
    if not mine.stateful:
        return
    if decision[0] and mine.error is not None:
        row = np.empty(n, mine.error.dtype) if grid.first else None
        if grid.first:
            rows = np.ascontiguousarray(ckpt.compression_state["error"], row.dtype) if grid.replica == 0 else None
            with watchdog.waiting("checkpoint scatter (compression error feedback, over the replicas)", peer=None):
                grid.stage_comm.Scatter(rows, row, root=0)
        part = np.empty(mine.error.size, mine.error.dtype)
        with watchdog.waiting("checkpoint scatter (compression error feedback, along the pipe)", peer=None):
            grid.pipe_comm.Scatterv([row, (counts, displs)] if grid.first else None, part, root=0)
        mine.error[...] = xp.asarray(part)
    if decision[1]:
        part = np.empty(mine.exchange.q.size, mine.exchange.q.dtype)
        if grid.replica == 0:
            whole = np.ascontiguousarray(ckpt.compression_state["q"], part.dtype) if grid.first else None
            with watchdog.waiting("checkpoint scatter (compression Q)", peer=None):
                grid.pipe_comm.Scatterv([whole, (q_counts, q_displs)] if grid.first else None, part, root=0)
        with watchdog.waiting("checkpoint broadcast (compression Q over the replicas)", peer=None):
            grid.stage_comm.Bcast(part, root=0)
        mine.exchange.q[...] = xp.asarray(part)
    device.synchronize(xp)
