"""Parameter-server training (`--mode ps`): `train_ps(run)` turns the ranks of
a `Run` into servers and workers and trains, synchronously (the default) or
asynchronously. The protocol itself is hpctrain/comm/ps/; this file wires it
to the model, optimizer, data, logging and metrics, like `train_ring` does.

    mpirun -n 4 python -m hpctrain.mnist --mode ps --num-ps 2            # sync, 2 ps + 2 workers
    mpirun -n 4 python -m hpctrain.mnist --mode ps --num-ps 2 --async    # async
    mpirun -n 4 python -m hpctrain.mnist --mode ps --backup-workers 1    # 1 ps, 3 workers, 1 backup

Servers (ranks [0, num_ps)) each own a slice of the flat parameter vector and
its optimizer state and run `Server.serve()`. Workers pull, compute, push; the
chief (worker 0) initializes the servers with its initial parameters (the same
as ring mode's for the same seed), logs, evaluates and writes the files.

Checkpoints (--checkpoint-dir): the chief writes them alone, from the servers'
slices and optimizer state (SNAPSHOT every --checkpoint-every steps; the final
reply at the end or after a signal) and the data positions that the workers'
pushes carried to ps 0. On resume it loads the servers back (RESTORE) and the
workers seek their readers, so sync training resumes bit for bit.

Faults (a straggler, a hung server, a signal) are injected by the tests
(tests/faults/inject_ps.py), not here.
"""
import time

import numpy as np
from mpi4py import MPI

from .comm.ps import Client, Server, describe, place, summarize
from .errors import EXIT_TIMEOUT, HpctrainError
from .model import MLP
from .optim import OnDevice, make_optimizer


def replicas_to_aggregate(args, num_workers):
    if not args.sync:
        return 1
    return args.replicas_to_aggregate or num_workers - args.backup_workers


def open_reader_everywhere(run):
    """Workers open their data; servers learn whether that worked (a world
    Allreduce), so a bad data directory never leaves servers waiting for
    workers that have already exited."""
    c = run.cluster
    error, reader = None, None
    if c.is_worker:
        try:
            reader = run.open_reader()
        except HpctrainError as exc:   # collective among workers: one of them reports
            error = exc
    flag = np.array([error.exit_code if error else 0], np.int64)
    with run.watchdog.waiting("start-up agreement", peer=None):
        c.comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
    if flag[0]:
        raise error or HpctrainError("", exit_code=int(flag[0]), collective=True, report=False)
    return reader


def log_cluster(run, placement, tensor_ranges):
    """The chief's start-up picture: roles in TensorFlow's naming, placement."""
    a, c = run.args, run.cluster
    n = tensor_ranges[-1][2]
    lines = ["cluster:"]
    for r in range(c.size):
        lines.append(f"  {c.role_name(r)} = rank {r}" + ("  (chief)" if r == c.chief_rank else ""))
    lines.append(f"placement {a.placement}: {n:,} parameters ({4 * n:,} bytes) on {c.num_ps} ps")
    for k, (count, parts) in enumerate(describe(placement, tensor_ranges)):
        lines.append(f"  /job:ps/task:{k}: {count:,} parameters, {4 * count:,} bytes: {', '.join(parts) or '-'}")
    if a.sync:
        R = replicas_to_aggregate(a, c.num_workers)
        lines.append(f"sync: each update aggregates {R} of {c.num_workers} workers' gradients"
                     + (f" ({c.num_workers - R} backup)" if R < c.num_workers else "")
                     + ("; --max-staleness/--dc-lambda apply to --async only"
                        if a.max_staleness is not None or a.dc_lambda else ""))
    else:
        lines.append("async: each gradient applied on arrival"
                     + (f"; max staleness {a.max_staleness}" if a.max_staleness is not None else "")
                     + (f"; DC-ASGD lambda {a.dc_lambda:g}" if a.dc_lambda else ""))
    run.log("\n".join(lines))


# ---------------------------------------------------------------------------

def train_ps(run):
    a, c = run.args, run.cluster
    # The protocol's own communicator: its tags never meet anyone else's messages.
    comm = c.comm.Dup()
    reader = open_reader_everywhere(run)
    # With --checkpoint-dir: every rank learns whether (and from which step)
    # the run resumes; the chief then loads the servers (RESTORE).
    resume = run.load_checkpoint(c.comm)
    if c.is_ps:
        tensor_ranges = MLP(a.hidden, np).tensor_ranges()
        return serve(run, comm, place(tensor_ranges, c.num_ps, a.placement))
    return work(run, comm, reader, resume)


