"""The training loop for both modes, and what every run shares: start-up,
data, evaluation, logging, metrics and the parameters file.

Read top to bottom: `run()` sets up (roles, device, consistency check, data),
then `train_ring()` or the ps loop (`train_ps()` in ps mode) trains, then the
chief evaluates and writes its files.

    mpirun -n 4 python -m hpctrain.mnist --steps 200
"""
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from . import checkpoint
from . import data as data_mod
from . import device, prefetch
from . import jobcheck
from .outputs import check_outputs, rescue_path
from .cli import validate
from .cluster import Cluster, check_consistency
from .comm.deadline import Watchdog
from .comm.fusion import FusedAllreduce
from .comm import buffers
from .errors import EXIT_PREEMPTED, HpctrainError
from .model import MLP, num_params
from .optim import learning_rate, make_optimizer
from .stats import StepStats
from .timeline import Timeline

# The wire: [loss, stop flag, gradients...]. Riding along with the gradient
# allreduce, the loss average and the ranks' agreement to stop cost nothing extra;
# they sit at the front because layer 0 finishes last (backprop runs backwards),
# after the loss and any signal are known.
WIRE_LOSS, WIRE_STOP, WIRE_GRADS = 0, 1, 2


def collective(comm, fn, *args, **kwargs):
    """Run fn on every rank of comm; if it raises HpctrainError anywhere, every
    rank raises: the lowest failing rank its own message (printed), the others a
    silent error with the same exit code. So a set-up error on one rank never
    leaves the rest waiting in a collective, and the job prints one line."""
    error = None
    try:
        result = fn(*args, **kwargs)
    except HpctrainError as exc:
        error, result = exc, None
    size, rank = comm.Get_size(), comm.Get_rank()
    flag = np.array([error.exit_code if error else 0, -rank if error else -size], np.int64)
    comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
    if flag[0]:
        first = -int(flag[1])
        if error is None:
            error = HpctrainError("", exit_code=int(flag[0]))
        error.collective = True
        error.report = rank == first
        raise error
    return result


@dataclass
class Resume:
    """Where a resumed run starts: step and optimizer_t on every rank, the
    Checkpoint itself (host arrays) on the chief only."""
    step: int
    optimizer_t: int
    checkpoint: object = None


class Log:
    """Progress lines from the chief (or any rank with everyone=True)."""

    def __init__(self, cluster):
        self.cluster = cluster

    def __call__(self, text, everyone=False):
        if everyone or self.cluster.is_chief:
            print(text, flush=True)


class Metrics:
    """JSON Lines written by the chief; kept in a temporary file and renamed
    into place when the run ends, so a failed run leaves nothing half-written."""

    def __init__(self, path, enabled):
        self.path = path if enabled else None
        self._file = None
        if self.path:
            self._tmp = f"{self.path}.tmp-{os.getpid()}"
            self._file = open(self._tmp, "w")

    def write(self, record):
        if self._file:
            self._file.write(json.dumps(record) + "\n")

    def close(self, keep=True):
        if not self._file:
            return
        self._file.close()
        self._file = None
        if keep:
            os.replace(self._tmp, self.path)
        else:
            os.unlink(self._tmp)


class StopSignal:
    """SIGTERM/SIGUSR1 (SLURM's pre-emption and time-limit warnings) set a flag
    that the next step's allreduce carries to every rank, so all ranks stop
    after the same step."""

    def __init__(self):
        self.received = None   # the signal's name, e.g. "SIGTERM"
        self.signum = 0
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name
        self.signum = int(signum)


# ---------------------------------------------------------------------------
# start-up

def ensure_data(args, cluster, log):
    """The shard directory to train from. Without --data: data/mnist, prepared
    from the bundled sample on first use by rank 0 while the others wait."""
    if args.data:
        return args.data
    path = data_mod.default_data_dir()

    def prepare_once():
        if cluster.rank == 0 and not data_mod.is_prepared(path):
            log(f"preparing {path} from the bundled MNIST sample "
                f"({data_mod.bundled_sample_dir()}), first use only", everyone=True)
            try:
                data_mod.prepare(data_mod.bundled_sample_dir(), path, log=lambda *a, **k: None)
            except HpctrainError:
                if not data_mod.is_prepared(path):  # another job may have won the race
                    raise
    collective(cluster.comm, prepare_once)
    return path


