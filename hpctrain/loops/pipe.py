"""The pipeline loop (`--pipeline-stages P`, ring mode), top to bottom: the
model's layers cut into P stages (pipeline/stages.py, decided in the plan)
on a stage x replica grid (pipeline/grid.py: a view of the run's mesh,
run/mesh.py); each step every stage runs its schedule's actions
(pipeline/schedule.py) through its engine (pipeline/engine.py):
micro-batches through the stages, the sum, the average over the stage's
replicas, the update. With --pipeline-schedule
interleaved each stage holds --virtual-stages V chunks (stage s the model's
chunks s, s + P, ...), each a Stage with its own optimizer. So a pipeline ends with the
parameters of `--accumulate-steps M` on R ranks, bit for bit
(tests/test_pipeline.py). The frame (frame.py) does what every loop does:
the start, the batches, the accounting, the end; no rank holds the whole
model: evaluations run through the stages, checkpoints and --save are
written a stage at a time (pipeline/whole.py).

    mpirun -n 4 python -m hpctrain.train --pipeline-stages 2 --micro-batches 4 --hidden 64,32 --steps 20
"""
import time

from ..base import device
from ..data import prefetch
from ..comm import make_allreduce
from ..comm.device_buffers import bcast
from ..comm.topology import Topology
from ..comm.compressed_exchange import summary
from ..comm.data_parallel import DataParallelUpdate, NormScope, Part, model_buckets
from ..comm.grad_norm import TensorNorm
from ..comm.step_gradient import StepGradient
from ..nn.tensor_parallel import counted_ranges
from ..optim.clipping import Clip
from ..optim.optimizers import state_bytes
from ..pipeline import stage_compression as pipeline_compression
from ..pipeline import schedule as sched
from ..pipeline import whole
from ..pipeline.engine import Engine
from ..pipeline.stage_compression import StageCompression
from ..pipeline.grid import Grid
from ..pipeline.stage import Stage
from ..pipeline.tied import TiedStages
from ..pipeline.trace import StageTrace
from ..state import layouts as state_layouts
from .frame import Frame


