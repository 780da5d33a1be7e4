"""The parameter-server loop (`--mode ps`), top to bottom: `train_ps(world,
plan, inputs, timeline)` turns the world's ranks into servers and workers and trains,
synchronously (the default) or asynchronously. The protocol itself is
hpctrain/comm/ps/; this file wires it to the model, optimizer, data,
reports and checkpoints (through the frame, loops/frame.py), as loops/ring.py
does for the ring.

    mpirun -n 4 python -m hpctrain.mnist --mode ps --num-ps 2            # sync, 2 ps + 2 workers
    mpirun -n 4 python -m hpctrain.mnist --mode ps --num-ps 2 --async    # async
    mpirun -n 4 python -m hpctrain.mnist --mode ps --backup-workers 1    # 1 ps, 3 workers, 1 backup

Servers (--num-ps ranks, placed by --ps-ranks: cluster.server_ranks) each own a slice of the flat parameter vector and
its optimizer state and run `Server.serve_until_done()` (`run_server`). Workers pull, compute, push; the
chief (worker 0) initializes the servers with its initial parameters (the same
as ring mode's for the same seed), logs, evaluates and writes the files.

Checkpoints (--checkpoint-dir): the chief makes a checkpoint's temporary
folder and sends its path with the request (SNAPSHOT every
--checkpoint-every steps; the final request at the end or after a signal);
each server writes its slice and optimizer state there as its own rank file
(`server_files`: the ps layout of state/layouts.py through
checkpoints/named.py, as ring ranks write theirs) and replies with what it
wrote; the chief adds its non-trainable state and the data positions that
the workers' pushes carried to ps 0, checks the tiling and writes the
index. On resume the chief sends each server the checkpoint's path
(RESTORE), and each reads its own boxes (an old flat file: the chief reads
it and sends the slices); the workers seek their readers, so sync training
resumes bit for bit.

Faults (a straggler, a hung server, a signal) are injected by the tests
(tests/faults/inject_ps.py), not here.

GPU workers get their batches through the prefetcher (pinned memory, one
step ahead) and hand MPI the model's own device buffers on a CUDA-aware MPI,
else pinned host mirrors of them, allocated once (comm/device_buffers.py):
one device-to-host copy of the gradients and one copy back of the
parameters per round. For NumPy the mirrors are the buffers themselves and
the reader is used as it is: one loop serves both.
"""
import contextlib
import math
import time
from dataclasses import dataclass

import numpy as np

from ..base import device
from ..data import prefetch
from ..comm.cuda_aware import cuda_aware
from ..comm.device_buffers import HostMirror
from ..comm.ps import Client, ProtocolError, Server, describe, place, summarize
from ..comm.ps.placement import slice_size
from ..comm.ps.server import reply_buffers_needed
from ..comm.ps.shared import open_shared
from ..comm.step_gradient import StepGradient
from ..base.errors import EXIT_TIMEOUT, HpctrainError
from ..optim.clipping import Clip
from ..optim.on_device import OnDevice
from ..optim.optimizers import make_optimizer
from ..report.evaluated import WholeModel
from ..state import layouts
from ..state.consumers import finite, parameters, restore
from .frame import Frame, diverged


def exchange_name(client):
    """How this worker exchanges with the servers (the final record's ps_exchange)."""
    shm = sum(client.in_window)
    return "mpi" if not shm else "shared" if shm == client.num_servers else "shared+mpi"


EXCHANGE_LINES = {"mpi": "MPI messages",
                  "shared": "shared memory (only the headers are MPI messages)",
                  "shared+mpi": "shared memory with the servers on its node, MPI messages with the others"}