def server_array_module(args):
    """ps mode: where servers keep their slice (--ps-device). numpy, or cupy
    when asked for and a GPU is there (else one clear error on every rank).
    HPCTRAIN_TEST_PS_DEVICE_NUMPY=1 (tests only) takes the --ps-device gpu
    code path with NumPy standing in for CuPy, so CPU tests cover its wiring."""
    if args.mode != "ps" or args.ps_device != "gpu":
        return np
    if os.environ.get("HPCTRAIN_TEST_PS_DEVICE_NUMPY") == "1":
        return np
    try:
        xp, _, _ = device.select("gpu")
    except HpctrainError as exc:
        raise HpctrainError(str(exc).replace("--device gpu", "--ps-device gpu")) from None
    return xp


def job_settings(args):
    """What must be identical on every rank (checked at start-up)."""
    keys = ("mode", "batch_size", "steps", "lr", "optimizer", "seed", "scale_lr", "warmup_steps",
            "allreduce", "fusion_mb", "num_ps", "sync", "replicas_to_aggregate", "backup_workers",
            "max_staleness", "dc_lambda", "placement", "checkpoint_every", "timeout")
    settings = {k: getattr(args, k) for k in keys}
    settings["hidden"] = ",".join(map(str, args.hidden))
    settings["num_params"] = num_params(args.hidden)
    settings["hpctrain"] = __import__("hpctrain").__version__
    return settings