def train_pipe(world, plan, inputs, timeline):
    xp, spec, pipe = world.xp, plan.spec, plan.pipe
    cuts, stages, micro = list(pipe.cuts), pipe.stages, pipe.micro_batches
    frame = Frame(world, plan, inputs, timeline, world.comm)   # the chief reads; the file is ring mode's, whole

    # --- the grid, the stage, its allreduce and optimizer --------------------
    grid = Grid(world.mesh)   # the mesh's communicators, made at start-up
    virtual = pipe.virtual_stages
    chunk_text = f", {virtual} chunks a stage" if virtual > 1 else ""
    world.say(f"hpctrain: pipeline of {stages} stages x {grid.replicas} replicas, {micro} micro-batches, "
              f"{pipe.schedule}{chunk_text}; layers " + " ".join(f"[{a},{b})" for a, b in zip(cuts, cuts[1:])))
    strategy = None
    if grid.replicas > 1:
        with world.waiting("start-up (stage allreduce)", peer=None):
            with Topology(grid.stage_comm) as topology:
                strategy = make_allreduce(plan.ring.allreduce, topology, xp, world.watchdog, plan.ring.cuda_aware,
                                          plan.ring.ring_order)
    actions = sched.actions_for(pipe.schedule, stages, micro, grid.stage, virtual)
    # the stage's chunks (one, or V: local chunk k the model's chunk kP + s), each with as many model
    # copies as the schedule holds its micro-batches at once: its activation memory
    copies = sched.chunk_peaks(actions, virtual)
    chunks = [Stage(spec, cuts, sched.chunk_index(stages, grid.stage, k), micro, xp, plan.precision.params,
                    copies=copies[k]) for k in range(virtual)]
    # --tensor-parallel: each stage's layers split over its tensor group (nn/tensor_parallel.py)
    split = grid.tensors > 1
    for chunk in chunks:
        initial_parameters(world, spec, grid, chunk, plan.data.seed)
    reader = prefetch.device_batches(inputs.reader(world.comm, grid.replica, grid.replicas, stage_arrays(grid)), xp)
    layouts = whole.Layouts(spec, cuts)
    # --compression: the stage's replicas average through its exchange (none with one replica)
    # (one chunk a stage: stages.cuts_for refuses --compression with --virtual-stages V > 1)
    compression = StageCompression(plan.compression, spec, cuts, chunks[0], strategy) if virtual == 1 else None
    # ring mode's data-parallel update over the stage's chunks (comm/data_parallel.py): ring mode's
    # buckets cut to each chunk's slice, averaged (and, --shard-optimizer: auto is ring mode's rule,
    # over the stage's R replicas, owned) bucket by bucket as there; --clip-norm's one norm over
    # every stage's chunks, summed over the world
    update = DataParallelUpdate(
        [Part(chunk.params, chunk.grads, chunk.lo, sched.chunk_index(stages, grid.stage, k),
              compression.exchange if compression is not None else None) for k, chunk in enumerate(chunks)],
        model_buckets(spec.layer_ranges, spec.num_params, plan.ring.fusion_elems), strategy,
        (plan.optimizer.name, plan.optimizer.kwargs), xp, 1.0 / (grid.replicas * micro),
        zero=plan.ring.zero, clip=Clip(plan.optimizer.clip_norm) if plan.optimizer.clip_norm else None,
        scope=NormScope(world.comm, stages * virtual, grid.replicas, grid.replica, world.watchdog,
                        TensorNorm(grid.tensors, grid.tensor, counted_ranges(spec.full, spec.cuts, grid.tensor))
                        if split else None))
    optimizers = update.optimizers
    if compression is not None and compression.exchange is not None:
        world.say(summary(compression.exchange, update.parts[0].buckets, update.sharded)
                  .replace("hpctrain: ", "hpctrain: stage 0's "))
    elif compression is not None and plan.compression.kind != "none":
        world.say(f"hpctrain: --compression {plan.compression.kind}: one replica a stage, nothing is exchanged "
                  f"and nothing compressed")

    def parts(spread=True):   # this rank's state as parts of the whole named tensors (state/layouts.py)
        return state_layouts.pipeline(spec, chunks, optimizers, plan.optimizer.name, grid.replica, grid.replicas,
                                      spread)

    # --- resume: each rank its boxes of the checkpoint's whole tensors, whatever cut, P, T or R wrote it ----
    def restore(resume):
        frame.checkpoints.restore(world.comm, resume, parts())
        for optimizer in optimizers:
            optimizer.t = resume.optimizer_t
        if compression is not None:
            pipeline_compression.restore(world, grid, compression, layouts, resume, frame.checkpoints)
    # --init-from: each rank its boxes of the pretrained parameters (tied copies follow their owners, below)
    frame.resumed(reader, restore, lambda: frame.init_from(world.comm, parts()))
    # the step's gradient: each chunk's micro-batches summed into its `grads` (the buffer the update
    # reads), the loss and stop flag over the world
    gradient = StepGradient(xp, plan.precision.compute, [(c.grads, c.model.run.extra) for c in chunks],
                            world.comm, watchdog=world.watchdog)
    # tied tensors across the cut, between stages (one chunk of each: stages.tied_in_chunks):
    # the copies start as the owner's tensor, initialised or resumed
    tied = TiedStages(world, grid, spec, cuts, chunks, gradient) if spec.ties else None
    if tied is not None:
        tied.share_parameters()

    # --- training, then the end ----------------------------------------------
    engine = Engine(world, spec, grid, chunks, update, actions, plan.data.batch_size,
                    StageTrace(world, plan.outputs, timeline, grid, chunks, optimizers), gradient,
                    compression=compression,
                    tied=tied, compute=plan.precision.compute)
    model = whole.Pipelined(world, plan, engine, parts)   # what the frame evaluates and saves, by stages
    def save(at):   # every rank writes its writer parts (checkpoints/named.py)
        checkpoints = frame.checkpoints
        positions = checkpoints.gather_positions(reader, grid.stage_comm) if grid.first and grid.tensor == 0 else None
        # --compression powersgd's state: each rank its box of the error feedback, the chief the Qs
        compressed = pipeline_compression.state(world, grid, engine.compression, layouts) \
            if engine.compression is not None else None
        checkpoints.save_parts(world.comm, at, parts(), sorted(optimizers[0].state()),
                               optimizers[0].t, positions, compressed)
    step, stopped = train_steps(world, frame, engine, reader, model, save)
    extra = {"workers": grid.replicas, "pipeline_stages": grid.stages,
             "micro_batches": micro, "schedule": pipe.schedule, "virtual_stages": virtual, "replicas": grid.replicas,
             "pipeline_split": pipe.split, "shard_optimizer": "on" if engine.sharded else "off",
             **(engine.clip.totals() if engine.clip else {}), "compression": plan.compression.kind}
    if spec.recompute:   # the chief's stage's block forwards run again
        extra["recomputed_forwards"] = sum(chunk.model.run.recomputed for chunk in engine.chunks)
    record = frame.end(step, stopped and step < frame.steps, world.comm, model,
                       save=save,
                       extra=extra, state_bytes=sum(state_bytes(o) for o in optimizers))
    if tied is not None:
        tied.free()
    return record


def initial_parameters(world, spec, grid, stage, seed):
    """The stage's (or chunk's) slice of the initial parameters and state: each stage
    draws its own layers (each layer from (seed, its index): the bits a
    whole-model build gets, with no other stage's layers allocated), and
    the stage's replicas then take replica 0's: a user's init that ignores
    its generator (an unseeded one, the time, the pid) would otherwise give
    each replica weights of its own, trained apart for the whole run
    without --shard-optimizer."""
    xp = world.xp
    stage.init(seed)
    if grid.replicas > 1:
        device.synchronize(xp)
        for what, buffer in (("parameters", stage.params), ("model state", stage.state)):
            with world.waiting(f"initial {what} broadcast over the stage's replicas",
                               peer=grid.world_rank(grid.stage, 0) if grid.replica else None):
                bcast(grid.stage_comm, buffer, root=0)


def stage_arrays(grid):
    """What of the training data this stage reads: the first stage the images,
    the last the labels, the stages between neither (they still deal the same
    batches, for their size, the dropout draws and the position)."""
    return ("images",) if grid.first else ("labels",) if grid.last else ()


def train_steps(world, frame, engine, reader, model, save):
    """The training loop from the frame's start: (the last step, whether some rank asked to stop).
    save(step): the checkpoint of `step`, collective."""
    replicas = engine.grid.replicas
    step, stopped = frame.start, False
    with frame.training():
        while step < frame.steps:
            # the reader reuses its arrays: each micro-batch's own copy
            batches = [frame.batch(reader, own=True) for _ in range(engine.micro)]
            t0 = time.perf_counter()
            loss, stopped = engine.run(batches, frame.plan.lr(step), step)
            t1 = time.perf_counter()
            frame.timed(t0, engine.schedule_done, t1)
            step += 1
            # every rank evaluates the model, through the stages
            if frame.step_ended(step, loss, replicas, engine.clip, model, stopped, save,
                                overflowed=lambda: engine.wire_overflowed):
                break
    return step, stopped
