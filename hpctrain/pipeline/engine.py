"""The pipeline's engine: one stage's optimizer step, the schedule's actions
(schedule.py: data, per stage) executed in order, each action type by its
own method (`ACTIONS`; an action it does not know is refused when the
engine is made, not taken for another), activations forward and their
gradients back as raw buffers of the run's precision.compute (Isend/Irecv on the replica's pipe
communicator); then the stage's micro-batches' gradient, summed as
--accumulate-steps sums it (the step gradient of every loop,
comm/step_gradient.py), averaged over the stage's R replicas
and the update: ring mode's data-parallel update (comm/data_parallel.py,
over its buckets cut to each chunk's slice, the --allreduce strategy on the
stage communicator; sharded: reduce-scatter, each replica its part,
allgather; --clip-norm: the one norm over every stage's chunks; with
--compression through the stage's exchange, pipeline/stage_compression.py),
run after the last backward. So a pipeline ends with the parameters of
`--accumulate-steps M` on R ranks, bit for bit (tests/test_pipeline.py).

With the interleaved schedule a stage holds V chunks (one Stage each, its
own transfers, optimizer and buckets) and every action names its local
chunk: the engine keys what actions hand each other by (micro-batch,
chunk), sends chunk c's output to chunk c + 1 on stage (s + 1) mod P and
its input gradient to chunk c - 1 on stage (s - 1) mod P, and updates
every chunk in one update; each chunk backprops 0..M-1 (schedule.actions_for refuses
a schedule that does not), so the bits are still those of --accumulate-steps M.

The loss lives on the last stage, layer 0 on the first: each step one world
Allreduce of [loss, stop] (the last stages' mean loss over their
micro-batches, any rank's stop signal; StepGradient.sum_now) brings the
summed loss to the chief (world rank 0, on the first stage) and to every
rank the same stop decision, so all stop after the same step (with
--compression fp16 it also carries what tells a 16-bit overflow from
divergence: `wire_overflowed`).
Takes communicators (the grid's);
loops/pipe.py makes it.

    mpirun -n 4 python -m hpctrain.train --pipeline-stages 2 --micro-batches 4 --hidden 64,32 --steps 20
    mpirun -n 2 python -m hpctrain.train --pipeline-stages 2 --micro-batches 4 --hidden 64,32,16 --steps 20 \
        --pipeline-schedule interleaved --virtual-stages 2
"""
import time

import numpy as np

from ..base import device
from ..comm.step_gradient import fp16_notes
from ..nn.losses import EvalSums, eval_batches
from ..base.precision import FLOAT32
from . import schedule as sched
from .transfers import Receives, Sends

EVAL_TAG = 31001   # + the sender's local chunk: evaluation activations, on the pipe communicator
#                    (training's tags: below stages.MAX_TAGS)


class _Step:
    """What one step's actions hand each other, by (micro-batch, local chunk)."""
    __slots__ = ("batches", "inputs", "outputs", "grads_in", "grads_out")

    def __init__(self, batches):
        self.batches = batches
        self.inputs, self.outputs, self.grads_in, self.grads_out = {}, {}, {}, {}