class Run:
    """Everything a training loop needs that is not the loop itself."""

    def __init__(self, args, process_note=""):
        # First: a signal during start-up is then kept for the first step
        # (which stops and checkpoints) instead of killing the rank mid-collective.
        self.stop = StopSignal()
        self.stats = StepStats()
        self.args = args
        self.comm = MPI.COMM_WORLD
        self.cluster = Cluster(self.comm, args.mode, args.num_ps)
        self.log = Log(self.cluster)
        jobcheck.check_world(self.cluster, self.log)
        self.t_start = time.perf_counter()
        collective(self.comm, validate, args, self.cluster.size)
        gpu_note = self.cluster.confirm_gpu_binding(args.device)  # MPI's node-local rank has the last word
        self.xp, self.device_name, device_note = collective(self.comm, device.select, args.device)
        device_note = "; ".join(filter(None, [device_note, gpu_note if device.is_gpu(self.xp) else "",
                                              collective(self.comm, buffers.exchange_plan, args, self.xp)]))
        self.server_xp = collective(self.comm, server_array_module, args)
        self.watchdog = Watchdog(args.timeout, self.cluster.rank, self.comm.Abort)
        self.timeline = Timeline(args.timeline if self.cluster.is_chief else None)
        self.saved_step = None   # the step of the newest checkpoint written or resumed from
        self.saved_path = None
        c = self.cluster
        self.log(f"hpctrain: {args.mode} mode, world size {c.size} "
                 f"({c.num_ps} ps + {c.num_workers} workers), device {self.device_name} ({device_note})"
                 + (f"; {process_note}" if process_note else ""))
        # Every rank builds the model (shapes only) to compare, before any training.
        collective(self.comm, check_consistency, self.comm, job_settings(args))
        # Before any training: a result that cannot be written would be lost.
        collective(self.comm, lambda: check_outputs(args) if c.is_chief else None)
        self.data_dir = ensure_data(args, c, self.log)
        self._test = self._test_full = None
        self._last_eval = None
        self.metrics = Metrics(args.metrics, c.is_chief)

    def lr(self, step):
        a = self.args
        return learning_rate(step, a.lr, self.cluster.num_workers, a.scale_lr, a.warmup_steps)

    def open_reader(self):
        """This worker's training-batch reader (and its test part, loaded now)."""
        a, c = self.args, self.cluster
        reader = collective(c.worker_comm, data_mod.ShardReader, self.data_dir, c.worker_index,
                            c.num_workers, a.batch_size, a.seed)
        self.test_part()
        return reader

    def test_part(self):
        """This worker's part of the test set (uint8 pixels), read once: at
        start-up, before training memory is touched, not at every evaluation."""
        if self._test is None:
            c = self.cluster
            self._test = collective(c.worker_comm, data_mod.load_test, self.data_dir, c.worker_index,
                                    c.num_workers, raw=True)
        return self._test

    def evaluate(self, model):
        """Test loss and accuracy, each worker evaluating its part of the test set."""
        c = self.cluster
        x, y = self.test_part()
        xp = self.xp
        loss_sum, correct = model.evaluate(xp.asarray(x), xp.asarray(y))
        totals = np.array([loss_sum, correct, len(y)], np.float64)
        with self.watchdog.waiting("evaluation allreduce", peer=None):
            c.worker_comm.Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)
        n = max(totals[2], 1)
        return totals[0] / n, totals[1] / n, int(totals[2])

    def evaluate_alone(self, model):
        """Test loss and accuracy on the whole test set, this rank alone."""
        if self._test_full is None:
            self._test_full = data_mod.load_test(self.data_dir, raw=True)
        x, y = self._test_full
        loss_sum, correct = model.evaluate(self.xp.asarray(x), self.xp.asarray(y))
        n = max(len(y), 1)
        return loss_sum / n, correct / n, len(y)

    def save_params(self, model, step):
        """--save, on the chief. Returns None, or (when the file cannot be
        written, e.g. the disk filled up during training) the one-line error
        that says where the parameters are kept instead: the checkpoint of this
        step if there is one, else a file in the temporary directory."""
        path = self.args.save
        if not path or not self.cluster.is_chief:
            return None
        try:
            self._write_params(path, model, step)
            return None
        except OSError as e:
            failed = f"--save {path}: cannot write ({e.strerror or e})"
        if self.saved_path and self.saved_step == step:
            return f"{failed}; the parameters of step {step} are in checkpoint {self.saved_path}"
        try:
            rescue = rescue_path(step)
            self._write_params(rescue, model, step)
        except OSError as e:
            return f"{failed}, nor in the temporary directory ({e.strerror or e}): the parameters are lost"
        return f"{failed}; the parameters of step {step} are kept in {rescue}"

    def _write_params(self, path, model, step):
        """One float32 dataset per tensor, attributes step/mode/world_size;
        written to a temporary name and renamed, so it is never half-written."""
        import h5py
        # Exclusive and unpredictable: a planted symlink is never followed.
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                   prefix=f".{os.path.basename(path)}.tmp-")
        os.close(fd)
        try:
            with h5py.File(tmp, "w") as f:
                for name, view in model.tensors():
                    f.create_dataset(name, data=device.to_host(view))
                f.attrs["step"] = step
                f.attrs["mode"] = self.args.mode
                f.attrs["world_size"] = self.cluster.size
                f.attrs["hidden"] = ",".join(map(str, self.args.hidden))
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    # --- checkpoints, for both modes: the chief reads and writes the file;
    # the data positions travel over worker_comm, whose rank 0 is the chief in
    # either mode; everything else over the communicator the caller passes
    # (ring: worker_comm; ps: COMM_WORLD, so the servers share the outcome).

    def _chief_in(self, comm):
        """The chief's rank in comm (a communicator that contains it)."""
        world, group = self.comm.Get_group(), comm.Get_group()
        try:
            return MPI.Group.Translate_ranks(world, [self.cluster.chief_rank], group)[0]
        finally:
            world.Free()
            group.Free()

    def load_checkpoint(self, comm):
        """Collective over comm. Honouring --resume, the chief finds the newest
        valid checkpoint in --checkpoint-dir. Returns None on every rank when
        the run starts fresh; otherwise a Resume with step and optimizer_t on
        every rank and the Checkpoint (host arrays) on the chief only.
        A problem (--resume yes and nothing to resume, a checkpoint of another
        job) is one error line and a clean exit on every rank of comm."""
        a, c = self.args, self.cluster
        if not a.checkpoint_dir:
            return None

        def chief_reads():
            if not c.is_chief:
                return None
            d = a.checkpoint_dir  # created and tried by check_outputs at start-up
            found = checkpoint.list_checkpoints(d)
            if a.resume == "no":
                if found:
                    raise HpctrainError(
                        f"--resume no, but {d} holds checkpoints of an earlier run (newest "
                        f"{os.path.basename(found[0][1])}); remove them or use another --checkpoint-dir")
                return None
            ckpt = checkpoint.load_latest(d, checkpoint.settings_for(a, c.num_workers),
                                          warn=lambda line: print(f"hpctrain: warning: {line}",
                                                                  file=sys.stderr, flush=True))
            if ckpt is None and found:
                raise HpctrainError(f"--checkpoint-dir {d}: none of its {len(found)} checkpoints is "
                                    f"valid (see the warnings above); move them away to start fresh")
            if ckpt is None and a.resume == "yes":
                raise HpctrainError(f"--resume yes, but --checkpoint-dir {d} holds no checkpoint")
            if ckpt is not None and ckpt.data_positions.shape != (c.num_workers, 2):
                raise HpctrainError(f"{ckpt.path}: data positions for {ckpt.data_positions.shape[0]} "
                                    f"workers, this run has {c.num_workers}")
            return ckpt

        ckpt = collective(comm, chief_reads)
        head = np.zeros(3, np.int64)
        if ckpt is not None:
            head[:] = 1, ckpt.step, ckpt.optimizer_t
        with self.watchdog.waiting("checkpoint header broadcast", peer=self.cluster.chief_rank):
            comm.Bcast(head, root=self._chief_in(comm))
        if not head[0]:
            return None
        self.saved_step = int(head[1])
        self.saved_path = ckpt.path if ckpt is not None else None
        return Resume(step=int(head[1]), optimizer_t=int(head[2]), checkpoint=ckpt)

    def broadcast_state(self, comm, resume, params, optimizer):
        """Collective over comm: the resumed parameters and optimizer state
        from the chief into every rank's params and optimizer (ring mode, where
        every rank holds all of them); optimizer.t restored too."""
        root = self._chief_in(comm)
        ckpt = resume.checkpoint
        targets = [("params", params, ckpt.params if ckpt else None)]
        for name, array in optimizer.state().items():
            targets.append((f"optimizer state {name}", array, ckpt.optimizer_state[name] if ckpt else None))
        for what, target, source in targets:
            host = np.empty(target.shape, target.dtype)
            if source is not None:
                host[...] = source
            with self.watchdog.waiting(f"checkpoint broadcast ({what})", peer=self.cluster.chief_rank):
                comm.Bcast(host, root=root)
            target[...] = self.xp.asarray(host)
        optimizer.t = resume.optimizer_t
        device.synchronize(self.xp)

    def seek_readers(self, reader, resume):
        """Every worker: its reader to the position the checkpoint recorded for it."""
        c = self.cluster
        positions = np.empty((c.num_workers, 2), np.int64)
        if resume.checkpoint is not None:
            positions[...] = resume.checkpoint.data_positions
        with self.watchdog.waiting("checkpoint broadcast (data positions)", peer=c.chief_rank):
            c.worker_comm.Bcast(positions, root=0)
        epoch, offset = (int(v) for v in positions[c.worker_index])

        def seek():
            try:
                reader.seek(epoch, offset)
            except HpctrainError as e:
                raise HpctrainError(f"{e}: the checkpoint's data position does not fit this data "
                                    f"(was --data changed?)") from None
        collective(c.worker_comm, seek)

    def gather_positions(self, reader):
        """Every worker: (workers, 2) int64 reader positions on the chief, None elsewhere."""
        c = self.cluster
        mine = np.array(reader.position, np.int64)
        everyone = np.empty((c.num_workers, 2), np.int64) if c.is_chief else None
        with self.watchdog.waiting("checkpoint gather (data positions)", peer=c.chief_rank):
            c.worker_comm.Gather(mine, everyone, root=0)
        return everyone

    def save_checkpoint(self, comm, step, params, optimizer_state, optimizer_t, positions):
        """Collective over comm: the chief writes the checkpoint of `step` from
        the arrays it passes (device or host; the other ranks' arguments are
        ignored) and prunes to --keep-checkpoints. A failure to write stops
        every rank of comm with one error line. Returns the path on the chief."""
        a, c = self.args, self.cluster

        def chief_writes():
            if not c.is_chief:
                return None
            device.synchronize(self.xp)
            info = {"world_size": c.size, "num_ps": c.num_ps, "steps": a.steps, "lr": a.lr,
                    "scale_lr": int(a.scale_lr), "warmup_steps": a.warmup_steps,
                    "hpctrain": __import__("hpctrain").__version__}
            return checkpoint.save(a.checkpoint_dir, step, device.to_host(params),
                                   {k: device.to_host(v) for k, v in optimizer_state.items()},
                                   optimizer_t, positions, checkpoint.settings_for(a, c.num_workers),
                                   keep=a.keep_checkpoints, info=info)
        with self.timeline.span("checkpoint", cat="checkpoint"):
            path = collective(comm, chief_writes)
        self.saved_step, self.saved_path = step, path
        return path

    def checkpoint_due(self, step):
        """True when --checkpoint-every says this step gets a checkpoint."""
        every = self.args.checkpoint_every
        return bool(self.args.checkpoint_dir and every and step % every == 0 and step != self.saved_step)

    def preempted(self, comm, step):
        """After every rank of comm stopped at `step` (and the checkpoint is
        written): raise the EXIT_PREEMPTED error everywhere, the chief's line
        naming the signal (whichever rank got it) and the checkpoint."""
        sig = np.array([self.stop.signum], np.int64)
        comm.Allreduce(MPI.IN_PLACE, sig, op=MPI.MAX)
        name = signal.Signals(int(sig[0])).name if sig[0] else "a signal"
        if self.saved_path and self.saved_step == step:
            where = f"checkpoint {self.saved_path}; run the same command again to resume"
        else:
            where = "no checkpoint written (no --checkpoint-dir): a new run starts from step 0"
        raise HpctrainError(f"stopped by {name} after step {step}; {where}",
                            exit_code=EXIT_PREEMPTED, collective=True, report=self.cluster.is_chief)

    def progress(self, step, loss, samples, t_loop):
        """The chief's progress line and metrics record."""
        elapsed = time.perf_counter() - self.t_start
        rate = samples / t_loop if t_loop > 0 else 0.0
        self.log(f"step {step:>6}/{self.args.steps}  loss {loss:.4f}  "
                 f"samples/s {rate:,.0f}  elapsed {elapsed:.1f}s")
        self.metrics.write({"step": step, "loss": round(float(loss), 6), "samples_per_s": round(rate, 1),
                            "time_s": round(elapsed, 3)})

    def memory_and_step_medians(self, alone=False):
        """Median step split from self.stats, and peak memory: the largest of any
        worker (alone: this one's) (bytes above the interpreter with its imports, and in all)."""
        summary = self.stats.summary()
        peak = summary.pop("peak_rss_bytes")
        mem = np.array([peak, peak - summary.pop("base_rss_bytes")], np.float64)
        if not alone:
            self.cluster.worker_comm.Allreduce(MPI.IN_PLACE, mem, op=MPI.MAX)
        summary = {k: round(v, 7) for k, v in summary.items()}
        summary["peak_rss_mb"] = round(mem[0] / 2**20, 1)
        summary["peak_rss_above_base_mb"] = round(mem[1] / 2**20, 1)
        return summary

    def periodic_eval(self, model, step):
        """--eval-every N: when `step` reaches a multiple of N (before the last
        step, which finish() evaluates), the chief evaluates its parameters on
        the whole test set by itself (no collective: in async ps mode workers
        are never at the same step) and logs and records it. Returns the seconds
        spent, which the caller keeps out of samples/s."""
        every = self.args.eval_every
        if self._last_eval is None:  # the first step of this run (or of a resumed one)
            self._last_eval = step - 1
        if not every or not self.cluster.is_chief or step >= self.args.steps:
            self._last_eval = step
            return 0.0
        crossed = step // every > self._last_eval // every
        self._last_eval = step
        if not crossed:
            return 0.0
        t0 = time.perf_counter()
        if self._test_full is None:
            self._test_full = data_mod.load_test(self.data_dir, raw=True)
        x, y = self._test_full
        loss_sum, correct = model.evaluate(self.xp.asarray(x), self.xp.asarray(y))
        n = max(len(y), 1)
        self.log(f"step {step:>6}/{self.args.steps}  test accuracy {correct / n:.4f}  test loss {loss_sum / n:.4f}")
        self.metrics.write({"event": "eval", "step": step, "test_accuracy": round(correct / n, 6),
                            "test_loss": round(loss_sum / n, 6)})
        return time.perf_counter() - t0

    def finish(self, model, step, t_loop, samples, comm_s, compute_s, extra=None, alone=False):
        """Evaluate, print, write --save and the final metrics record. alone:
        the chief by itself (ps: a worker was left behind), no collective."""
        test_loss, test_acc, n_test = self.evaluate_alone(model) if alone else self.evaluate(model)
        c, a = self.cluster, self.args
        wall = time.perf_counter() - self.t_start
        rate = samples / t_loop if t_loop > 0 else 0.0
        self.log(f"test accuracy {test_acc:.4f}  test loss {test_loss:.4f}  ({n_test} images, "
                 f"{step} steps, {rate:,.0f} samples/s, {wall:.1f}s)")
        save_error = self.save_params(model, step)
        record = {"event": "final", "mode": a.mode, "world_size": c.size, "workers": c.num_workers,
                  "steps": step, "global_batch": a.batch_size * c.num_workers,
                  "test_accuracy": round(test_acc, 6), "test_loss": round(test_loss, 6),
                  "wall_s": round(wall, 3), "samples_per_s": round(rate, 1),
                  "comm_s": round(comm_s, 4), "compute_s": round(compute_s, 4),
                  "device": self.device_name}
        record.update(self.memory_and_step_medians(alone))
        record.update(extra or {})
        self.metrics.write(record)
        self.metrics.close()
        self.timeline.write()
        if alone:
            self._raise_if(save_error)
            return record
        # The final record and the timeline are written; if --save failed, every
        # worker exits with the chief's line (no abort: nobody is left waiting).
        collective(c.worker_comm, self._raise_if, save_error)
        return record

    @staticmethod
    def _raise_if(error_line):
        if error_line:
            raise HpctrainError(error_line)