def serve(run, comm, placement):
    a, c = run.args, run.cluster
    mine = placement[c.ps_index]
    size = sum(hi - lo for lo, hi in mine)
    if a.ps_device == "gpu":
        # The slice and its optimizer state on this rank's GPU; messages stay on the host.
        optimizer = OnDevice(make_optimizer(a.optimizer, size, run.server_xp, momentum=a.momentum), size)
    else:
        optimizer = make_optimizer(a.optimizer, size, np, momentum=a.momentum)
    server = Server(comm, mine, c.worker_ranks, c.ps_ranks, optimizer, run.lr, steps=a.steps, sync=a.sync,
                    replicas=replicas_to_aggregate(a, c.num_workers), max_staleness=a.max_staleness,
                    dc_lambda=a.dc_lambda, watchdog=run.watchdog,
                    stop_requested=lambda: run.stop.received)
    server.serve_until_done()
    if server.preempted:   # every rank agrees (the leader's flag reached all): exit 75 together
        with run.watchdog.waiting("stop agreement", peer=None):
            run.preempted(c.comm, server.version)
    return None


def save_alone(run, step, params, states, t, positions):
    """The chief writes a checkpoint by itself (servers and workers keep going).
    A failure to write is one error line and aborts the job."""
    try:
        run.save_checkpoint(MPI.COMM_SELF, step, params, states, t, positions)
    except HpctrainError as exc:
        run.metrics.close(keep=False)
        raise HpctrainError(str(exc), exit_code=exc.exit_code) from None   # not collective: abort


def save_cut(run, cut):
    """A checkpoint of the servers' Cut, or one line why not: servers at
    different versions (async updates in flight) are not one state."""
    if not cut.consistent:
        run.log(f"checkpoint at step {cut.versions[0]} not written: the servers are not at one version "
                f"({cut.describe()})")
        return
    save_alone(run, cut.versions[0], cut.params, cut.states, cut.ts[0], cut.positions)


