"""The pipeline's engine: one stage's optimizer step, the schedule's actions
(schedule.py: data, per stage) executed in order, each action type by its
own method (`ACTIONS`; an action it does not know is refused when the
engine is made, not taken for another), activations forward and their
gradients back as raw float32 buffers (Isend/Irecv on the replica's pipe
communicator); then the stage's micro-batches' gradient, summed as
--accumulate-steps sums it (stage.py), averaged over the stage's R replicas
(the --allreduce strategy on the stage communicator, over ring mode's
buckets) and the update (sharded: reduce-scatter, each replica its part,
allgather). So a pipeline ends with the parameters of `--accumulate-steps
M` on R ranks, bit for bit (tests/test_pipeline.py). With --compression the
pieces go through the stage's exchange (pipeline/compression.py) instead.

The loss lives on the last stage, layer 0 on the first: each step one world
Allreduce of [loss, stop] (the last stages' mean loss over their
micro-batches, any rank's stop signal) brings the summed loss to the chief
(world rank 0, on the first stage) and to every rank the same stop
decision, so all stop after the same step. Takes communicators (the grid's);
loops/pipe.py makes it.

    mpirun -n 4 python -m hpctrain.train --pipeline-stages 2 --micro-batches 4 --hidden 64,32 --steps 20
"""
import time

import numpy as np
from mpi4py import MPI

from .. import device
from ..chunks import chunk_parts
from ..nn.accumulate import Accumulation
from ..optim.clipping import Clip
from . import schedule as sched
from .grad_norm import StageNorm, ring_ranges
from .stages import body_range
from .transfers import Receives, Sends

EVAL_TAG = 31001   # evaluation activations, on the pipe communicator (training's tags: micro-batch indices)


class _Step:
    """What one step's actions hand each other, by micro-batch."""
    __slots__ = ("batches", "inputs", "outputs", "grads_in", "grads_out", "sends")

    def __init__(self, batches):
        self.batches = batches
        self.inputs, self.outputs, self.grads_in, self.grads_out, self.sends = {}, {}, {}, {}, []