class Engine:
    """One optimizer step of one stage: the schedule's actions (each type to
    its method: ACTIONS), the sum, the average over the stage's replicas,
    the update.

    world: run/world.World (its comm, watchdog, stop signal, array module);
    spec: the model's; grid: this rank's (grid.py); chunks: this stage's
    chunks (stage.py Stage each: one, or V with --virtual-stages, local
    chunk k the model's chunk kP + s); update: the data-parallel update
    over them (comm/data_parallel.py: a part per chunk, its optimizer,
    --clip-norm's one norm, --compression's exchange); actions: this
    stage's schedule (schedule.py); batch: a micro-batch's samples; trace:
    its --timeline spans (trace.StageTrace); compression: the stage's
    pipeline/stage_compression.StageCompression or None (its checkpoint
    state; one chunk a stage only, stages.cuts_for refuses it with
    --virtual-stages V > 1); tied: pipeline/tied.TiedStages (tied tensors
    across the cut: their gradients summed before the average, the owner's
    tensor shared after the update) or None; gradient: the step's
    (comm/step_gradient.StepGradient: a part per chunk over its `grads`,
    the loss and stop flag over the world).

    Messages: chunk c's activations go to chunk c + 1 (stage (s + 1) mod P),
    its input gradients to chunk c - 1 (stage (s - 1) mod P), on the pipe
    communicator; a message's tag is its sender's (local chunk, micro-batch):
    kM + m for an activation, VM + kM + m for a gradient, so that two
    stages that trade both ways (P = 2) never confuse two messages."""

    def __init__(self, world, spec, grid, chunks, update, actions, batch, trace, gradient, compression=None,
                 tied=None, compute=FLOAT32.compute):
        self.tied = tied   # pipeline/tied.TiedStages: tied tensors across the cut, or None
        self.compute = np.dtype(compute)   # the activations' and their gradients' dtype, on the wire too
        self.world, self.grid, self.chunks, self.update, self.gradient = world, grid, chunks, update, gradient
        self.optimizers, self.sharded, self.clip = update.optimizers, update.sharded, update.clip
        self.compression = compression
        self.exchange = compression.exchange if compression is not None else None
        self.spec = spec
        self.xp, self.micro, self.actions = world.xp, chunks[0].micro, actions
        unknown = {type(a).__name__ for a in actions} - {t.__name__ for t in ACTIONS}
        if unknown:
            raise ValueError(f"the schedule has actions the engine does not know: {', '.join(sorted(unknown))}")
        P, V, s = grid.stages, len(chunks), grid.stage
        self.virtual = V
        self.in_shapes = [spec.input_shape if c.a == 0 else spec.shapes[c.a - 1] for c in chunks]
        self.out_shapes = [spec.shapes[c.b - 1] for c in chunks]
        # the model's first chunk (its input the batch) and last (its output the loss)
        self.first = [s == 0 and k == 0 for k in range(V)]
        self.last = [s == P - 1 and k == V - 1 for k in range(V)]
        self.batch = batch   # a micro-batch's samples, whatever this stage reads
        self.wire_overflowed = False
        self.schedule_done = None
        self.trace = trace   # --timeline; without it, no-ops
        # the neighbours: chunk to chunk round the stages (one chunk per stage: no wrap)
        before, after = (s - 1) % P, (s + 1) % P
        self.neighbours = sorted({grid.world_rank(before), grid.world_rank(after)} - {grid.world_rank(s)}) \
            if V > 1 else [grid.world_rank(s + d) for d in (-1, 1) if 0 <= s + d < P]
        # transfers.py, per local chunk: sends bounded by the chunk's model copies, receives posted ahead,
        # pooled buffers
        comm, dog, M, waits = grid.pipe_comm, world.watchdog, self.micro, world.waits

        def label(tag):   # a tag in words: the micro-batch, and with chunks the sender's chunk
            return f"micro-batch {tag % M}" + (f" (stage's chunk {(tag // M) % V})" if V > 1 else "")
        self.to_next, self.to_before, self.from_before, self.from_next = [], [], [], []
        for k, chunk in enumerate(chunks):
            copies, inp, out = chunk.slots, (batch, *self.in_shapes[k]), (batch, *self.out_shapes[k])
            self.to_next.append(None if self.last[k] else Sends(comm, after, out, copies, dog, "activation",
                                                                 grid.world_rank(after), label, waits, compute))
            self.to_before.append(None if self.first[k] else Sends(comm, before, inp, copies, dog, "gradient",
                                                                    grid.world_rank(before), label, waits, compute))
            self.from_before.append(None if self.first[k] else Receives(
                comm, before, inp, [self._activation_tag(a.micro, a.chunk) for a in actions
                                    if isinstance(a, sched.RecvActivation) and a.chunk == k],
                2, dog, "activations", grid.world_rank(before), label, waits, compute))
            self.from_next.append(None if self.last[k] else Receives(
                comm, after, out, [self._grad_tag(a.micro, a.chunk) for a in actions
                                   if isinstance(a, sched.RecvGrad) and a.chunk == k],
                2, dog, "gradients", grid.world_rank(after), label, waits, compute))

    def _activation_tag(self, m, k):
        """The tag of the activation local chunk k receives for micro-batch m: its sender's (the chunk before)."""
        sender = k - 1 if self.grid.stage == 0 and self.virtual > 1 else k
        return sender * self.micro + m

    def _grad_tag(self, m, k):
        """The tag of the gradient local chunk k receives for micro-batch m: its sender's (the chunk after)."""
        sender = k + 1 if self.grid.stage == self.grid.stages - 1 and self.virtual > 1 else k
        return (self.virtual + sender) * self.micro + m

    def run(self, batches, lr, step=0):
        """batches: M (x, y, noise) of 0-based `step`; returns (loss summed over the replicas, whether any
        rank stops)."""
        trace, start = self.trace, time.perf_counter()
        self.update.begin(lr, step)
        self.gradient.begin()
        self._step = _Step(batches)
        for receives in self.from_before + self.from_next:
            if receives is not None:
                receives.start()
        for action in self.actions:
            with trace.action(action):
                ACTIONS[type(action)](self, action.micro, action.chunk)
        sends = [s for s in self.to_next + self.to_before if s is not None]
        with trace.span("wait sends"), self.world.waiting("pipeline sends", peer=self.neighbours):
            self.world.waits.all([request for s in sends for request in s.requests()])
        for s in sends:
            s.done()
        self._step = None
        self.schedule_done = time.perf_counter()   # the rest: the replicas' average, the update, [loss, stop]
        trace.add("schedule", start, self.schedule_done)
        for k, chunk in enumerate(self.chunks):   # each tied tensor's summed uses into its gradient
            self.gradient.combine_tied(chunk.model.run, chunk.a, chunk.b, part=k)
        if self.tied is not None:
            with trace.span("tied gradients"):
                self.tied.sum_gradients()
        self._update()
        if self.tied is not None:
            with trace.span("tied parameters"):
                self.tied.share_parameters()
        # ring mode's float32 sums: the losses added in order, times 1/M; the last stage's replicas'
        # losses (--tensor-parallel: its tensor rank 0's, each of them the same)
        loss = float(self.gradient.loss_mean()[0]) if self.grid.last and self.grid.tensor == 0 else 0.0
        # --compression fp16: some stage's parameters are not finite though every gradient on the
        # wire was: the 16-bit sum overflowed (loops/pipe.py names it, as loops/ring.py does)
        notes = fp16_notes([chunk.params for chunk in self.chunks], self.exchange)
        with trace.span("loss and stop"):
            loss, stop, self.wire_overflowed = self.gradient.sum_now(loss, self.world.stop.received, notes,
                                                                     self.world.waits)
        trace.flush()
        return loss, stop

    def evaluate(self, x, y, count, forward=None, batch=128):
        """Forward only, in evaluation mode, groups of `batch` samples (the
        sums' groups: nn/losses.EvalSums) run `forward` at a time (a training
        micro-batch's: nn/sequential.eval_forward; None: a group whole)
        through the stages, each forward batch through this stage's chunks
        in turn: x this replica's part of the images on the first stage, y
        its labels on the last (None elsewhere), count its samples (known
        everywhere). Returns the loss's sums (nn/losses.py: loss, count,
        correct) on the last stage, its zero sums elsewhere. Sends wait two
        batches behind (no more than two activation buffers a chunk in flight)."""
        grid, P = self.grid, self.grid.stages
        sends = []
        last = [chunk.model.run for k, chunk in enumerate(self.chunks) if self.last[k]]
        sums = EvalSums(last[0].loss, last[0].loss_slots[0]) if last else None
        for lo, hi, ends in eval_batches(count, batch, min(forward or batch, batch)):
            n = hi - lo
            for k, chunk in enumerate(self.chunks):
                if self.first[k]:
                    a = x[lo:hi]
                    a = self.xp.asarray(a)
                    if a.dtype == np.uint8:
                        a = a.astype(self.compute)
                        a /= 255
                else:
                    sender = k - 1 if grid.stage == 0 else k   # the chunk before's local index on its stage
                    a = self._receive((grid.stage - 1) % P, (n, *self.in_shapes[k]), EVAL_TAG + sender,
                                      "evaluation activations")
                run = chunk.model.run
                out = run.forward(a, False)
                if self.last[k]:
                    sums.add(out, self.xp.asarray(y[lo:hi]))
                    if ends:
                        sums.end_group()
                    continue
                sends.append(self._send(out, (grid.stage + 1) % P, EVAL_TAG + k))
                if len(sends) > 2 * self.virtual:
                    with self.world.waiting("pipeline evaluation sends", peer=self.neighbours):
                        self.world.waits.one(sends.pop(0)[0])
        with self.world.waiting("pipeline evaluation sends", peer=self.neighbours):
            self.world.waits.all([request for request, _ in sends])
        return sums.total if sums is not None else self.spec.loss.zero_sums()

    # --- the actions (schedule.py), one method each: micro-batch m, local chunk k ---------

    def _recv_activation(self, m, k):
        # held (the first layer keeps its input) until backward m
        self._step.inputs[m, k] = self.from_before[k].get(self._activation_tag(m, k))

    def _forward(self, m, k):
        step = self._step
        x, y, noise = step.batches[m]
        held = step.inputs.get((m, k))
        out = self.chunks[k].forward(m, x if held is None else self.xp.asarray(held), y, noise)
        if self.last[k]:
            self.gradient.add_loss(out)
        else:
            step.outputs[m, k] = out

    def _send_activation(self, m, k):
        self.to_next[k].send(self._step.outputs.pop((m, k)), k * self.micro + m, self.xp)

    def _recv_grad(self, m, k):
        self._step.grads_in[m, k] = self.from_next[k].get(self._grad_tag(m, k))

    def _backward(self, m, k):
        step = self._step
        dy = step.grads_in.pop((m, k), None)
        chunk = self.chunks[k]
        step.grads_out[m, k] = chunk.backward(m, None if dy is None else self.xp.asarray(dy))
        self.gradient.add(chunk.grad, chunk.model.run.extra, part=k)   # into the step's sum at once
        if dy is not None:
            self.from_next[k].release(dy)
        held = step.inputs.pop((m, k), None)
        if held is not None:
            self.from_before[k].release(held)

    def _send_grad(self, m, k):
        self.to_before[k].send(self._step.grads_out.pop((m, k)), (self.virtual + k) * self.micro + m, self.xp)

    def _update(self):
        # every chunk's gradient averaged (sharded: reduce-scattered), then the
        # one clip factor over them all (--clip-norm) and each chunk's update,
        # then (sharded) the parameters allgathered: comm/data_parallel.py
        update = self.update
        device.synchronize(self.xp)
        if update.strategy is not None:
            with self.trace.span("reduce-scatter" if update.sharded else "allreduce"):
                update.reduce_all()
        with self.trace.span("update"):
            update.update_all()
        if update.sharded:
            with self.trace.span("allgather"):
                device.synchronize(self.xp)
                update.gather_all()

    def _send(self, array, stage, tag):
        device.synchronize(self.xp)
        # A buffer of its own: the model copy whose buffer this is serves its
        # next micro-batch before the step's Waitall completes this send
        # (from a GPU, the host copy is already one).
        host = device.to_host(array)
        host = np.ascontiguousarray(host if device.is_gpu(self.xp) else host.copy(), dtype=self.compute)
        return self.grid.pipe_comm.Isend(host, dest=stage, tag=tag), host   # the buffer lives until the wait

    def _receive(self, stage, shape, tag, what):
        host = np.empty(shape, self.compute)
        request = self.grid.pipe_comm.Irecv(host, source=stage, tag=tag)
        with self.world.waiting(f"pipeline {what} from stage {stage}",
                                peer=self.grid.world_rank(stage)):
            self.world.waits.one(request)
        return self.xp.asarray(host)


ACTIONS = {sched.RecvActivation: Engine._recv_activation, sched.Forward: Engine._forward,
           sched.SendActivation: Engine._send_activation, sched.RecvGrad: Engine._recv_grad,
           sched.Backward: Engine._backward, sched.SendGrad: Engine._send_grad}
