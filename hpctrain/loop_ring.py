"""The ring loop (`--mode ring`), top to bottom: every rank a peer, gradients
averaged by allreduce in fused buckets that overlap backprop, each reduced
bucket's parameters updated right away. Chief-only work stands under
`if chief:`.

    mpirun -n 4 python -m hpctrain.mnist --steps 200
"""
import math
import time

import numpy as np
from mpi4py import MPI

from . import device, prefetch
from .clipping import Clip
from .cluster import cores_available
from .comm import make_allreduce
from .comm.device_buffers import bcast
from .comm.fusion import FusedAllreduce
from .comm.norm import BucketNorm
from .comm.topology import Topology
from .comm.wire import GRADS, LOSS, STOP, Wire
from .errors import EXIT_DIVERGED, HpctrainError
from .optim import make_optimizer, state_bytes
from .report import Report, finish_everywhere
from .resume import Checkpoints

def overlap_wanted(flag, xp, cluster, thread_multiple=True):
    """--overlap auto: a communication thread pays only when a core is free to
    run it while backprop computes: always with a GPU doing the math, on CPUs
    only when this node has at least two cores per rank. (Measured on 2 cores,
    2 ranks: the thread's allreduce started only after backprop ended, and with
    4 ranks the extra thread cost throughput.) Never without
    MPI_THREAD_MULTIPLE: two threads would call MPI at once."""
    if not thread_multiple:
        return False
    if flag != "auto":
        return flag == "on"
    return device.is_gpu(xp) or cores_available() >= 2 * cluster.local_size

def shard_wanted(flag, workers=1, xp=np, allreduce="auto"):
    """--shard-optimizer auto is a fixed rule, not a measurement: on where
    `python -m hpctrain.bench train --compare shard-optimizer=off,on` measured
    it faster (1.20-1.35x at 2 and 4 ranks for 2.6 to 80 MB of gradients, on
    CPUs) and where it gives the same parameters bit for bit: 2 or more
    workers, NumPy, and hpctrain's own ring or hierarchical allreduce
    (`--allreduce auto|ring|hier`; MPI's reduce-scatter sums in another
    order). Off on GPUs until the device check has compared both there."""
    if flag != "auto":
        return flag == "on"
    return workers >= 2 and xp is np and allreduce in ("auto", "ring", "hier")

def diverged(step, loss, report):
    """The error that ends a run whose loss became inf or nan (exit 4: a requeue
    would only diverge again; the last checkpoint, if any, is from before)."""
    return HpctrainError(f"the loss became {loss} at step {step}: training diverged (try a lower --lr "
                         f"or --warmup-steps); no checkpoint of these parameters is written",
                         exit_code=EXIT_DIVERGED, collective=True, report=report)