# ---------------------------------------------------------------------------
# ring mode

def ring_resume(run, model, opt, reader):
    """With --checkpoint-dir: continue from the newest checkpoint (parameters,
    optimizer state and step count, each worker's data position). Returns the
    step to start from, 0 for a fresh run. Every rank holds the whole state in
    ring mode, so the chief's copy is broadcast to all."""
    resume = run.load_checkpoint(run.cluster.worker_comm)
    if resume is None:
        return 0
    run.broadcast_state(run.cluster.worker_comm, resume, model.params, opt)
    run.seek_readers(reader, resume)
    note = f" (--steps {run.args.steps}: nothing left to train)" if resume.step >= run.args.steps else ""
    run.log(f"resumed from {run.saved_path} at step {resume.step}{note}")
    return resume.step


def ring_checkpoint(run, step, model, opt, reader):
    """With --checkpoint-dir: checkpoint `step` unless it already has one. Every
    rank holds the same parameters and optimizer state in ring mode, so only
    the data positions are gathered; the chief writes."""
    if run.args.checkpoint_dir and run.saved_step != step:
        positions = run.gather_positions(reader)
        run.save_checkpoint(run.cluster.worker_comm, step, model.params, opt.state(), opt.t, positions)


def overlap_wanted(flag, xp, cluster):
    """--overlap auto: a communication thread pays only when a core is free to
    run it while backprop computes: always with a GPU doing the math, on CPUs
    only when this node has at least two cores per rank. (Measured on 2 cores,
    2 ranks: the thread's allreduce started only after backprop ended, and with
    4 ranks the extra thread cost throughput.)"""
    if flag != "auto":
        return flag == "on"
    from .cluster import cores_available
    return device.is_gpu(xp) or cores_available() >= 2 * cluster.local_size


