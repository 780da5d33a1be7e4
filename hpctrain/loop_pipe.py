"""The pipeline loop (`--pipeline-stages P`, ring mode), top to bottom: the
model's layers cut into P stages (pipeline/stages.py) on a stage x replica
grid (pipeline/grid.py); each step every stage runs its schedule's actions
(pipeline/schedule.py) over M micro-batches, activations forward and their
gradients back as raw float32 buffers (Isend/Irecv on the replica's pipe
communicator); then each stage sums its micro-batches' gradients as
--accumulate-steps does, averages them over its R replicas (the --allreduce
strategy on the stage communicator, over ring mode's buckets: stages.pieces)
and updates its parameter slice. So a pipeline ends with the parameters of
`--accumulate-steps M` on R ranks, bit for bit (tests/test_pipeline.py; for
R > 2 where no bucket crosses a cut).

The loss lives on the last stage, layer 0 on the first: each step one world
Allreduce of [loss, stop] (the last stages' mean loss over their micro-batches,
any rank's stop signal) brings the summed loss to the chief (world rank 0, on
the first stage) for its line and to every rank the same stop decision, so
all stop after the same step. At the end every rank gets the whole
parameter vector (one Allgatherv of each stage's slice from its replica 0)
and the run finishes as ring mode does (frame.finish: the evaluation, the
chief's --save and final record).

    mpirun -n 4 python -m hpctrain.train --pipeline-stages 2 --micro-batches 4 --hidden 64,32 --steps 20
"""
import functools
import time

import numpy as np
from mpi4py import MPI

from . import config as run_config
from . import data as data_mod
from . import device, prefetch
from .chunks import chunk_parts
from .clipping import Clip
from .comm import make_allreduce
from .comm.topology import Topology
from .frame import Frame
from .optim import make_optimizer, state_bytes
from .pipeline import schedule as sched
from .pipeline import whole
from .pipeline.grid import Grid
from .pipeline.norm import StageNorm, ring_ranges
from .pipeline.stages import body_range, owned_pieces, stage_pieces
from .pipeline.stage import Stage
from .pipeline.trace import StageTrace
from .report import Report
from .resume import Checkpoints


def train_pipe(session):
    args, xp, spec = session.args, session.xp, session.spec
    cuts, stages, micro = session.pipeline_cuts, args.pipeline_stages, args.micro_batches
    checkpoints = Checkpoints(session)
    resume = checkpoints.load(session.comm)   # the chief reads; the file is ring mode's, whole
    config = run_config.decide(session, resume)
    report = Report(session, config)

    # --- the grid, the stage, its allreduce and optimizer --------------------
    with session.watchdog.waiting("start-up (pipeline communicators)", peer=None):
        grid = Grid(session.comm, stages)
    session.watchdog.roles = grid.role   # a stalled rank is named with its stage and replica
    session.chief_says(f"hpctrain: pipeline of {stages} stages x {grid.replicas} replicas, {micro} micro-batches, "
                       f"{args.pipeline_schedule}; layers " + " ".join(f"[{a},{b})" for a, b in zip(cuts, cuts[1:])))
    strategy = None
    if grid.replicas > 1:
        with session.watchdog.waiting("start-up (stage allreduce)", peer=None):
            with Topology(grid.stage_comm) as topology:
                strategy = make_allreduce(args.allreduce, topology, xp, session.watchdog, args.cuda_aware,
                                          args.ring_order)
    plan = sched.SCHEDULES[args.pipeline_schedule](stages, micro, grid.stage)
    # as many model copies as the schedule holds micro-batches at once: its activation memory
    stage = Stage(spec, cuts, grid.stage, micro, xp, np.float32, copies=sched.peak_activations(plan))
    # Every rank builds the initial parameters from the seed (the same bits as
    # rank 0's broadcast) and keeps its stage's slice.
    initial = spec.build(np)
    initial.init(args.seed)
    stage.params[...] = xp.asarray(initial.params[stage.lo:stage.hi])
    stage.state[...] = xp.asarray(initial.state[stage.state_lo:stage.state_hi])
    del initial
    # --shard-optimizer (auto: ring mode's rule, over the stage's R replicas):
    # each replica keeps the optimizer state of its part of the stage's slice.
    sharded = config.shard_optimizer and strategy is not None
    # ring mode's buckets over this stage's part of its wire: averaged (and owned) bucket by bucket as there
    pieces = stage_pieces(spec, run_config.fusion_elems(args), stage)
    optimizer = make_optimizer(args.optimizer, stage.hi - stage.lo, xp, momentum=args.momentum,
                               weight_decay=args.weight_decay,
                               owned=owned_pieces(pieces, strategy.shard, stage.body_at) if sharded else None)
    reader = prefetch.device_batches(
        session.agreed(session.comm, functools.partial(data_mod.ShardReader, arrays=stage_arrays(grid), augment=args.augment),
                       session.data_dir, grid.replica, grid.replicas, args.batch_size, args.seed), xp)
    session.test_part()
    layouts = whole.Layouts(session.spec, cuts)

    # --- resume: the chief's file, each stage its slice ----------------------
    step = 0
    if resume is not None:
        whole.resume_stage(session, grid, stage, optimizer, layouts, resume)
        checkpoints.seek_readers(reader, resume)
        step = resume.step
        session.chief_says(checkpoints.resumed_line(resume, config))
    report.resume_at(checkpoints.saved_step, resume)
    checkpoints.more_attrs = report.checkpoint_attrs   # --keep-best's best so far

    # --- training, then the end ----------------------------------------------
    frame = Frame(session, config, report, checkpoints, step)
    run = PipeStep(session, grid, stage, strategy, optimizer, plan, pieces, layouts)
    step, stopped = train_steps(session, config, frame, run, reader, step)
    return finish(session, frame, run, reader, step, preempted=stopped and step < config.steps)