class Engine:
    """One optimizer step of one stage: the schedule's actions (each type to
    its method: ACTIONS), the sum, the average over the stage's replicas,
    the update.

    world: run/world.World (its comm, watchdog, stop signal, array module);
    spec: the model's; grid, stage: this rank's (grid.py, stage.py);
    strategy: the stage's allreduce over its replicas (None for one);
    optimizer: over the stage's slice (sharded: its part); actions: this
    stage's schedule (schedule.py); pieces: ring mode's buckets of the
    stage's wire (stages.stage_pieces); batch: a micro-batch's samples;
    clip_norm: --clip-norm or None; fusion_elems: the buckets' size, for the
    norm's parts; trace: its --timeline spans (trace.StageTrace);
    compression: the stage's pipeline/compression.StageCompression or None
    (--compression: the pieces through its exchange instead of the strategy)."""

    def __init__(self, world, spec, grid, stage, strategy, optimizer, actions, pieces, batch, clip_norm,
                 fusion_elems, trace, compression=None):
        self.world, self.grid, self.stage, self.strategy, self.optimizer = world, grid, stage, strategy, optimizer
        self.compression = compression
        self.exchange = compression.exchange if compression is not None else None
        self.spec = spec
        self.sharded = getattr(optimizer, "ranges", None) is not None
        self.xp, self.micro, self.actions = world.xp, stage.micro, actions
        unknown = {type(a).__name__ for a in actions} - {t.__name__ for t in ACTIONS}
        if unknown:
            raise ValueError(f"the schedule has actions the engine does not know: {', '.join(sorted(unknown))}")
        self.in_shape = spec.input_shape if stage.a == 0 else spec.shapes[stage.a - 1]
        self.out_shape = spec.shapes[stage.b - 1]
        self.batch = batch   # a micro-batch's samples, whatever this stage reads
        self.head = np.zeros(2, np.float64)   # [loss, stop], summed over the world
        self.schedule_done = None
        self.trace = trace   # --timeline; without it, no-ops
        self.grad_scale = 1.0 / (grid.replicas * self.micro)
        self.pieces = pieces
        self.clip, self.norm = (Clip(clip_norm), self._norm(fusion_elems)) if clip_norm else (None, None)
        # the micro-batches' losses (the last stage's), summed as --accumulate-steps sums them
        self.losses = Accumulation(self.xp.zeros(1, np.float32))
        # the sends' neighbours, named if the step's Waitall stalls
        self.neighbours = [grid.world_rank(grid.stage + d) for d in (-1, 1) if 0 <= grid.stage + d < grid.stages]
        # transfers.py: sends bounded by the stage's model copies, receives posted ahead, pooled buffers
        copies, comm, dog = len(stage.models), grid.pipe_comm, world.watchdog
        before, after = grid.stage - 1, grid.stage + 1
        self.to_next = Sends(comm, after, (batch, *self.out_shape), copies, dog, "activation",
                             grid.world_rank(after)) if not grid.last else None
        self.to_before = Sends(comm, before, (batch, *self.in_shape), copies, dog, "gradient",
                               grid.world_rank(before)) if not grid.first else None
        self.from_before = Receives(comm, before, (batch, *self.in_shape),
                                    [a.micro for a in actions if isinstance(a, sched.RecvActivation)], 2, dog,
                                    "activations", grid.world_rank(before)) if not grid.first else None
        self.from_next = Receives(comm, after, (batch, *self.out_shape),
                                  [a.micro for a in actions if isinstance(a, sched.RecvGrad)], 2, dog,
                                  "gradients", grid.world_rank(after)) if not grid.last else None

    def _norm(self, elems):
        # --clip-norm: the sums of squares of ring mode's parts (its buckets
        # and its strategy's cut; one rank's strategy is one part), over the
        # stages; each replica sums what it holds reduced (sharded: its part)
        grid, stage = self.grid, self.stage
        parts = self.strategy.parts if self.strategy is not None else (lambda n: chunk_parts(n, 1))
        ranges = ring_ranges(self.spec, elems, parts)
        owned = self.optimizer.ranges if self.sharded else [(0, stage.hi - stage.lo)] if grid.replica == 0 else []
        return StageNorm(ranges, stage.lo, owned, grid, self.world.comm, self.world.watchdog)

    def run(self, batches, lr, step=0):
        """batches: M (x, y, noise) of 0-based `step`; returns (loss summed over the replicas, whether any
        rank stops)."""
        trace, start = self.trace, time.perf_counter()
        self.optimizer.begin(lr, self.grad_scale)
        if self.exchange is not None:
            self.exchange.begin(step)
        self.losses.restart()
        self._step = _Step(batches)
        for receives in (self.from_before, self.from_next):
            if receives is not None:
                receives.start()
        for action in self.actions:
            with trace.action(action):
                ACTIONS[type(action)](self, action.micro)
        sends = [s for s in (self.to_next, self.to_before) if s is not None]
        with trace.span("wait sends"), self.world.waiting("pipeline sends", peer=self.neighbours):
            MPI.Request.Waitall([request for s in sends for request in s.requests()])
        for s in sends:
            s.done()
        self._step = None
        self.schedule_done = time.perf_counter()   # the rest: the replicas' average, the update, [loss, stop]
        trace.add("schedule", start, self.schedule_done)
        self._update()
        # ring mode's float32 sums (nn/accumulate.py): the losses added in order, times 1/M
        self.head[0] = float(self.losses.mean()[0]) if self.grid.last else 0.0
        self.head[1] = 1.0 if self.world.stop.received else 0.0
        with trace.span("loss and stop"), self.world.waiting("loss and stop allreduce", peer=None):
            self.world.comm.Allreduce(MPI.IN_PLACE, self.head, op=MPI.SUM)
        trace.flush()
        return float(self.head[0]), bool(self.head[1] > 0)

    def evaluate(self, x, y, count, batch=128):
        """Forward only, in evaluation mode, batches of `batch` through the
        stages (Sequential.evaluate's batches, scaled the same way): x this
        replica's part of the images on the first stage, y its labels on the
        last (None elsewhere), count its samples (known everywhere). Returns
        (loss sum, correct) on the last stage, (0.0, 0) elsewhere. Sends wait
        two batches behind (no more than two activation buffers in flight)."""
        grid, run = self.grid, self.stage.models[0].run
        loss, correct, sends = 0.0, 0, []
        for lo in range(0, count, batch):
            n = min(batch, count - lo)
            if grid.first:
                a = x[lo:lo + n]
                a = self.xp.asarray(a)
                if a.dtype == np.uint8:
                    a = a.astype(np.float32)
                    a /= 255
            else:
                a = self._receive(grid.stage - 1, (n, *self.in_shape), EVAL_TAG, "evaluation activations")
            out = run.forward(a, False)
            if grid.last:
                part_loss, part_correct = run.head.sums(out, self.xp.asarray(y[lo:lo + n]))
                loss += part_loss
                correct += part_correct
                continue
            sends.append(self._send(out, grid.stage + 1, EVAL_TAG))
            if len(sends) > 2:
                with self.world.waiting("pipeline evaluation sends", peer=self.neighbours):
                    sends.pop(0)[0].Wait()
        with self.world.waiting("pipeline evaluation sends", peer=self.neighbours):
            MPI.Request.Waitall([request for request, _ in sends])
        return loss, correct

    # --- the actions (schedule.py), one method each ---------------------------------

    def _recv_activation(self, m):
        self._step.inputs[m] = self.from_before.get(m)   # held (the first layer keeps its input) until backward m

    def _forward(self, m):
        step = self._step
        x, y, noise = step.batches[m]
        held = step.inputs.get(m)
        out = self.stage.forward(m, x if held is None else self.xp.asarray(held), y, noise)
        if self.grid.last:
            self.losses.add(out)
        else:
            step.outputs[m] = out

    def _send_activation(self, m):
        self.to_next.send(self._step.outputs.pop(m), m, self.xp)

    def _recv_grad(self, m):
        self._step.grads_in[m] = self.from_next.get(m)

    def _backward(self, m):
        step = self._step
        dy = step.grads_in.pop(m, None)
        step.grads_out[m] = self.stage.backward(m, None if dy is None else self.xp.asarray(dy))
        if dy is not None:
            self.from_next.release(dy)
        held = step.inputs.pop(m, None)
        if held is not None:
            self.from_before.release(held)

    def _send_grad(self, m):
        self.to_before.send(self._step.grads_out.pop(m), m, self.xp)

    def _update(self):
        stage = self.stage
        grads, params = stage.grads, stage.params   # the micro-batches' sum, added up by their backwards
        device.synchronize(self.xp)
        if self.sharded:   # ZeRO-1 over the replicas, bucket by bucket: the same bits as allreduce + the whole update
            with self.trace.span("reduce-scatter"):
                mine = []
                for a, b in self.pieces:
                    lo, hi = self.exchange.reduce_scatter(a, b) if self.exchange else \
                        self.strategy.reduce_scatter(stage.wire[a:b])
                    mine.append(body_range(a + lo, a + hi, stage.body_at))
            with self.trace.span("update"):
                self._clip(grads)
                for lo, hi in mine:
                    if lo < hi:
                        self.optimizer.update(params, grads, lo, hi)
            with self.trace.span("allgather"):
                device.synchronize(self.xp)
                for a, b in self.pieces:
                    self.strategy.allgather(stage.param_wire[a:b])
            return
        if self.strategy is not None:
            with self.trace.span("allreduce"):
                for a, b in self.pieces:   # ring mode's buckets, in its order of sums
                    if self.exchange is not None:
                        self.exchange.allreduce(a, b)
                    else:
                        self.strategy.allreduce(stage.wire[a:b])
        with self.trace.span("update"):
            self._clip(grads)
            self.optimizer.update(params, grads)

    def _clip(self, grads):
        # --clip-norm: the norm over the stages (and the replicas' parts), in the update's span
        if self.clip is not None:
            self.optimizer.set_grad_scale(self.clip.scaled(self.norm.partials(grads), self.grad_scale))

    def _send(self, array, stage, tag):
        device.synchronize(self.xp)
        # A buffer of its own: the model copy whose buffer this is serves its
        # next micro-batch before the step's Waitall completes this send
        # (from a GPU, the host copy is already one).
        host = device.to_host(array)
        host = np.ascontiguousarray(host if device.is_gpu(self.xp) else host.copy(), dtype=np.float32)
        return self.grid.pipe_comm.Isend(host, dest=stage, tag=tag), host   # the buffer lives until the wait

    def _receive(self, stage, shape, tag, what):
        host = np.empty(shape, np.float32)
        request = self.grid.pipe_comm.Irecv(host, source=stage, tag=tag)
        with self.world.waiting(f"pipeline {what} of micro-batch {tag} from stage {stage}",
                                peer=self.grid.world_rank(stage)):
            request.Wait()
        return self.xp.asarray(host)


ACTIONS = {sched.RecvActivation: Engine._recv_activation, sched.Forward: Engine._forward,
           sched.SendActivation: Engine._send_activation, sched.RecvGrad: Engine._recv_grad,
           sched.Backward: Engine._backward, sched.SendGrad: Engine._send_grad}