def train_ring(run):
    a, c, xp = run.args, run.cluster, run.xp
    comm = c.worker_comm
    W = c.num_workers
    n = num_params(a.hidden)
    wire = xp.zeros(WIRE_GRADS + n, np.float32)
    model = MLP(a.hidden, xp, grads=wire[WIRE_GRADS:])
    model.init(a.seed)
    # Identical start everywhere: rank 0's parameters.
    device.synchronize(xp)
    with run.watchdog.waiting("initial parameter broadcast", peer=0):
        buffers.bcast(comm, model.params, root=0)
    opt = make_optimizer(a.optimizer, n, xp, momentum=a.momentum)
    reader = prefetch.device_batches(run.open_reader(), xp)  # GPU: pinned, async, one step ahead
    allreduce = buffers.make_exchange(a, comm, xp, run.watchdog)  # GPU: direct, staged or NCCL
    tl = run.timeline
    grad_scale = 1.0 / W
    # Buckets of the wire are allreduced as backprop finishes them, and each
    # reduced bucket's parameters are updated right away (comm/fusion.py).
    ready_from = [0] + [WIRE_GRADS + lo for lo, _ in model.layer_ranges[1:]]
    fused = FusedAllreduce(
        allreduce, wire, ready_from, int(a.fusion_mb * (1 << 20)) // wire.itemsize,
        sync=lambda: device.synchronize(xp),
        on_reduced=lambda lo, hi: opt.update(model.params, model.grads, max(lo - WIRE_GRADS, 0), hi - WIRE_GRADS),
        overlap=overlap_wanted(a.overlap, xp, c), timeline=tl if tl.enabled else None, watchdog=run.watchdog)
    step = ring_resume(run, model, opt, reader)

    comm_s = compute_s = 0.0
    samples = 0
    loss_sum, loss_count = xp.zeros(1, np.float64), 0
    t_loop = time.perf_counter()
    while step < a.steps:
        with tl.span("data", cat="data"):
            x, y = reader.next_batch()
            x, y = xp.asarray(x), xp.asarray(y)
        t0 = time.perf_counter()
        wire[WIRE_STOP] = 1.0 if run.stop.received else 0.0
        opt.begin(run.lr(step), grad_scale)
        forward_done, layer_done = tl.model_hooks(t0, fused.layer_done)
        model.forward_backward(x, y, on_layer_done=layer_done, on_forward_done=forward_done,
                               loss_out=wire[WIRE_LOSS:WIRE_LOSS + 1])
        t1 = time.perf_counter()
        with tl.span("wait for gradients", cat="comm"):
            fused.wait()
        t2 = time.perf_counter()
        tl.add("step", "step", t0, t2, {"step": step + 1})
        compute_s += t1 - t0
        comm_s += t2 - t1
        run.stats.record(t2 - t0, t1 - t0, t2 - t1, fused.exposed_comm_s, fused.exposed_update_s, fused.update_s)
        step += 1
        samples += a.batch_size * W
        loss_sum += wire[WIRE_LOSS:WIRE_LOSS + 1]  # on the device: no sync per step
        loss_count += 1
        if step % a.log_every == 0 or step == a.steps:
            mean_loss = float(loss_sum[0]) / loss_count / W
            loss_sum[...] = 0
            loss_count = 0
            run.progress(step, mean_loss, samples, time.perf_counter() - t_loop)
        t_loop += run.periodic_eval(model, step)
        if float(wire[WIRE_STOP]) > 0:
            break
        if run.checkpoint_due(step):
            ring_checkpoint(run, step, model, opt, reader)
    t_loop = time.perf_counter() - t_loop
    # The last checkpoint: at the end of training, or where a signal stopped it.
    ring_checkpoint(run, step, model, opt, reader)
    if float(wire[WIRE_STOP]) > 0 and step < a.steps:
        run.metrics.close(keep=True)
        run.preempted(comm, step)
    return run.finish(model, step, t_loop, samples, comm_s, compute_s)


# ---------------------------------------------------------------------------

def run(args, process_note=""):
    """Train as the flags say; returns the final metrics record (chief) or None."""
    r = Run(args, process_note)
    if args.mode == "ring":
        return train_ring(r)
    from .train_ps import train_ps
    return train_ps(r)