def stage_arrays(grid):
    """What of the training data this stage reads: the first stage the images,
    the last the labels, the stages between neither (they still deal the same
    batches, for their size, the dropout draws and the position)."""
    return ("images",) if grid.first else ("labels",) if grid.last else ()


class PipeStep:
    """One optimizer step of one stage: the schedule's actions, the sum, the average, the update."""

    def __init__(self, session, grid, stage, strategy, optimizer, actions, pieces, layouts):
        self.session, self.grid, self.stage, self.strategy, self.optimizer = session, grid, stage, strategy, optimizer
        self.layouts = layouts
        self.sharded = getattr(optimizer, "ranges", None) is not None
        self.xp, self.micro, self.actions = session.xp, stage.micro, actions
        spec = session.spec
        self.in_shape = spec.input_shape if stage.a == 0 else spec.shapes[stage.a - 1]
        self.out_shape = spec.shapes[stage.b - 1]
        self.batch = session.args.batch_size   # a micro-batch's samples, whatever this stage reads
        self.head = np.zeros(2, np.float64)   # [loss, stop], summed over the world
        self.schedule_done = None
        self.trace = StageTrace(session, grid, stage, optimizer)   # --timeline; without it, no-ops
        self.grad_scale = 1.0 / (grid.replicas * self.micro)
        self.pieces = pieces
        self.clip, self.norm = (Clip(session.args.clip_norm), self._norm(run_config.fusion_elems(session.args))) \
            if session.args.clip_norm else (None, None)
        # the sends' neighbours, named if the step's Waitall stalls
        self.neighbours = [grid.world_rank(grid.stage + d) for d in (-1, 1) if 0 <= grid.stage + d < grid.stages]

    def _norm(self, elems):
        # --clip-norm: the sums of squares of ring mode's parts (its buckets
        # and its strategy's cut; one rank's strategy is one part), over the
        # stages; each replica sums what it holds reduced (sharded: its part)
        grid, stage = self.grid, self.stage
        parts = self.strategy.parts if self.strategy is not None else (lambda n: chunk_parts(n, 1))
        ranges = ring_ranges(self.session.spec, elems, parts)
        owned = self.optimizer.ranges if self.sharded else [(0, stage.hi - stage.lo)] if grid.replica == 0 else []
        return StageNorm(ranges, stage.lo, owned, grid, self.session.comm, self.session.watchdog)

    def run(self, batches, lr):
        """batches: M (x, y, noise); returns (loss summed over the replicas, whether any rank stops)."""
        grid, trace, start = self.grid, self.trace, time.perf_counter()
        self.optimizer.begin(lr, self.grad_scale)
        inputs, outputs, grads_in, grads_out, losses, sends = {}, {}, {}, {}, [], []
        for action in self.actions:
            m = action.micro
            x, y, noise = batches[m]
            with trace.action(action):
                if isinstance(action, sched.RecvActivation):
                    inputs[m] = self._receive(grid.stage - 1, (self.batch, *self.in_shape), m, "activations")
                elif isinstance(action, sched.Forward):
                    out = self.stage.forward(m, inputs.pop(m, x), y, noise)
                    if grid.last:
                        losses.append(out)
                    else:
                        outputs[m] = out
                elif isinstance(action, sched.SendActivation):
                    sends.append(self._send(outputs.pop(m), grid.stage + 1, m))
                elif isinstance(action, sched.RecvGrad):
                    grads_in[m] = self._receive(grid.stage + 1, (self.batch, *self.out_shape), m, "gradients")
                elif isinstance(action, sched.Backward):
                    grads_out[m] = self.stage.backward(m, grads_in.pop(m, None))
                else:
                    sends.append(self._send(grads_out.pop(m), grid.stage - 1, m))
        with trace.span("wait sends"), self.session.watchdog.waiting("pipeline sends", peer=self.neighbours):
            MPI.Request.Waitall([request for request, _ in sends])
        self.schedule_done = time.perf_counter()   # the rest: the replicas' average, the update, [loss, stop]
        trace.add("schedule", start, self.schedule_done)
        self._update()
        self.head[0] = float(self._mean(losses)) if grid.last else 0.0
        self.head[1] = 1.0 if self.session.stop.received else 0.0
        with trace.span("loss and stop"), self.session.watchdog.waiting("loss and stop allreduce", peer=None):
            self.session.comm.Allreduce(MPI.IN_PLACE, self.head, op=MPI.SUM)
        trace.flush()
        return float(self.head[0]), bool(self.head[1] > 0)

    def _mean(self, losses):
        # ring_step.py's float32 sums: the losses added in order, times 1/M
        # (its last addition, the last loss + the sum, is the same bits: addition commutes)
        acc = self.xp.zeros(1, np.float32)
        acc[...] = losses[0]
        for loss in losses[1:]:
            acc += loss
        return (acc * (1.0 / len(losses)))[0]

    def _update(self):
        stage = self.stage
        grads, params = stage.grads, stage.params   # the micro-batches' sum, added up by their backwards
        device.synchronize(self.xp)
        if self.sharded:   # ZeRO-1 over the replicas, bucket by bucket: the same bits as allreduce + the whole update
            with self.trace.span("reduce-scatter"):
                mine = []
                for a, b in self.pieces:
                    lo, hi = self.strategy.reduce_scatter(stage.wire[a:b])
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
        with self.session.watchdog.waiting(f"pipeline {what} of micro-batch {tag} from stage {stage}",
                                           peer=self.grid.world_rank(stage)):
            request.Wait()
        return self.xp.asarray(host)


