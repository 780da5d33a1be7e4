"""The MPI world of one run: roles, device, watchdog, the start-up checks
(flags that need the world size, the same job on every rank, outputs that can
be written, data that is there), and what both loops read from it.

`Session(args)` is built by every rank before either loop; the loops
(loop_ring.py, loop_ps.py) read it top to bottom. Errors during start-up go
through `agreed()`, so a problem on any rank is one line and a clean exit on
every rank, never a rank left waiting in a collective.

    mpirun -n 4 python -m hpctrain.mnist --steps 200
"""
import contextlib
import functools
import hashlib
import json
import os
import signal
import sys
import time
import types

import numpy as np
from mpi4py import MPI

from . import data as data_mod
from . import device, jobcheck, settings, tensorboard
from .cli import steps_for_epochs, validate
from .cluster import Cluster, check_consistency
from .config import data_workers, worker_batch
from .comm import allreduce_plan
from .comm.deadline import NO_WATCHDOG
from .errors import EXIT_PREEMPTED, HpctrainError
from .nn import LayerError, spec_for
from .nn.user import UserModelError
from .optim import schedule_line
from .pipeline.stages import plan as pipeline_plan
from .outputs import check_outputs
from .stats import StepStats
from .timeline import Timeline


def agreed(comm, fn, *args, watchdog=NO_WATCHDOG, what=None):
    """Run fn(*args) on every rank of comm; if it raises HpctrainError anywhere,
    every rank raises: the lowest failing rank its own message (printed), the
    others a silent error with the same exit code. So a set-up error on one
    rank never leaves the rest waiting in a collective, and the job prints one
    line. The agreement waits under `watchdog` (a rank that never arrives is
    named), labelled `what`."""
    error = None
    try:
        result = fn(*args)
    except HpctrainError as exc:
        error, result = exc, None
    size, rank = comm.Get_size(), comm.Get_rank()
    # [exit code, size - rank of a rank with a line to print]: the lowest such
    # rank prints. An error that an inner agreement already silenced has no
    # line of its own, so fn may itself agree on a smaller communicator.
    speaks = error is not None and error.report and bool(str(error))
    flag = np.array([error.exit_code if error else 0, size - rank if speaks else 0], np.int64)
    with watchdog.waiting(f"agreement after {what or getattr(fn, '__name__', 'args step')}", peer=None):
        comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
    if flag[0]:
        if error is None:
            error = HpctrainError("", exit_code=int(flag[0]))
        error.collective = True
        error.report = speaks and size - rank == flag[1]
        raise error
    return result


class StopSignal:
    """SIGTERM/SIGUSR1 (SLURM's pre-emption and time-limit warnings) set a flag
    that the next step carries to every rank, so all ranks stop after the same
    step.

    Python runs a signal handler only when the main thread gets back to Python
    code, so a rank blocked inside MPI during start-up would never see it. The
    signal's number is therefore also written to a pipe (set_wakeup_fd, done
    in C at delivery), which the watchdog's thread reads. During training the
    loops take the signal (checkpoint, exit 75 together). Outside training (start-up, or
    after the last step while the results are written) a signal that the
    process has not acted on within GRACE_S ends the job (exit 75) from that
    thread: a rank stuck there must not keep a pre-empted job alive."""

    GRACE_S = 5.0

    def __init__(self):
        self.received = None   # the signal's name, e.g. "SIGTERM"
        self.signum = 0
        self.phase = "start-up"   # then "training" and "finishing": training() and frame.Frame.training
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)
        self.wakeup_fd, write_fd = os.pipe()
        os.set_blocking(self.wakeup_fd, False)
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._arrived = None

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name
        self.signum = int(signum)

    @contextlib.contextmanager
    def training(self):
        """The server loop's phase (workers: frame.Frame.training): a stop
        signal is the loop's to take; leaving normally, the run is finishing.
        Set `.stopped` on the yielded object when the loop ends for a signal."""
        self.phase = "training"
        run = types.SimpleNamespace(stopped=False)
        yield run
        if not run.stopped:
            self.phase = "finishing"

    def overdue(self):
        """Called by the watchdog's thread: (signal name, phase) when a stop
        signal arrived outside training and GRACE_S have passed since."""
        try:
            data = os.read(self.wakeup_fd, 64)
        except BlockingIOError:
            data = b""
        for num in data:
            # A signal read during training is the loop's to act on.
            if num in (signal.SIGTERM, signal.SIGUSR1) and self._arrived is None and self.phase != "training":
                self._arrived = (time.monotonic(), signal.Signals(num).name, self.phase)
        if self._arrived and self.phase != "training" and time.monotonic() - self._arrived[0] > self.GRACE_S:
            return self._arrived[1:]
        return None


