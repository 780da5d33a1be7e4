"""The pipeline's `--timeline`: every rank's step on a track of its own in
the chief's one Chrome trace (report/timeline.py), so that a stage's idle time, the
bubble, shows between its forwards and backwards. Takes communicators; never
imports MPI itself.

Each rank records, per step: `forward m` and `backward m` (with
--virtual-stages V the stage's local chunk as a letter, `forward 3b`: chunk 1); `send activation m`
and `send gradient m` (posting the Isend: the copy to the host and the post);
`wait activation m` and `wait gradient m` (a receive, until its data are in);
`wait sends` (the final Waitall of the step's sends); `schedule` (from the
step's first action to that Waitall's end: the schedule phase); then
`allreduce` (of the micro-batches' summed gradient over the stage's replicas, R > 1),
`update` and `loss and stop` (with a sharded optimizer `reduce-scatter`,
`update` of this replica's part, `allgather` of the parameters). Every span carries its step. After each step
the chief gathers every rank's rows of numbers (kind, micro-batch, start,
end: one Gather of their counts and one Gatherv of float64, no pickle) and
adds them to its trace as process r (world rank r), named "stage s, replica
q (rank r)", its metadata holding the stage's layers and the bytes of its
parameters, gradient buffers and optimizer state, and its model copies
(the activation sets it allocates, pipeline/stage.py).

Clocks: each rank counts from the moment it leaves a world Barrier at
start-up, and the chief adds its own clock at that moment, so the tracks
agree within that Barrier's skew, on one node or across nodes. On a GPU a
span is the host's time (kernels may still run after it ends).

Without --timeline (the same flag on every rank) `span` and `action` return
report/timeline.py's shared no-op and `add` and `flush` return at once: no
collective, nothing recorded.

    mpirun -n 2 python -m hpctrain.train --pipeline-stages 2 --micro-batches 4 --steps 20 --timeline /tmp/t.json
"""
import time

import numpy as np

from ..optim.optimizers import state_bytes
from ..report.timeline import NO_SPAN
from . import schedule as sched

# A row's kind is its index here; the category is the trace's colour group.
KINDS = (("forward", "compute"), ("backward", "compute"),
         ("send activation", "comm"), ("wait activation", "comm"),
         ("send gradient", "comm"), ("wait gradient", "comm"), ("wait sends", "comm"),
         ("schedule", "step"), ("allreduce", "comm"), ("update", "optimizer"),
         ("reduce-scatter", "comm"), ("allgather", "comm"),
         ("loss and stop", "comm"))
CODE = {name: code for code, (name, _) in enumerate(KINDS)}
ACTION = {sched.Forward: "forward", sched.Backward: "backward",
          sched.SendActivation: "send activation", sched.RecvActivation: "wait activation",
          sched.SendGrad: "send gradient", sched.RecvGrad: "wait gradient"}


class _Row:
    __slots__ = ("trace", "code", "micro", "t0")

    def __init__(self, trace, code, micro):
        self.trace, self.code, self.micro = trace, code, micro

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.trace.rows.append((self.code, self.micro, self.t0, time.perf_counter()))
        return False


class StageTrace:
    """This rank's spans of one step, handed to the chief's timeline after it."""

    def __init__(self, world, outputs, timeline, grid, chunks, optimizers):
        """world: run/world.World; outputs: the plan's (--timeline, the same on
        every rank, and --timeline-steps); timeline: the chief's trace."""
        self.enabled = outputs.timeline is not None
        self.virtual = len(chunks)   # V > 1: an action's micro-batch is recorded as mV + its local chunk
        self.limit = outputs.timeline_steps   # then no more spans, and no more gathers, on every rank alike
        if not self.enabled:
            return
        self.world, self.comm, self.timeline = world, world.comm, timeline
        self.rows, self.step = [], 0
        # with V chunks a stage: its first chunk's first layer to its last chunk's end, their sums
        grads = [g for c in chunks for g in (c.grad, c.grads)]
        about = np.array([grid.stage, grid.replica, chunks[0].a, chunks[-1].b, sum(c.params.nbytes for c in chunks),
                          sum(int(g.nbytes) for g in grads), sum(state_bytes(o) for o in optimizers),
                          sum(c.slots for c in chunks)], np.int64)
        every = np.zeros((self.comm.Get_size(), about.size), np.int64) if world.chief else None
        with world.waiting("timeline start-up (pipeline clocks)", peer=None):
            self.comm.Barrier()
            self.origin = time.perf_counter()
            self.comm.Gather(about, every, root=0)
        if world.chief:
            for rank, (s, q, a, b, params, grad_bytes, opt, copies) in enumerate(every.tolist()):
                self.timeline.name_process(rank, f"stage {s}, replica {q} (rank {rank})", stage=s, replica=q,
                                           layers=[a, b], params_bytes=params, grads_bytes=grad_bytes,
                                           optimizer_state_bytes=opt, model_copies=copies)

    def span(self, kind, micro=-1):
        """with trace.span("update"): ...  (micro: the micro-batch, -1 for none)"""
        return _Row(self, CODE[kind], micro) if self.enabled else NO_SPAN

    def action(self, action):
        """The span of one schedule action (schedule.py), named with its micro-batch."""
        micro = action.micro * self.virtual + action.chunk if self.virtual > 1 else action.micro
        return _Row(self, CODE[ACTION[type(action)]], micro) if self.enabled else NO_SPAN

    def add(self, kind, t_start, t_end):
        """A span measured elsewhere (perf_counter seconds)."""
        if self.enabled:
            self.rows.append((CODE[kind], -1, t_start, t_end))

    def flush(self):
        """After a step, on every rank: the chief adds every rank's rows to its timeline."""
        if not self.enabled:
            return
        self.step += 1
        if self.limit and self.step >= self.limit:
            self.enabled = False   # this was the last step recorded (--timeline-steps), on every rank
        mine = np.array(self.rows, np.float64).reshape(-1)
        mine[2::4] -= self.origin
        mine[3::4] -= self.origin
        self.rows = []
        chief = self.world.chief
        counts = np.zeros(self.comm.Get_size(), np.int64) if chief else None
        with self.world.waiting("timeline gather (pipeline spans)", peer=None):
            self.comm.Gather(np.array([mine.size], np.int64), counts, root=0)
            every = np.empty(int(counts.sum()), np.float64) if chief else None
            self.comm.Gatherv(mine, [every, counts] if chief else None, root=0)
        if chief:
            self._add(every, counts)

    def _micro(self, micro):
        """A span's micro-batch as its name says it: `3`, or with chunks `3b` (schedule.diagram's letters)."""
        if self.virtual == 1:
            return str(micro)
        m, chunk = divmod(micro, self.virtual)
        return f"{m}{'abcdefghijklmnopqrstuvwxyz'[chunk % 26]}"

    def _add(self, every, counts):
        starts = np.concatenate([[0], np.cumsum(counts)])
        for rank in range(len(counts)):
            for code, micro, t0, t1 in every[starts[rank]:starts[rank + 1]].reshape(-1, 4).tolist():
                name, cat = KINDS[int(code)]
                self.timeline.add(name if micro < 0 else f"{name} {self._micro(int(micro))}", cat, self.origin + t0,
                                  self.origin + t1, {"step": self.step}, pid=rank)
