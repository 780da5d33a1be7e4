"""The ring loop (`--mode ring`), top to bottom: every rank a peer, gradients
averaged by allreduce in fused buckets that overlap backprop, each reduced
bucket's parameters updated right away (ring_step.py builds that machinery;
frame.py does what every loop does around its steps: the start, the
batches, the accounting, the end).

    mpirun -n 4 python -m hpctrain.train --steps 200
"""
import time

from ..base import device
from ..data import prefetch
from ..checkpoints import powersgd_state as compression_state
from ..comm import make_allreduce
from ..comm.compressed_exchange import summary
from ..comm.device_buffers import bcast
from ..comm.topology import Topology
from ..optim.clipping import Clip
from ..optim.optimizers import state_bytes
from ..report.evaluated import WholeModel
from ..state import consumers, layouts
from . import ring_tensor as tensor
from . import ring_zero3 as zero3
from .frame import Frame
from .ring_step import RingStep


def train_ring(world, plan, inputs, timeline):
    xp, ring_plan, mesh = world.xp, plan.ring, world.mesh
    comm = mesh.comm("data")   # the replicas: every rank, in world order (one stage, no tensor split)
    # --tensor-parallel: each rank a slice of the model (loops/ring_tensor.py); the run's
    # agreements (resume, loss and stop, the end) over every rank, not one tensor rank's replicas
    split = mesh.size("tensor") > 1
    everyone = world.cluster.worker_comm if split else comm
    tensor_norm = tensor.attach(world, plan.spec) if split else None
    frame = Frame(world, plan, inputs, timeline, everyone)   # where the run starts, and its last step

    # --- the allreduce, then the step's buffers, model and optimizer --------
    with world.waiting("start-up (allreduce communicators)", peer=None):
        with Topology(comm) as topology:  # the strategy keeps its own duplicate of comm
            strategy = make_allreduce(ring_plan.allreduce, topology, xp, world.watchdog, ring_plan.cuda_aware,
                                      ring_plan.ring_order)
    if strategy.choice:   # which algorithm the topology got, and why
        world.say(f"hpctrain: allreduce {strategy.name} ({strategy.choice})")
    ring = RingStep(
        plan.spec, strategy, comm, xp, (plan.optimizer.name, plan.optimizer.kwargs), ring_plan.fusion_elems,
        zero=ring_plan.zero,
        clip=Clip(plan.optimizer.clip_norm) if plan.optimizer.clip_norm else None,
        marks=device.stream_marks(xp),   # GPU: events order backprop, the comm thread, the next forward
        overlap=ring_plan.overlap, timeline=timeline if timeline.enabled else None, watchdog=world.watchdog,
        accumulate=ring_plan.accumulate_steps, compression=plan.compression, dtype=plan.precision.params,
        tensor=tensor_norm, everyone=everyone, slices=ring_plan.slices)
    if ring.exchange is not None:
        world.say(summary(ring.exchange, ring.buckets, ring.sharded))
    model = ring.model
    model.init(plan.data.seed)
    # Identical start everywhere: rank 0's parameters (--zero 3: each rank drew
    # its shard from the seed, a pure function of it, and holds nothing else)
    device.synchronize(xp)
    if ring.param_shard is None:
        with world.waiting("initial parameter broadcast", peer=mesh.rank_of(data=0) if mesh.coords.data else None):
            bcast(comm, model.params, root=0)
    # GPU: pinned, async, one step ahead
    reader = prefetch.device_batches(inputs.reader(comm, mesh.coords.data, mesh.size("data")), xp)

    def parts(spread=True):   # this rank's state as parts of the whole named tensors (state/layouts.py)
        return layouts.ring(plan.spec, None if ring.param_shard is not None else model.params, model.state,
                            ring.optimizer, plan.optimizer.name, comm.Get_rank(), comm.Get_size(), ring.param_shard,
                            spread)

    def restore(resume):
        # each rank its boxes of the checkpoint's whole tensors, whatever layout wrote it
        frame.checkpoints.restore(everyone, resume, parts())
        ring.optimizer.t = resume.optimizer_t
        if ring.store is not None:   # --zero 3: the gathered copies are of the old parameters
            ring.store.forget()
        # --compression powersgd: each worker its own error feedback, every rank the Qs (an in-memory
        # commit holds none: --on-failure shrink runs without compression, run/startup.check_shrink_layout)
        if not split and resume.held is None:
            compression_state.restore(world, comm, resume, ring.exchange, ring.error, ring.layout_key,
                                      plan.compression.kind, frame.checkpoints)
    def initialize():   # --init-from: each rank its boxes of the pretrained parameters, the optimizer fresh
        frame.init_from(everyone, parts())
        if ring.store is not None:   # --zero 3: the gathered copies are of the drawn parameters
            ring.store.forget()
    frame.resumed(reader, restore, initialize)

    # --- training, then the end ---------------------------------------------
    # what the chief evaluates and saves (--zero 3: every rank together, the parameters a bucket at a time)
    evaluated = tensor.TensorModel(world, plan, model, ring, parts) if split else \
        WholeModel(world, plan, model) if ring.param_shard is None else \
        zero3.ShardedModel(world, plan, model, parts, comm)
    def save(at):   # every rank writes its writer parts (checkpoints/named.py)
        checkpoints = frame.checkpoints
        positions = checkpoints.gather_positions(reader, comm) if not split or mesh.coords.tensor == 0 else None
        # --compression powersgd: each worker writes its own row of the error feedback
        compression = compression_state.of_ring(world, comm, ring.exchange, ring.error, ring.layout_key) \
            if not split else None
        checkpoints.save_parts(everyone, at, parts(), sorted(ring.optimizer.state()),
                               ring.optimizer.t, positions, compression)
    def commit(at):   # --on-failure shrink: what a resume needs, held in memory (run/survival.py)
        held = parts(spread=False)
        # ZeRO: the shards this replica alone holds (a copy goes to its neighbour)
        alone = None if not ring.sharded else \
            (consumers.parameters(held, plan.spec) if ring.param_shard is not None else []) + \
            [p for p in held if p.name.startswith(f"{plan.optimizer.name}.")]
        world.survival.commit(at, ring.optimizer.t, frame.checkpoints.samples_at(at), frame.clock(),
                              reader.position, held, alone, comm, world.waiting,
                              tensor=(mesh.coords.tensor, mesh.size("tensor")))
    if world.survival is not None:   # the start is a commit too: a rank lost in the first K steps is survived
        commit(frame.start)
    step, stopped = train_steps(world, frame, ring, reader, evaluated, save, commit)
    ring.close()   # the communication thread ends with the loop
    extra = {"shard_optimizer": "on" if ring.sharded else "off", "zero": ring.zero,
             **(ring.clip.totals() if ring.clip else {}),
             "compression": plan.compression.kind}
    if ring.model.run.units:   # --recompute: the chief's block forwards run again
        # (--thread-split samples: the slices' copies of the model ran them)
        models = ring.trainer.copies if ring.trainer is not ring.model else [ring.model]
        extra["recomputed_forwards"] = sum(m.run.recomputed for m in models)
    if ring.exchange is not None:
        extra["sent_bytes_per_step"] = ring.sent_bytes()   # what each rank hands its allreduce, compressed
    return frame.end(step, stopped and step < frame.steps, everyone, evaluated,
                     save=save,
                     extra=extra, state_bytes=state_bytes(ring.optimizer))