def cluster_lines(world, plan, placement, exchange="mpi", why_not=""):
    """The chief's start-up picture: roles in TensorFlow's naming, placement."""
    cluster, ps = world.cluster, plan.ps
    tensor_ranges = plan.spec.tensor_ranges()
    n = tensor_ranges[-1][2]
    lines = ["cluster:"]
    for r in range(cluster.size):
        lines.append(f"  {cluster.role_name(r)} = rank {r}" + ("  (chief)" if r == cluster.chief_rank else ""))
    lines.append(f"placement {ps.placement}: {n:,} parameters ({4 * n:,} bytes) on {cluster.num_ps} ps")
    for k, (count, parts) in enumerate(describe(placement, tensor_ranges)):
        lines.append(f"  /job:ps/task:{k}: {count:,} parameters, {4 * count:,} bytes: {', '.join(parts) or '-'}")
    lines.append(f"exchange (--ps-exchange {ps.exchange}): the chief uses {EXCHANGE_LINES[exchange]}"
                 + (f": {why_not}" if why_not else ""))
    if ps.sync:
        R = ps.replicas
        lines.append(f"sync: each update aggregates {R} of {cluster.num_workers} workers' gradients"
                     + (f" ({cluster.num_workers - R} backup)" if R < cluster.num_workers else "")
                     + ("; --max-staleness/--dc-lambda apply to --async only"
                        if ps.max_staleness is not None or ps.dc_lambda else ""))
    else:
        lines.append("async: each gradient applied on arrival"
                     + (f"; max staleness {ps.max_staleness}" if ps.max_staleness is not None else "")
                     + (f"; DC-ASGD lambda {ps.dc_lambda:g}" if ps.dc_lambda else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------

def train_ps(world, plan, inputs, timeline):
    cluster = world.cluster
    # The protocol's own communicator: its tags never meet anyone else's
    # messages. MPI_Comm_dup is a collective: a rank that never comes must
    # not hold the others in it past --timeout (CI saw it wait for ever).
    with world.waiting("start-up (ps communicator)", peer=None):
        comm = cluster.comm.Dup()
    # Workers open their data; the servers learn whether that worked, so a bad
    # data directory never leaves them waiting for workers that have exited.
    reader = world.agreed(cluster.comm, (lambda: inputs.reader(cluster.worker_comm, cluster.worker_index,
                                                               cluster.num_workers)) if cluster.is_worker
                          else lambda: None)
    # With --checkpoint-dir: every rank learns whether (and from which step)
    # the run resumes; the chief then loads the servers (RESTORE).
    frame = Frame(world, plan, inputs, timeline, cluster.comm)
    placement = place(plan.spec.tensor_ranges(), cluster.num_ps, plan.ps.placement)
    shared, why_not = open_exchange(world, plan, placement)
    if cluster.is_ps:
        result = run_server(world, plan, frame, comm, placement, shared)
    else:
        result = run_worker(world, plan, frame, comm, reader, placement, shared, why_not)
    if shared is not None:   # MPI_Finalize frees the window (shared.py: why not MPI_Win_free here)
        shared.close()
    return result


def open_exchange(world, plan, placement):
    """(this node's shared-memory window for the ps exchange (comm/ps/shared.py)
    or None, why not in words): None with --ps-exchange mpi, a node without
    both roles, a GPU worker on it, or /dev/shm too small. Collective over
    the node's ranks."""
    cluster = world.cluster
    return open_shared(cluster, enabled=plan.ps.exchange == "auto",
                       able=cluster.is_ps or not device.is_gpu(world.xp),
                       num_params=plan.spec.num_params, server_sizes=[slice_size(r) for r in placement],
                       reply_bufs=reply_buffers_needed(plan.ps.sync, plan.ps.replicas, cluster.num_workers),
                       dtype=plan.precision.params, watchdog=world.watchdog)


def run_server(world, plan, frame, comm, placement, shared):
    cluster, ps, opt = world.cluster, plan.ps, plan.optimizer
    mine = placement[cluster.ps_index]
    size = sum(hi - lo for lo, hi in mine)
    if ps.device == "gpu":
        # The slice and its optimizer state on this rank's GPU; messages stay on the host.
        optimizer = OnDevice(make_optimizer(opt.name, size, world.server_xp, at=mine, **opt.kwargs), size)
    else:
        # --weight-decay is the optimizer's own (decoupled, per element, on
        # the model's decay ranges as they fall in this server's slices `at`):
        # each server decays its slice as ring mode decays the whole buffer.
        optimizer = make_optimizer(opt.name, size, np, at=mine, **opt.kwargs)
    server = Server(comm, mine, cluster.worker_ranks, cluster.ps_ranks, optimizer, plan.lr,
                    steps=frame.steps, sync=ps.sync, replicas=ps.replicas, max_staleness=ps.max_staleness,
                    dc_lambda=ps.dc_lambda, watchdog=world.watchdog,
                    stop_requested=lambda: world.stop.received, nap=world.waits.nap,
                    # --clip-norm, sync: on the aggregate (async: each worker clips its own)
                    clip=Clip(opt.clip_norm) if opt.clip_norm and ps.sync else None,
                    servers_comm=cluster.ps_comm, shared=shared, dtype=plan.precision.params,
                    **server_files(plan, mine, cluster.rank))
    with world.stop.training() as phase:   # the server loop takes stop requests from here on
        server.serve_until_done()
        phase.stopped = server.round.preempted
    if server.round.preempted:   # every rank agrees (the leader's flag reached all): exit 75 together
        frame.checkpoints.raise_preempted(cluster.comm, server.round.version)
    return None


def server_files(plan, ranges, rank):
    """A server's `write` and `read` (comm/ps/server.Server's) of its parts
    in a checkpoint folder: the ps layout (state/layouts.ps_server: `ranges`
    of the flat parameters and their optimizer state, host arrays: an
    --ps-device gpu optimizer's state() is its host copy). write: rank
    `rank`'s file (checkpoints/named.write_part), and whether its parameters
    are finite; read: each part's box from the folder's rank files, as ring
    ranks restore theirs (state/consumers.restore)."""
    from ..checkpoints.named import open_checkpoint, write_part
    from ..checkpoints.trust import Corrupt
    spec, name = plan.spec, plan.optimizer.name

    def write(folder, params, states):
        parts = layouts.ps_server(spec, ranges, params, states, name)
        pieces = [(p.name, p.box, np.ascontiguousarray(p.view, plan.precision.params)) for p in parts]
        return dict(write_part(folder, rank, pieces), finite=finite(parameters(parts, spec)))

    def read(folder, params, states):
        try:
            with open_checkpoint(folder) as ckpt:
                restore(layouts.ps_server(spec, ranges, params, states, name), ckpt.read_as(spec))
        except Corrupt as e:   # checked by the chief already: changed since
            raise HpctrainError(f"{folder}: {e}") from None
    return {"write": write, "read": read}


def save_cut(plan, checkpoints, cut, folder, keys, model):
    """The checkpoint of the servers' Cut, written into `folder` by them, at
    ps 0's version and optimizer step, with the chief's own non-trainable
    model state (batch-norm statistics). Sync: every server is at that
    version (ps 0's hold makes it so: anything else is a bug). Async: each
    server's slice as it was while held, with the updates it applied; the
    servers' own counts may differ and resume from ps 0's (docs/ps.md,
    "Checkpoints in ps mode")."""
    if plan.ps.sync and not cut.consistent:
        raise ProtocolError(f"a sync checkpoint cut is not one version: {cut.describe()}")
    parts = layouts.ps_worker(plan.spec, model.params, model.state, chief=True)   # it writes the state alone
    checkpoints.save_written(cut.versions[0], folder, parts, cut.written, keys, cut.ts[0], cut.positions)


@dataclass
class Worker:
    """What a worker trains with: the model, the host mirrors MPI reads and
    writes, the protocol's client, the optimizer's state names (for
    checkpoints), async --clip-norm's clip, and the step's gradient."""
    model: object
    pm: HostMirror
    gm: HostMirror
    client: Client
    state_names: tuple
    clip: object
    gradient: object   # the first K - 1 micro-batches' gradients, tied uses and losses (comm/step_gradient.py)
    evaluated: object  # report/evaluated.WholeModel: what the chief evaluates and saves


def run_worker(world, plan, frame, comm, reader, placement, shared, why_not=""):
    reader = prefetch.device_batches(reader, world.xp)   # GPU: pinned, async, one step ahead
    w = start_worker(world, plan, frame, comm, placement, shared, why_not)
    chief, workers = world.chief, world.cluster.worker_comm

    def resume_from(resume):
        restore_state(world, plan, frame.checkpoints, resume, w.model)
        if chief:   # the servers: the checkpoint's parameters, optimizer state and data positions
            start_servers(w.client, resume, w.model, w.state_names, world.cluster.num_workers)

    def initialize():   # --init-from: every worker's copy from the file (its parts), the optimizer fresh
        frame.init_from(workers, layouts.ps_worker(plan.spec, w.model.params, w.model.state, chief))
    frame.resumed(reader, resume_from, initialize)
    if chief and frame.resume is None:   # the servers: the chief's initial (or --init-from) parameters
        start_servers(w.client, None, w.model, w.state_names, world.cluster.num_workers)
    w.pm.recv_buffer()
    w.client.pull()
    w.pm.to_device()
    local = worker_steps(world, plan, frame, w, reader)
    return end_worker(world, plan, frame, w, local)


def restore_state(world, plan, checkpoints, resume, model):
    """Every worker's non-trainable state (batch-norm statistics), the
    checkpoint's (the servers take the parameters and optimizer state from
    the chief: start_servers, after it)."""
    spec = plan.spec
    checkpoints.restore(world.cluster.worker_comm, resume,
                        layouts.buffer_parts(spec, [(0, spec.num_state)], model.state, of="state"))


def start_worker(world, plan, frame, comm, placement, shared, why_not):
    cluster, xp, spec = world.cluster, world.xp, plan.spec
    # In a shared-memory window, backprop writes the gradient where the servers read it.
    model = spec.build(xp, dtype=plan.precision.params) if shared is None else \
        spec.build(xp, grads=shared.worker_grads(cluster.rank, spec.num_params), dtype=plan.precision.params)
    model.init(plan.data.seed)
    # What MPI reads and writes: the model's buffers (NumPy; GPU with a
    # CUDA-aware MPI: point-to-point, so no agreement between ranks is needed)
    # or pinned host mirrors of them. Kept for the whole run (see HostMirror).
    direct = device.is_gpu(xp) and cuda_aware(plan.ring.cuda_aware)[0]
    pm, gm = HostMirror(model.params, direct=direct), HostMirror(model.grads, direct=direct)
    client = Client(comm, cluster.ps_ranks, placement, pm.host, gm.host, cluster.worker_index, cluster.num_workers,
                    sync=plan.ps.sync, watchdog=world.watchdog, nap=world.waits.nap, shared=shared)
    state_names = make_optimizer(plan.optimizer.name, 1, np).state_names
    if world.chief:
        print(cluster_lines(world, plan, placement, exchange_name(client), why_not), flush=True)
    # async: each worker clips its own gradient (sync: the servers clip the aggregate)
    clip = Clip(plan.optimizer.clip_norm) if plan.optimizer.clip_norm and not plan.ps.sync else None
    # no allreduce of its own: the push carries the loss and stop request
    gradient = StepGradient(xp, model.grads.dtype, [(xp.zeros(spec.num_params, model.grads.dtype), model.extra)]
                            if plan.ring.accumulate_steps > 1 else ())
    return Worker(model, pm, gm, client, state_names, clip, gradient, WholeModel(world, plan, model))


def worker_steps(world, plan, frame, w, reader):
    """The training loop: pull, compute, push, until the servers say stop.
    Returns the steps this worker computed."""
    tl, chief, sync, k = frame.timeline, world.chief, plan.ps.sync, plan.ring.accumulate_steps
    model, client, pm, gm, clip, evaluated = w.model, w.client, w.pm, w.gm, w.clip, w.evaluated
    norms = []   # sync --clip-norm: the servers' pre-clip norm of each round
    local = 0
    with frame.training():
        while not client.stop:
            with tl.span("data", cat="data"):
                x, y, noise = frame.batch(reader)
            t0 = time.perf_counter()
            with tl.span("forward+backward", cat="compute"):
                # --accumulate-steps K: the first K - 1 micro-batches' gradients summed, nothing pushed
                w.gradient.begin()
                for _ in range(k - 1):   # a tied tensor's uses summed apart (nn/tied.py), as ring mode does
                    loss = model.forward_backward(x, y, noise=noise, combine=False)
                    w.gradient.add(model.grads, model.extra, loss)
                    x, y, noise = frame.batch(reader)
                forward_done, layer_done = tl.model_hooks(t0, None)
                loss = model.forward_backward(x, y, on_layer_done=layer_done, on_forward_done=forward_done,
                                              noise=noise, combine=k == 1)
                if k > 1:   # the push is the mean gradient (and loss) of the K
                    w.gradient.into(model)
                    model.grads *= 1.0 / k
                    w.gradient.add_loss(loss)
                    loss = w.gradient.loss_mean()[0]
                gm.to_host()        # returns when the gradients are where MPI reads them
                loss = float(loss)  # after that wait: no second one for the loss
                if clip:
                    clip.clip_(gm.host)
            local += 1
            t1 = time.perf_counter()
            with tl.span("push+pull", cat="comm"):
                pm.recv_buffer()    # the last copy to the device has read params: MPI may overwrite them
                client.push_pull(loss, stop_request=world.stop.received is not None, position=reader.position)
                pm.to_device()      # asynchronous; the next forward waits for it on the device
            t2 = time.perf_counter()
            if tl.recording:
                # inside push+pull: starting the sends, waiting for the servers' replies, the rest
                sent, replied, done = client.marks
                tl.add("push", "comm", t1, sent)
                tl.add("wait for parameters", "comm", sent, replied)
                tl.add("sends done+read replies", "comm", replied, done)
            # The worker's view: its push+pull wait is communication not hidden
            # (the servers' optimizer work is inside it).
            frame.timed(t0, t1, t2)
            loss = client.loss if sync else loss
            if plan.optimizer.clip_norm and sync:
                norms.append(client.grad_norm)
            if not math.isfinite(loss):
                # Sync: every worker sees the same aggregated loss and the chief says so;
                # async: the worker whose own loss it is. Not agreed: the job is aborted.
                raise diverged(client.version, loss, chief or not sync, collective=False)
            frame.log.add(loss)
            step = client.version
            if frame.log.due(step, last=client.stop):
                log_progress(world, plan, frame, step, clip, norms, local)
            frame.after_step(evaluated, step)
            if chief and not client.stop and frame.checkpoint_due(step):
                # The chief alone: the servers' slices and state at one version
                # (SNAPSHOT), with the data positions the leader recorded for it.
                with frame.checkpoints.folder_for_servers(step) as folder:
                    save_cut(plan, frame.checkpoints, client.snapshot(folder), folder, w.state_names, model)
            if client.preempted:
                frame.stopping(step)
    return local


def end_worker(world, plan, frame, w, local):
    """Every worker ends with the final parameters (the evaluation is shared);
    with --checkpoint-dir the servers write their final state into the
    chief's folder for the last checkpoint. Then the pre-emption exit, or
    the results."""
    checkpoints, client = frame.checkpoints, w.client
    want_state = checkpoints.enabled and world.chief
    # the servers write their final state into it with their last reply (removed unless
    # the save renamed it into place: this step may be saved already)
    with checkpoints.folder_for_servers(client.version) if want_state else contextlib.nullcontext() as folder:
        with frame.timeline.span("final pull", cat="comm"):
            w.pm.recv_buffer()
            stats, final_cut = client.final(folder)
        return end_run(world, plan, frame, w, local, stats, final_cut, folder)


def end_run(world, plan, frame, w, local, stats, final_cut, folder):
    """end_worker's rest, once the servers' final reply is in."""
    cluster, checkpoints, client, ps = world.cluster, frame.checkpoints, w.client, plan.ps
    W, R = cluster.num_workers, ps.replicas
    w.pm.to_device()
    w.pm.wait()   # nothing reads the pinned mirror once run_worker returns
    step = client.version
    extra = summarize(stats, W)
    extra.update({"num_ps": cluster.num_ps, "ps_ranks": ps.ps_ranks, "server_ranks": cluster.ps_ranks,
                  "placement": ps.placement, "ps_exchange": exchange_name(client), "sync": ps.sync,
                  "replicas_to_aggregate": R,
                  "backup_workers": W - R if ps.sync else 0, "max_staleness": ps.max_staleness,
                  "dc_lambda": ps.dc_lambda, "loop_s": round(frame.loop_s, 4), "local_steps": local,
                  "rejected_pushes": client.rejected})
    if plan.optimizer.clip_norm:
        extra["clip_norm"] = plan.optimizer.clip_norm
        if w.clip:   # async: this worker's (the chief's) own pushes
            extra.update(w.clip.totals())
    if w.model.run.units:   # --recompute: this worker's (the chief's) block forwards run again
        extra["recomputed_forwards"] = w.model.run.recomputed
    alone = bool(extra["abandoned_workers"])
    record = frame.end(step, client.preempted, cluster.comm, w.evaluated,
                       save=(lambda at: save_cut(plan, checkpoints, final_cut, folder, w.state_names, w.model))
                       if final_cut is not None else None,
                       extra=extra, alone=alone)
    if alone:
        finish_without(world, plan, step, extra)
    return record


def start_servers(client, resume, model, state_names, num_workers):
    """The chief decides the servers' starting point: the checkpoint's
    parameters, optimizer state and data positions, or its initial parameters."""
    from ..checkpoints.resume import positions_for, resume_point
    if resume is None:
        client.restore(0, 0, device.to_host(model.params))
        return
    ckpt = resume.checkpoint
    positions = positions_for(resume_point(ckpt.data_positions), num_workers)
    if ckpt.named:   # a checkpoint of named tensors: each server reads its own boxes
        client.restore(resume.step, resume.optimizer_t, positions=positions, folder=ckpt.path)
        return
    client.restore(resume.step, resume.optimizer_t, ckpt.params,
                   {name: ckpt.optimizer_state[name] for name in state_names}, positions)


def log_progress(world, plan, frame, step, clip, norms, local):
    """Sync: the chief's line (the mean loss of the aggregated workers, as in
    ring mode). Async: every worker prints its own."""
    loss_mean, report = frame.log.take(step), frame.report
    samples, elapsed = frame.samples(step), frame.elapsed()
    grad_norm = None
    if clip:
        grad_norm = clip.mean_norm()
    elif plan.optimizer.clip_norm:
        grad_norm = sum(norms) / len(norms)
    norms.clear()
    if not plan.ps.sync:
        report.progress(step, loss_mean, samples, elapsed, worker=world.cluster.worker_index, local_step=local,
                        grad_norm=grad_norm)
    elif world.chief:
        report.progress(step, loss_mean, samples, elapsed, grad_norm=grad_norm)


def finish_without(world, plan, step, extra):
    """The servers left behind workers that went silent and never came back
    after the last step: the chief has written the result by itself (the
    final checkpoint, the evaluation, --save, the final record: frame.end
    alone); the job ends with exit 3 and a line naming them (they can never
    join MPI_Finalize). The other ranks wait for that end."""
    cluster = world.cluster
    if not world.chief:
        return
    names = ", ".join(f"worker {w} (rank {cluster.worker_ranks[w]})" for w in extra["abandoned_workers"])
    raise HpctrainError(f"{names} sent nothing for --timeout {plan.timeout:g} s and never finished; "
                        f"the result of step {step} is written, the job ends without it", exit_code=EXIT_TIMEOUT)