def ensure_data(args, cluster, watchdog):
    """The shard directory to train from. Without --data: data/mnist, prepared
    from the bundled sample on first use by rank 0 while the others wait."""
    if args.data:
        return args.data
    path = data_mod.default_data_dir()

    def prepare_once():
        if cluster.rank == 0 and not data_mod.is_prepared(path):
            print(f"preparing {path} from the bundled MNIST sample "
                  f"({data_mod.bundled_sample_dir()}), first use only", flush=True)
            try:
                data_mod.prepare(data_mod.bundled_sample_dir(), path, log=None)
            except HpctrainError:
                if not data_mod.is_prepared(path):  # another job may have won the race
                    raise
    agreed(cluster.comm, prepare_once, watchdog=watchdog, what="preparing the bundled sample")
    return path


def server_array_module(args):
    """ps mode: where servers keep their slice (--ps-device). numpy, or cupy
    when asked for and a GPU is there (else one clear error on every rank)."""
    if args.mode != "ps" or args.ps_device != "gpu":
        return np
    try:
        xp, _, _ = device.select("gpu")
    except HpctrainError as exc:
        raise HpctrainError(str(exc).replace("--device gpu", "--ps-device gpu")) from None
    return xp


def data_identity(data_dir):
    """(digest, (image shape, classes)): the data this rank trains on, as a
    digest of its manifest's content (not its path: two paths may hold the
    same data, one path on two nodes different data), and the shapes the
    model is built for."""
    manifest = data_mod.load_manifest(data_dir)
    try:
        shape = data_mod.model_shape(manifest)
    except HpctrainError as e:
        raise HpctrainError(f"{data_dir}: {e}") from None
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16], shape


def check_val(args, has_val, data_dir):
    """--keep-best chooses by validation accuracy: the data must have a val part."""
    if args.keep_best and not has_val:
        raise HpctrainError(f"--keep-best needs a validation part, and {data_dir} has none; prepare "
                            f"it with: python -m hpctrain.data prepare --val-fraction F --out DIR")


def _nothing(*args):
    return None


def model_spec(args, model_shape, chief=False):
    """The spec of this run's model for its data (nn/zoo.py); a model that
    does not fit the data, or a user's model file that fails, is one line
    (and on the chief, above it, the traceback of the user's own code)."""
    try:
        return spec_for(args, *model_shape)
    except LayerError as e:
        raise HpctrainError(f"--model {args.model} does not fit the data "
                            f"({'x'.join(map(str, model_shape[0]))}, {model_shape[1]} classes): {e}") from None
    except UserModelError as e:
        if chief and e.traceback:
            print(e.traceback, end="", file=sys.stderr, flush=True)
        raise HpctrainError(str(e)) from None


def memory_needed(args, spec):
    """Bytes one rank needs for the model at least (nn/spec.py memory_bytes):
    a rank that cannot hold this cannot train."""
    return spec.memory_bytes(args.batch_size, {"sgd": 0, "momentum": 1, "adam": 2}[args.optimizer])