def train_ring(session):
    args, cluster, xp = session.args, session.cluster, session.xp
    chief, comm, workers = session.chief, cluster.worker_comm, cluster.num_workers
    report, checkpoints, timeline = Report(session), Checkpoints(session), session.timeline

    # --- model, optimizer, data, allreduce ----------------------------------
    n = session.num_params()   # the data's manifest shapes the model
    wire = Wire(n, xp)  # [loss, stop, grads...]: comm/wire.py
    sharded = shard_wanted(args.shard_optimizer, workers, xp, args.allreduce)
    # Sharded: the parameters in a buffer laid out like the wire, so each
    # bucket's allgather carries them; its loss and stop slots get the sums.
    params_wire = Wire(n, xp) if sharded else None
    model = session.model(xp, params=params_wire.grads if sharded else None, grads=wire.grads)
    model.init(args.seed)
    # Identical start everywhere: rank 0's parameters.
    device.synchronize(xp)
    with session.watchdog.waiting("initial parameter broadcast", peer=0 if cluster.rank else None):
        bcast(comm, model.params, root=0)
    reader = prefetch.device_batches(session.open_reader(), xp)  # GPU: pinned, async, one step ahead
    with session.watchdog.waiting("start-up (allreduce communicators)", peer=None):
        with Topology(comm) as topology:  # the strategy keeps its own duplicate of comm
            strategy = make_allreduce(args.allreduce, topology, xp, session.watchdog, args.cuda_aware,
                                      args.ring_order)
    if strategy.choice:   # which algorithm the topology got, and why
        session.chief_says(f"hpctrain: allreduce {strategy.name} ({strategy.choice})")
    # Buckets of the wire are allreduced as backprop finishes them, and each
    # reduced bucket's parameters are updated right away (comm/fusion.py).
    # Sharded: reduce-scattered, this rank's part updated, parameters allgathered.
    def update_owned(lo, hi):
        wire.pass_head(params_wire, lo, hi)
        optimizer.update(model.params, model.grads, *wire.grads_range(lo, hi))

    # --clip-norm: the factor needs the whole summed gradient's norm, so the
    # updates wait for the last bucket (comm/fusion.py's deferred updates).
    clip = Clip(args.clip_norm) if args.clip_norm else None
    grad_scale = 1.0 / workers   # the summed gradient's average
    fused = FusedAllreduce(
        strategy, wire.buffer, wire.ready_from(model.layer_ranges),
        int(args.fusion_mb * (1 << 20)) // wire.buffer.itemsize,
        marks=device.stream_marks(xp),   # GPU: events order backprop, the comm thread, the next forward
        on_reduced=update_owned if sharded else
        lambda lo, hi: optimizer.update(model.params, model.grads, *wire.grads_range(lo, hi)),
        overlap=overlap_wanted(args.overlap, xp, cluster, session.thread_multiple),
        timeline=timeline if timeline.enabled else None, watchdog=session.watchdog,
        gather=params_wire.buffer if sharded else None,
        before_updates=(lambda: optimizer.set_grad_scale(clip.scaled(norm.partials(), grad_scale)))
        if clip else None)
    if clip:
        # The norm of the gradient part only (the loss and stop slots ride along),
        # the same bits sharded or not (comm/norm.py).
        norm = BucketNorm(strategy, fused.buckets, wire.buffer, skip=GRADS, sharded=sharded, comm=comm,
                          watchdog=session.watchdog)
    # Sharded: state only for the gradient ranges this rank owns (~1/N).
    owned = [wire.grads_range(lo, hi) for lo, hi in fused.owned()] if sharded else None
    optimizer = make_optimizer(args.optimizer, n, xp, momentum=args.momentum, owned=owned,
                               weight_decay=args.weight_decay)

    # --- resume: every rank holds the whole state, so the chief's copy goes to all
    step = 0
    resume = checkpoints.load(comm)
    if resume is not None:
        checkpoints.broadcast_state(comm, resume, model.params, optimizer)
        checkpoints.seek_readers(reader, resume)
        step = resume.step
        session.chief_says(checkpoints.resumed_line(resume))
    report.resume_at(checkpoints.saved_step, resume)   # None: a fresh run, a fresh file
    checkpoints.more_attrs = report.checkpoint_attrs   # --keep-best's best so far

    def checkpoint_now():
        positions = checkpoints.gather_positions(reader)
        # Sharded: the chief gathers the full-length state (the same file either way).
        state = checkpoints.gather_state(comm, optimizer) if sharded else optimizer.state()
        checkpoints.save(comm, step, model.params, state, optimizer.t, positions)

    # --- training -------------------------------------------------------------
    comm_s = compute_s = 0.0
    samples = 0
    loss_sum, loss_count = 0.0, 0
    stopped = False   # some rank asked to stop: the summed flag, the same on every rank
    t_loop = time.perf_counter()
    session.stop.phase = "training"   # a stop signal is taken by the next step from here on
    while step < args.steps:
        with timeline.span("data", cat="data"):
            x, y = reader.next_batch()
            x, y = xp.asarray(x), xp.asarray(y)
        t0 = time.perf_counter()
        wire.set_stop(session.stop.received)
        optimizer.begin(session.lr(step), grad_scale)
        forward_done, layer_done = timeline.model_hooks(t0, fused.layer_done)
        model.forward_backward(x, y, on_layer_done=layer_done, on_forward_done=forward_done,
                               loss_out=wire.loss)
        t1 = time.perf_counter()
        with timeline.span("wait for gradients", cat="comm"):
            fused.wait()
        t2 = time.perf_counter()
        timeline.add("step", "step", t0, t2, {"step": step + 1})
        compute_s += t1 - t0
        comm_s += t2 - t1
        session.stats.record(t2 - t0, t1 - t0, t2 - t1, fused.exposed_comm_s, fused.exposed_update_s,
                             fused.update_s)
        step += 1
        samples += args.batch_size * workers
        # The summed loss and stop flag, read every step from the host copy
        # that fused.wait() leaves (comm/fusion.py's `head`: the staged path's
        # host buffer, else two floats copied by the thread that reduced them),
        # never from the device: the main thread does not wait for the
        # optimizer's kernels, and the GPU runs them while the host reads the
        # next batch. Every step, not every k: the sum is the same bits on
        # every rank, so all stop (or find the loss diverged) after the same
        # step, and a signal is taken at the next step as on the CPU.
        loss, stopped = float(fused.head[LOSS]), bool(fused.head[STOP] > 0)
        if not math.isfinite(loss):
            raise diverged(step, loss / workers, chief)
        loss_sum += loss
        loss_count += 1
        if step % args.log_every == 0 or step == args.steps:
            if chief:
                mean_loss = loss_sum / loss_count / workers
                report.progress(step, mean_loss, samples, time.perf_counter() - t_loop,
                                grad_norm=clip.mean_norm() if clip else None)
            loss_sum, loss_count = 0.0, 0
        if chief:
            t_loop += report.periodic_eval(model, step)
        if stopped:
            break
        if checkpoints.due(step):
            checkpoint_now()
    t_loop = time.perf_counter() - t_loop
    if not stopped:
        session.stop.phase = "finishing"   # a signal now may find a rank stuck: the watchdog acts on it

    # --- the end: the last checkpoint (at the end of training, or where a
    # signal stopped it), then either the pre-emption exit or the results
    if chief and session.has_val and not (stopped and step < args.steps):
        report.final_val(model, step)   # before the last checkpoint: it records the best
    if checkpoints.enabled and checkpoints.saved_step != step:
        checkpoint_now()
    if stopped and step < args.steps:
        if chief:
            report.metrics.close()
        checkpoints.preempted(comm, step)
    # The largest optimizer state any rank holds (sharded: about 1/N of it).
    state = np.array([state_bytes(optimizer)], np.int64)
    with session.watchdog.waiting("optimizer state size allreduce", peer=None):
        comm.Allreduce(MPI.IN_PLACE, state, op=MPI.MAX)
    extra = {"shard_optimizer": "on" if sharded else "off", "optimizer_state_bytes": int(state[0])}
    if clip:
        extra.update(clip.totals())
    return finish_everywhere(session, report, model, step, t_loop, samples, comm_s, compute_s, checkpoints,
                             extra=extra)
