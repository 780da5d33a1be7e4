"""The ring loop (`--mode ring`), top to bottom: every rank a peer, gradients
averaged by allreduce in fused buckets that overlap backprop, each reduced
bucket's parameters updated right away. Chief-only work stands under
`if chief:`.

    mpirun -n 4 python -m hpctrain.mnist --steps 200
"""
import time

import numpy as np

from . import device, prefetch
from .cluster import cores_available
from .comm import buffers
from .comm.fusion import FusedAllreduce
from .model import MLP, num_params
from .optim import make_optimizer
from .report import Report, finish_everywhere
from .resume import Checkpoints

# The wire: [loss, stop flag, gradients...]. Riding along with the gradient
# allreduce, the loss average and the ranks' agreement to stop cost nothing extra;
# they sit at the front because layer 0 finishes last (backprop runs backwards),
# after the loss and any signal are known.
WIRE_LOSS, WIRE_STOP, WIRE_GRADS = 0, 1, 2


def overlap_wanted(flag, xp, cluster):
    """--overlap auto: a communication thread pays only when a core is free to
    run it while backprop computes: always with a GPU doing the math, on CPUs
    only when this node has at least two cores per rank. (Measured on 2 cores,
    2 ranks: the thread's allreduce started only after backprop ended, and with
    4 ranks the extra thread cost throughput.)"""
    if flag != "auto":
        return flag == "on"
    return device.is_gpu(xp) or cores_available() >= 2 * cluster.local_size


def train_ring(session):
    args, cluster, xp = session.args, session.cluster, session.xp
    chief, comm, workers = session.chief, cluster.worker_comm, cluster.num_workers
    report, checkpoints, timeline = Report(session), Checkpoints(session), session.timeline

    # --- model, optimizer, data, allreduce ----------------------------------
    n = num_params(args.hidden)
    wire = xp.zeros(WIRE_GRADS + n, np.float32)
    model = MLP(args.hidden, xp, grads=wire[WIRE_GRADS:])
    model.init(args.seed)
    # Identical start everywhere: rank 0's parameters.
    device.synchronize(xp)
    with session.watchdog.waiting("initial parameter broadcast", peer=0):
        buffers.bcast(comm, model.params, root=0)
    optimizer = make_optimizer(args.optimizer, n, xp, momentum=args.momentum)
    reader = prefetch.device_batches(session.open_reader(), xp)  # GPU: pinned, async, one step ahead
    allreduce = buffers.make_exchange(args, comm, xp, session.watchdog)  # GPU: direct, staged or NCCL
    # Buckets of the wire are allreduced as backprop finishes them, and each
    # reduced bucket's parameters are updated right away (comm/fusion.py).
    ready_from = [0] + [WIRE_GRADS + lo for lo, _ in model.layer_ranges[1:]]
    fused = FusedAllreduce(
        allreduce, wire, ready_from, int(args.fusion_mb * (1 << 20)) // wire.itemsize,
        sync=lambda: device.synchronize(xp),
        on_reduced=lambda lo, hi: optimizer.update(model.params, model.grads, max(lo - WIRE_GRADS, 0),
                                                   hi - WIRE_GRADS),
        overlap=overlap_wanted(args.overlap, xp, cluster),
        timeline=timeline if timeline.enabled else None, watchdog=session.watchdog)

    # --- resume: every rank holds the whole state, so the chief's copy goes to all
    step = 0
    resume = checkpoints.load(comm)
    if resume is not None:
        checkpoints.broadcast_state(comm, resume, model.params, optimizer)
        checkpoints.seek_readers(reader, resume)
        step = resume.step
        session.chief_says(checkpoints.resumed_line(step))
    report.metrics.resume_at(checkpoints.saved_step)   # None: a fresh run, a fresh file

    def checkpoint_now():
        positions = checkpoints.gather_positions(reader)
        checkpoints.save(comm, step, model.params, optimizer.state(), optimizer.t, positions)

    # --- training -------------------------------------------------------------
    comm_s = compute_s = 0.0
    samples = 0
    loss_sum, loss_count = xp.zeros(1, np.float64), 0
    grad_scale = 1.0 / workers
    t_loop = time.perf_counter()
    while step < args.steps:
        with timeline.span("data", cat="data"):
            x, y = reader.next_batch()
            x, y = xp.asarray(x), xp.asarray(y)
        t0 = time.perf_counter()
        wire[WIRE_STOP] = 1.0 if session.stop.received else 0.0
        optimizer.begin(session.lr(step), grad_scale)
        forward_done, layer_done = timeline.model_hooks(t0, fused.layer_done)
        model.forward_backward(x, y, on_layer_done=layer_done, on_forward_done=forward_done,
                               loss_out=wire[WIRE_LOSS:WIRE_LOSS + 1])
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
        loss_sum += wire[WIRE_LOSS:WIRE_LOSS + 1]  # on the device: no sync per step
        loss_count += 1
        if step % args.log_every == 0 or step == args.steps:
            if chief:
                mean_loss = float(loss_sum[0]) / loss_count / workers
                report.progress(step, mean_loss, samples, time.perf_counter() - t_loop)
            loss_sum[...] = 0
            loss_count = 0
        if chief:
            t_loop += report.periodic_eval(model, step)
        if float(wire[WIRE_STOP]) > 0:
            break
        if checkpoints.due(step):
            checkpoint_now()
    t_loop = time.perf_counter() - t_loop

    # --- the end: the last checkpoint (at the end of training, or where a
    # signal stopped it), then either the pre-emption exit or the results
    if checkpoints.enabled and checkpoints.saved_step != step:
        checkpoint_now()
    if float(wire[WIRE_STOP]) > 0 and step < args.steps:
        if chief:
            report.metrics.close(keep=True)
        checkpoints.preempted(comm, step)
    return finish_everywhere(session, report, model, step, t_loop, samples, comm_s, compute_s, checkpoints)
