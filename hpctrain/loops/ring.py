"""The ring loop (`--mode ring`), top to bottom: every rank a peer, gradients
averaged by allreduce in fused buckets that overlap backprop, each reduced
bucket's parameters updated right away (ring_step.py builds that machinery;
frame.py does what every loop does around its steps).

    mpirun -n 4 python -m hpctrain.train --steps 200
"""
import time

import numpy as np
from mpi4py import MPI

from ..run import plan as run_config
from .. import device, prefetch
from ..optim.clipping import Clip
from ..comm import make_allreduce
from ..comm.device_buffers import bcast
from ..comm.topology import Topology
from .frame import Frame
from ..optim.optimizers import state_bytes
from ..report.report import Report
from ..checkpoints.resume import Checkpoints
from .ring_step import RingStep


def train_ring(session):
    args, cluster, xp = session.args, session.cluster, session.xp
    comm = cluster.worker_comm
    checkpoints, timeline = Checkpoints(session), session.timeline

    # --- where the run starts, and its settings from there on ---------------
    resume = checkpoints.load(comm)
    config = run_config.decide(session, resume)
    report = Report(session, config)

    # --- the allreduce, then the step's buffers, model and optimizer --------
    with session.watchdog.waiting("start-up (allreduce communicators)", peer=None):
        with Topology(comm) as topology:  # the strategy keeps its own duplicate of comm
            strategy = make_allreduce(args.allreduce, topology, xp, session.watchdog, args.cuda_aware,
                                      args.ring_order)
    if strategy.choice:   # which algorithm the topology got, and why
        session.chief_says(f"hpctrain: allreduce {strategy.name} ({strategy.choice})")
    sharded = config.shard_optimizer
    clip = Clip(args.clip_norm) if args.clip_norm else None
    ring = RingStep(
        config.spec, strategy, comm, xp, (args.optimizer, dict(momentum=args.momentum, weight_decay=args.weight_decay)),
        run_config.fusion_elems(args), sharded=sharded, clip=clip,
        marks=device.stream_marks(xp),   # GPU: events order backprop, the comm thread, the next forward
        overlap=config.overlap,
        timeline=timeline if timeline.enabled else None, watchdog=session.watchdog,
        accumulate=args.accumulate_steps)
    model, optimizer = ring.model, ring.optimizer
    model.init(args.seed)
    # Identical start everywhere: rank 0's parameters.
    device.synchronize(xp)
    with session.watchdog.waiting("initial parameter broadcast", peer=0 if cluster.rank else None):
        bcast(comm, model.params, root=0)
    reader = prefetch.device_batches(session.open_reader(), xp)  # GPU: pinned, async, one step ahead

    # --- resume: every rank holds the whole state, so the chief's copy goes to all
    step = 0
    if resume is not None:
        checkpoints.broadcast_state(comm, resume, model.params, optimizer)
        checkpoints.broadcast_model_state(comm, resume, model.state)
        checkpoints.seek_readers(reader, resume)
        step = resume.step
        session.chief_says(checkpoints.resumed_line(resume, config))
    report.resume_at(checkpoints.saved_step, resume)   # None: a fresh run, a fresh file
    checkpoints.more_attrs = report.checkpoint_attrs   # --keep-best's best so far

    # --- training, then the end ---------------------------------------------
    frame = Frame(session, config, report, checkpoints, step)
    step, stopped = train_steps(session, config, frame, ring, reader, step)
    ring.close()   # the communication thread ends with the loop
    return finish(session, config, frame, ring, reader, step, preempted=stopped and step < config.steps)


def train_steps(session, config, frame, ring, reader, step):
    """The training loop from `step`: (the last step, whether some rank asked to stop)."""
    xp, timeline, model, fused = session.xp, session.timeline, ring.model, ring.fused
    noisy, seed = config.spec.draws_noise, config.args.seed   # dropout: masks of (seed, epoch, sample id)
    workers, per_step = session.cluster.num_workers, config.worker_batch * session.cluster.num_workers
    stopped = False   # some rank asked to stop: the summed flag, the same on every rank
    with frame.training():
        while step < config.steps:
            with timeline.span("data", cat="data"):
                x, y = reader.next_batch()
                x, y = xp.asarray(x), xp.asarray(y)
            t0 = time.perf_counter()
            ring.begin(config.lr(step), session.stop.received)
            for _ in range(ring.accumulate_steps - 1):   # --accumulate-steps: no exchange for these
                ring.accumulate(x, y, noise=(seed, *reader.last_draw) if noisy else None)
                with timeline.span("data", cat="data"):
                    x, y = reader.next_batch()
                    x, y = xp.asarray(x), xp.asarray(y)
            forward_done, layer_done = timeline.model_hooks(t0, ring.layer_done, ring.forward_done)
            model.forward_backward(x, y, on_layer_done=layer_done, on_forward_done=forward_done,
                                   loss_out=ring.loss_out, noise=(seed, *reader.last_draw) if noisy else None)
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
            frame.summed_loss(step, loss, workers, per_step, grad_norm=ring.clip.mean_norm if ring.clip else None)
            frame.after_step(model, step)
            if stopped:
                if step < config.steps:
                    frame.stopping(step)
                break
            if frame.checkpoint_due(step):
                save_checkpoint(session, frame.checkpoints, ring, reader, step)
    return step, stopped


def save_checkpoint(session, checkpoints, ring, reader, step):
    comm = session.cluster.worker_comm
    positions = checkpoints.gather_positions(reader)
    # Sharded: the chief gathers the full-length state (the same file either way).
    state = checkpoints.gather_state(comm, ring.optimizer) if ring.sharded else ring.optimizer.state()
    checkpoints.save(comm, step, ring.model.params, state, ring.optimizer.t, positions, ring.model.state)


def finish(session, config, frame, ring, reader, step, preempted):
    """The last checkpoint (at the end of training, or where a signal stopped
    it), then either the pre-emption exit or the results."""
    checkpoints, comm = frame.checkpoints, session.cluster.worker_comm
    if session.chief and session.has_val and not preempted:
        frame.report.final_val(ring.model, step)   # before the last checkpoint: it records the best
    if checkpoints.enabled and checkpoints.saved_step != step:
        save_checkpoint(session, checkpoints, ring, reader, step)
    if preempted:
        checkpoints.raise_preempted(comm, step)
    # The largest optimizer state any rank holds (sharded: about 1/N of it).
    state = np.array([state_bytes(ring.optimizer)], np.int64)
    with session.watchdog.waiting("optimizer state size allreduce", peer=None):
        comm.Allreduce(MPI.IN_PLACE, state, op=MPI.MAX)
    extra = {"shard_optimizer": "on" if ring.sharded else "off", "optimizer_state_bytes": int(state[0])}
    if ring.clip:
        extra.update(ring.clip.totals())
    return frame.finish(ring.model, step, config.worker_batch * session.cluster.num_workers, extra)