def train_steps(session, config, frame, run, reader, step):
    """The training loop from `step`: (the last step, whether some rank asked to stop)."""
    xp, noisy, seed = session.xp, config.spec.draws_noise, config.args.seed
    replicas = run.grid.replicas
    per_step = config.worker_batch * replicas
    stopped = False
    with frame.training():
        while step < config.steps:
            batches = []
            for _ in range(run.micro):
                x, y = reader.next_batch()   # the reader reuses its arrays: each micro-batch's own copy
                epoch, ids = reader.last_draw
                batches.append((_own(xp, x), _own(xp, y), (seed, epoch, np.array(ids)) if noisy else None))
            t0 = time.perf_counter()
            loss, stopped = run.run(batches, config.lr(step))
            t1 = time.perf_counter()
            frame.timed(t0, run.schedule_done, t1)
            step += 1
            frame.summed_loss(step, loss, replicas, per_step, grad_norm=run.clip.mean_norm if run.clip else None)
            if eval_due(config, step):   # the chief evaluates the whole model by itself
                frame.after_step(whole.model_on_chief(session, run), step)
            if stopped:
                if step < config.steps:
                    frame.stopping(step)
                break
            if frame.checkpoint_due(step):
                whole.save_checkpoint(session, frame.checkpoints, run, reader, step)
    return step, stopped


def _own(xp, array):
    # None: what this stage's reader does not read
    return None if array is None else xp.array(array)


def eval_due(config, step):
    """--eval-every N crossed at `step` (before the last, which the final
    evaluation covers): report.periodic_eval's rule, known on every rank."""
    every = config.args.eval_every
    return bool(every) and step < config.steps and step % every == 0


def finish(session, frame, run, reader, step, preempted):
    """As ring mode ends: the chief's final validation, the last checkpoint
    (at the end of training, or where a signal stopped it), then the
    pre-emption exit, or the whole model on every rank and the results
    (evaluation, the chief's --save and record)."""
    grid, optimizer, checkpoints = run.grid, run.optimizer, frame.checkpoints
    model = None
    if not preempted:
        model = whole.model_on_chief(session, run, everyone=True)
        if session.chief and session.has_val:
            frame.report.final_val(model, step)   # before the last checkpoint: it records the best
    if checkpoints.enabled and checkpoints.saved_step != step:
        whole.save_checkpoint(session, checkpoints, run, reader, step)
    if preempted:
        checkpoints.raise_preempted(session.comm, step)
    most = np.array([state_bytes(optimizer)], np.int64)
    with session.watchdog.waiting("optimizer state size allreduce", peer=None):
        session.comm.Allreduce(MPI.IN_PLACE, most, op=MPI.MAX)
    grid.free()
    args = session.args
    per_step = frame.config.worker_batch * grid.replicas
    extra = {"workers": grid.replicas, "global_batch": per_step, "pipeline_stages": grid.stages,
             "micro_batches": args.micro_batches, "schedule": args.pipeline_schedule, "replicas": grid.replicas,
             "pipeline_split": args.pipeline_split or ",".join(map(str, session.pipeline_cuts[1:-1])),
             "shard_optimizer": "on" if run.sharded else "off", "optimizer_state_bytes": int(most[0]),
             **(run.clip.totals() if run.clip else {})}
    return frame.finish(model, step, per_step, extra)