def memory_available():
    """Bytes this node can still give (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(args, ranks_on_node, spec):
    """Refuse up front a model or batch that cannot fit (a traceback from deep
    inside NumPy, or the OOM killer, an hour later is worse)."""
    need = memory_needed(args, spec)
    have = memory_available()
    if have is not None and need * ranks_on_node > have:
        what = f"--hidden {','.join(map(str, args.hidden))}" if args.model == "mlp" else f"--model {args.model}"
        raise HpctrainError(
            f"{what} with --batch-size {args.batch_size} needs at "
            f"least {need / 2**30:.1f} GiB per rank (parameters, gradients, optimizer state, "
            f"activations); this node has {have / 2**30:.1f} GiB available for {ranks_on_node} "
            f"rank{'s' if ranks_on_node > 1 else ''}")


class Session:
    """Everything a training loop needs that is not the loop itself."""

    def __init__(self, args, process_note, watchdog, on_roles=None):
        """watchdog: started before MPI_Init (train.train), aborting through
        MPI now; every start-up collective below waits under it. on_roles:
        called with the chief's world rank as soon as the roles are known
        (train.py's Ctrl-C line must not call MPI to learn it)."""
        # First: a signal during start-up is then kept for the first step
        # (which stops and checkpoints) instead of killing the rank mid-collective.
        self.stop = StopSignal()
        watchdog.also_watch(self._stopped_outside_training)
        self.stats = StepStats()
        # Overflow to inf/nan is caught by the loops (one line, exit 4), not by
        # NumPy's warnings on every rank.
        np.seterr(over="ignore", invalid="ignore", divide="ignore")
        self.args = args
        self.comm = MPI.COMM_WORLD
        self.watchdog = watchdog
        with watchdog.waiting("start-up (communicators)", peer=None):
            self.cluster = cluster = Cluster(self.comm, args.mode, args.num_ps, args.ps_ranks)
        self.chief = cluster.is_chief
        if on_roles is not None:
            on_roles(cluster.chief_rank)
        # The same job everywhere, outputs included (settings.py). First,
        # before the roles are used: ranks that disagree on --num-ps or
        # --ps-ranks disagree on who the chief is (the rank map's root).
        with watchdog.waiting("start-up (same job on every rank)", peer=None):
            self.agreed(self.comm, check_consistency, self.comm, settings.same_on_every_rank(args))
        with watchdog.waiting("start-up (rank map)", peer=None):
            jobcheck.check_world(cluster, self.chief_says)
        self.t_start = time.perf_counter()
        self.agreed(self.comm, validate, args, cluster.size)
        with watchdog.waiting("start-up (GPU binding)", peer=None):
            gpu_note = cluster.confirm_gpu_binding(args.device)  # MPI's node-local rank has the last word
        self.xp, self.device_name, device_note = self.agreed(self.comm, device.select, args.device)
        plan = self.agreed(self.comm, allreduce_plan, args.allreduce, self.xp, args.mode, args.cuda_aware)
        device_note = "; ".join(filter(None, [device_note, gpu_note if device.is_gpu(self.xp) else "", plan]))
        self.server_xp = self.agreed(self.comm, server_array_module, args)
        self.thread_multiple = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        if not self.thread_multiple:
            device_note += "; MPI gives less than MPI_THREAD_MULTIPLE: no communication thread (--overlap off)"
        self.timeline = Timeline(args.timeline if self.chief else None)
        self.chief_says(f"hpctrain: {args.mode} mode, world size {cluster.size} "
                        f"({cluster.num_ps} ps + {cluster.num_workers} workers), device {self.device_name} "
                        f"({device_note})" + (f"; {process_note}" if process_note else ""))
        if cluster.num_ps:
            self.chief_says(cluster.servers_line())
        # The same data everywhere (its manifest's content, not its path).
        self.data_dir = ensure_data(args, cluster, watchdog)
        # (the digest is also what checkpoints record of the data: resume.py)
        self.data_digest, self.model_shape = self.agreed(self.comm, data_identity, self.data_dir)
        with watchdog.waiting("start-up (same data on every rank)", peer=None):
            self.agreed(self.comm, check_consistency, self.comm, {"data (manifest digest)": self.data_digest})
        self.has_val = data_mod.has_val(self.data_dir)
        self.agreed(self.comm, check_val, args, self.has_val, self.data_dir)
        self.agreed(self.comm, data_mod.check_augment, args.augment, self.data_dir)   # --augment flip on --no-flip data
        self.agreed(self.comm, tensorboard.check, args)   # tensorboardX installed, DIR writable
        # After the data: --epochs count its training samples (the same on
        # every rank: the manifest's digest was compared above). The last
        # step is decided with the resume point (config.decide).
        self.schedule = self._recipe(data_mod.load_manifest(self.data_dir))
        # After the data: the model is shaped by its manifest.
        self.spec = self.agreed(self.comm, model_spec, args, self.model_shape, self.chief)
        with watchdog.waiting("start-up (same model on every rank)", peer=None):
            # a user's file may differ between nodes: its layers and shapes are compared
            self.agreed(self.comm, check_consistency, self.comm, {"model (layers and shapes)": self.spec.identity})
        if args.model != "mlp":
            self.chief_says("\n".join(self.spec.summary()))
        # --pipeline-stages: where the layers are cut (None without), or the one line refusing the flags
        self.pipeline_cuts = self.agreed(self.comm, pipeline_plan, args, cluster.size, self.spec)
        # The workers that take batches of their own (a pipeline's replicas):
        # what checkpoints count samples and data positions by.
        self.data_workers = data_workers(args, cluster.num_workers)
        self.agreed(self.comm, check_memory, args, cluster.local_size, self.spec)
        # Last before training, so a refusal above leaves nothing behind (this
        # creates --checkpoint-dir): a result that cannot be written would be lost.
        self.agreed(self.comm, check_outputs if self.chief else _nothing, args)
        self._test = None

    def agreed(self, comm, fn, *args):
        """agreed() under this session's watchdog."""
        return agreed(comm, fn, *args, watchdog=self.watchdog)

    def _stopped_outside_training(self):
        """For the watchdog's thread: the line and exit code when a stop signal
        came outside training (start-up, or writing the results) and the
        process has not ended within the grace (a rank is stuck there)."""
        overdue = self.stop.overdue()
        if overdue is None:
            return None
        name, phase = overdue
        if phase == "start-up":
            return (f"stopped by {name} during start-up, before the first step (a rank is stuck there); "
                    f"no new checkpoint: run the same command again to resume from the last one", EXIT_PREEMPTED)
        where = (f"the final checkpoint in {self.args.checkpoint_dir} is whole: run the same command again "
                 f"to write the results" if self.args.checkpoint_dir else "no --checkpoint-dir: the results are lost")
        return (f"stopped by {name} after the last step, while the results were written (a rank is stuck "
                f"there); {where}", EXIT_PREEMPTED)

    def chief_says(self, text):
        """A line on standard output from the chief; the other ranks stay quiet."""
        if self.chief:
            print(text, flush=True)

    def _recipe(self, manifest):
        """The lr schedule's arguments, its total steps --epochs counted from
        step 0 (or --steps); the chief says both."""
        args, workers, steps = self.args, data_workers(self.args, self.cluster.num_workers), self.args.steps
        if args.epochs is not None:
            samples = manifest["train"]["num_samples"]
            steps = steps_for_epochs(args.epochs, samples, workers, worker_batch(args))
            self.chief_says(f"steps: {args.epochs:g} epochs of {samples} samples at {workers} workers x "
                            f"{worker_batch(args)} = {steps} steps")
        sched = dict(base_lr=args.lr, workers=workers, scale_lr=args.scale_lr, warmup_steps=args.warmup_steps,
                     schedule=args.lr_schedule, decay=args.lr_decay, decay_steps=args.lr_decay_steps,
                     lr_min=args.lr_min, total_steps=steps)
        if args.lr_schedule != "constant":   # constant: today's output, unchanged
            self.chief_says(schedule_line(**sched))
        return sched

    def open_reader(self):
        """This worker's training-batch reader (and its test part, loaded now)."""
        args, cluster = self.args, self.cluster
        reader = self.agreed(cluster.worker_comm, functools.partial(data_mod.ShardReader, augment=args.augment),
                             self.data_dir, cluster.worker_index, cluster.num_workers, args.batch_size, args.seed)
        self.test_part()
        return reader

    def test_part(self):
        """This worker's part of the test set (uint8 pixels), read once: at
        start-up, before training memory is touched, not at every evaluation."""
        if self._test is None:
            cluster = self.cluster
            self._test = self.agreed(cluster.worker_comm, functools.partial(data_mod.load_test, raw=True),
                                     self.data_dir, cluster.worker_index, cluster.num_workers)
        return self._test

    def chief_in(self, comm):
        """The chief's rank in comm (a communicator that contains it)."""
        world, group = self.comm.Get_group(), comm.Get_group()
        try:
            return MPI.Group.Translate_ranks(world, [self.cluster.chief_rank], group)[0]
        finally:
            world.Free()
            group.Free()