def train_steps(world, frame, ring, reader, evaluated, save, commit=None):
    """The training loop from the frame's start: (the last step, whether some rank asked to stop).
    save(step): the checkpoint of `step`, collective; commit(step): --on-failure shrink's in-memory one."""
    timeline, fused, comm = frame.timeline, ring.fused, world.mesh.comm("data")
    # the losses summed: one a replica (--tensor-parallel: one a rank, each of a group the same)
    workers = ring.gradient.comm.Get_size()
    step, stopped = frame.start, False   # stopped: some rank asked to stop (the summed flag, the same everywhere)
    with frame.training():
        while step < frame.steps:
            with timeline.span("data", cat="data"):
                x, y, noise = frame.batch(reader)
            t0 = time.perf_counter()
            ring.begin(frame.plan.lr(step), world.stop.received, step)
            for _ in range(ring.accumulate_steps - 1):   # --accumulate-steps: no exchange for these
                ring.accumulate(x, y, noise=noise)
                with timeline.span("data", cat="data"):
                    x, y, noise = frame.batch(reader)
            forward_done, layer_done = timeline.model_hooks(t0, ring.layer_done, ring.forward_done)
            ring.trainer.forward_backward(x, y, on_layer_done=layer_done, on_forward_done=forward_done,
                                          loss_out=ring.loss_out, noise=noise, combine=ring.combine)
            t1 = time.perf_counter()
            with timeline.span("wait for gradients", cat="comm"):
                fused.wait()
            t2 = time.perf_counter()
            timeline.add("step", "step", t0, t2, {"step": step + 1})
            frame.timed(t0, t1, t2, fused.exposed_comm_s, fused.exposed_update_s, fused.update_s)
            step += 1
            # The summed loss and stop flag, every step, not every k: the sum
            # is the same bits on every rank, so all stop (or find the loss
            # diverged) after the same step, and a signal is taken at the next
            # step as on the CPU.
            loss, stopped = ring.summed()
            if frame.step_ended(step, loss, workers, ring.clip, evaluated, stopped, save,
                                overflowed=lambda: ring.wire_overflowed(comm, world.waiting), commit=commit):
                break
    return step, stopped