def work(run, comm, reader, resume):
    a, c, xp = run.args, run.cluster, run.xp
    W, tl = c.num_workers, run.timeline
    model = MLP(a.hidden, xp)
    model.init(a.seed)
    tensor_ranges = model.tensor_ranges()
    placement = place(tensor_ranges, c.num_ps, a.placement)
    # MPI moves host memory here; on a GPU the model's buffers are mirrored.
    gpu = xp is not np
    params = np.zeros(model.num_params, np.float32) if gpu else model.params
    grads = np.zeros(model.num_params, np.float32) if gpu else model.grads
    client = Client(comm, c.ps_ranks, placement, params, grads, c.worker_index, W,
                    sync=a.sync, watchdog=run.watchdog)
    state_names = make_optimizer(a.optimizer, 1, np).state_names
    if c.is_chief:
        log_cluster(run, placement, tensor_ranges)
        if resume is not None:
            ckpt = resume.checkpoint
            client.restore(resume.step, resume.optimizer_t, ckpt.params,
                           {name: ckpt.optimizer_state[name] for name in state_names}, ckpt.data_positions)
        else:
            if gpu:
                model.params.get(out=params)
            client.restore(0, 0, params)   # the chief decides the initial parameters
    if resume is not None:
        run.seek_readers(reader, resume)
        note = f" (--steps {a.steps}: nothing left to train)" if resume.step >= a.steps else ""
        run.log(f"resumed from {run.saved_path} at step {resume.step}{note}")
    client.pull()
    if gpu:
        model.params.set(params)

    R = replicas_to_aggregate(a, W)
    per_update = a.batch_size * R
    start = client.version
    comm_s = compute_s = 0.0
    local = 0
    losses = []
    logged = start
    next_log = (start // a.log_every + 1) * a.log_every
    every = a.checkpoint_every if (a.checkpoint_dir and c.is_chief) else 0
    next_checkpoint = (start // every + 1) * every if every else None
    t_loop = time.perf_counter()
    while not client.stop:
        with tl.span("data", cat="data"):
            x, y = reader.next_batch()
            x, y = xp.asarray(x), xp.asarray(y)
        t0 = time.perf_counter()
        with tl.span("forward+backward", cat="compute"):
            forward_done, layer_done = tl.model_hooks(t0, None)
            loss = model.forward_backward(x, y, on_layer_done=layer_done, on_forward_done=forward_done)
            if gpu:
                model.grads.get(out=grads)   # into the host mirror: no allocation
            loss = float(loss)
        local += 1
        t1 = time.perf_counter()
        with tl.span("push+pull", cat="comm"):
            client.push_pull(loss, stop_request=run.stop.received is not None, position=reader.position)
        t2 = time.perf_counter()
        if gpu:
            model.params.set(params)
        compute_s += t1 - t0
        comm_s += t2 - t1
        # The worker's view: its push+pull wait is communication not hidden
        # (the servers' optimizer work is inside it).
        run.stats.record(t2 - t0, t1 - t0, t2 - t1, t2 - t1, 0.0, 0.0)
        losses.append(client.loss if a.sync else loss)
        step = client.version
        if step >= next_log or (client.stop and step != logged):
            _progress(run, step, sum(losses) / len(losses), (step - start) * per_update,
                      time.perf_counter() - t_loop, local)
            losses.clear()
            logged = step
            next_log = (step // a.log_every + 1) * a.log_every
        t_loop += run.periodic_eval(model, step)
        if every and step >= next_checkpoint and not client.stop:
            # The chief alone: the servers' slices and state at one version
            # (SNAPSHOT), with the data positions the leader recorded for it.
            save_cut(run, client.snapshot(state_names))
            next_checkpoint = (step // every + 1) * every
    t_loop = time.perf_counter() - t_loop

    # Every worker ends with the final parameters (the evaluation is shared);
    # the chief also gets the final optimizer state for the last checkpoint.
    want_state = bool(a.checkpoint_dir and c.is_chief)
    with tl.span("final pull", cat="comm"):
        stats = client.final(state_names if want_state else None)
    if gpu:
        model.params.set(params)
    step = client.version
    if want_state and run.saved_step != step:
        save_cut(run, client.final_state)
    if client.preempted:
        run.log(f"stopping after step {step}: signal received")
        run.metrics.close(keep=True)
        with run.watchdog.waiting("stop agreement", peer=None):
            run.preempted(c.comm, step)   # raises the exit-75 error on every rank
    extra = summarize(stats, W)
    extra.update({"num_ps": c.num_ps, "placement": a.placement, "sync": a.sync, "replicas_to_aggregate": R,
                  "backup_workers": W - R if a.sync else 0, "max_staleness": a.max_staleness,
                  "dc_lambda": a.dc_lambda, "loop_s": round(t_loop, 4), "local_steps": local,
                  "rejected_pushes": client.rejected})
    result = (model, step, t_loop, (step - start) * per_update, comm_s, compute_s, extra)
    if extra["abandoned_workers"]:
        return finish_without(run, extra["abandoned_workers"], *result)
    return run.finish(*result)


def finish_without(run, abandoned, model, step, *rest):
    """The servers left behind workers that went silent and never came back
    after the last step: the chief writes the result by itself (the final
    checkpoint is written; now the evaluation, --save, the final record),
    then the job ends with exit 3 and a line naming them (they can never
    join MPI_Finalize). The other ranks wait for that end."""
    c = run.cluster
    if not c.is_chief:
        return None
    run.finish(model, step, *rest, alone=True)
    names = ", ".join(f"worker {w} (rank {c.worker_ranks[w]})" for w in abandoned)
    raise HpctrainError(f"{names} sent nothing for --timeout {run.args.timeout:g} s and never finished; "
                        f"the result of step {step} is written, the job ends without it", exit_code=EXIT_TIMEOUT)


def _progress(run, step, loss, samples, t_loop, local):
    """Sync: the chief's line (the loss is all aggregated workers' mean, as in
    ring mode). Async: every worker prints its own line, as in the tutorial."""
    if run.args.sync:
        run.progress(step, loss, samples, t_loop)
        return
    c = run.cluster
    elapsed = time.perf_counter() - run.t_start
    rate = samples / t_loop if t_loop > 0 else 0.0
    run.log(f"worker {c.worker_index}: step {step:>6}/{run.args.steps}  loss {loss:.4f}  "
            f"samples/s {rate:,.0f}  elapsed {elapsed:.1f}s  (local step {local})", everyone=True)
    run.metrics.write({"step": step, "loss": round(float(loss), 6), "samples_per_s": round(rate, 1),
                       "time_s": round(elapsed, 3)})
