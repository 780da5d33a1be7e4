"""Checkpoint orchestration for the three loops, on top of
checkpoints/named.py's folders (and the old flat files read_back.py reads):
which checkpoint a run resumes from (its state goes into each rank's
parts of the whole tensors: state/consumers.py), the data positions sent
to every rank, the checkpoints written while training, and the exit after
a pre-emption signal (loops/frame.py makes one Checkpoints per run and says
when).

The chief chooses and checks the checkpoint to resume from; every rank
writes its own parts and reads its own boxes (an old flat file: the chief
reads every rank's and sends them). The data positions travel over
the workers' communicator, whose rank 0 is the chief in every mode;
everything else over the communicator the caller passes (ring: the workers';
ps and a pipeline: the world, so the servers and every stage share the
outcome).

    mpirun -n 2 python -m hpctrain.mnist --checkpoint-dir ckpt --checkpoint-every 100
"""
import json
import signal
import sys
from dataclasses import dataclass

import numpy as np

from . import file as checkpoint
from .read_back import check_data, load_latest
from .model_record import record as model_record, recorded_text
from ..base import device
from ..data.fit import check_fit
from ..base.errors import EXIT_DIVERGED, EXIT_PREEMPTED, HpctrainError
from ..base.tuning import rounding
from .named import NamedCheckpoint, finish, new_folder, open_checkpoint, write_checkpoint, write_part
from .read_back import Checkpoint
from .trust import Corrupt, Refused
from ..state.consumers import FromChief, finite, flat_read, parameters, restore


PATH_BYTES = 4096   # a named checkpoint's path, broadcast as UTF-8


def as_checkpoint(named):
    """A checkpoint of named tensors (checkpoints/named.NamedCheckpoint, the
    chief's) as a flat one's Checkpoint of what the chief reads whole: step,
    optimizer step, attributes, data positions and --compression's state
    (the tensors stay in the rank files: `source`, which each rank opens)."""
    attrs = named.attrs
    compressed = [n for n in str(attrs.get("compression_state", "")).split(",") if n]
    positions = np.asarray(named.small("data_positions"), np.int64).reshape(-1, 2)
    return Checkpoint(path=named.path, step=named.step, optimizer_t=int(attrs.get("optimizer_t", 0)), params=None,
                      optimizer_state={}, data_positions=positions, attrs=attrs, source=named,
                      compression_state={n: named.small(f"compression/{n}") for n in compressed})


@dataclass
class Resume:
    """Where a resumed run starts: step and optimizer_t on every rank, the
    Checkpoint itself (host arrays) on the chief only; samples: the training
    samples the steps up to it took (at the worker counts that took them)."""
    step: int
    optimizer_t: int
    checkpoint: object = None
    samples: int = 0
    # (wall, compute, communication seconds, runs) of the runs up to the
    # checkpoint, every rank: a resumed run's clock goes on from them
    clock: tuple = (0.0, 0.0, 0.0, 0)
    named: str = None   # a checkpoint of named tensors (checkpoints/named.py): its path, every rank
    held: object = None  # --on-failure shrink: the in-memory commit the survivors go on from (run/survival.Commit)


def resume_point(positions):
    """(epoch, pos) where the data goes on from a checkpoint's positions
    (one row per worker that wrote it). In ring mode and sync ps the rows are
    equal. In async ps workers run ahead of each other: going on from the
    furthest means no sample is used twice in an epoch; the samples the slower
    workers had not reached yet are skipped for that epoch."""
    positions = np.asarray(positions, np.int64).reshape(-1, 2)
    epoch = int(positions[:, 0].max())
    return epoch, int(positions[positions[:, 0] == epoch, 1].max())


def samples_trained(ckpt, batch_size):
    """The training samples taken up to a checkpoint: its `samples`; one
    written before it recorded them counts step x its workers x batch (exact
    unless it was itself resumed on another number of workers)."""
    if "samples" in ckpt.attrs:
        return int(ckpt.attrs["samples"])
    return ckpt.step * int(ckpt.attrs.get("num_workers", 1)) * int(batch_size)


def clock_of(ckpt):
    """(elapsed_s, compute_s_total, comm_s_total, segments) a checkpoint
    records (Frame.clock); one from before them: none (its run's clock
    restarted at every resume), one segment."""
    attrs = ckpt.attrs
    return (float(attrs.get("elapsed_s", 0.0)), float(attrs.get("compute_s_total", 0.0)),
            float(attrs.get("comm_s_total", 0.0)), int(attrs.get("segments", 1)))


def positions_for(point, num_workers):
    """The (num_workers, 2) positions of workers that all go on from `point`."""
    return np.tile(np.asarray(point, np.int64), (int(num_workers), 1))


class Checkpoints:
    """--checkpoint-dir for one run: what was last written or resumed from.

    world: run/world.World; plan: run/plan.Plan; timeline: the chief's
    report/timeline.Timeline (a checkpoint is a span in it); best: the
    report/best.Best whose record every checkpoint carries (--keep-best's
    best validation so far, so that a resumed run keeps the file an
    uninterrupted run keeps); clock: a callable giving the run's time so
    far over every segment, {attribute: value}, that each checkpoint records
    (loops/frame.Frame.clock), or None."""

    def __init__(self, world, plan, timeline, best, clock=None):
        self.world, self.plan, self.timeline, self.best, self.clock = world, plan, timeline, best, clock
        self.outputs, self.data = plan.outputs, plan.data
        self.enabled = bool(self.outputs.checkpoint_dir)
        self.saved_step = None   # the step of the newest checkpoint written or resumed from
        self.saved_path = None
        self._base = (0, 0)      # (step, training samples taken up to it): where this run started

    # --- resume -----------------------------------------------------------

    def load(self, comm):
        """Collective over comm. Honouring --resume, the chief finds the newest
        valid checkpoint in --checkpoint-dir. Returns None on every rank when
        the run starts fresh; otherwise a Resume with step and optimizer_t on
        every rank and the Checkpoint (host arrays) on the chief only.
        A problem (--resume yes and nothing to resume, a checkpoint of another
        job) is one error line and a clean exit on every rank of comm."""
        world = self.world
        held = world.survival.take_pending() if world.survival is not None else None
        if held is not None:   # the survivors of a lost rank: every rank holds the commit, no file is read
            self._base = (held.step, held.samples)
            return Resume(step=held.step, optimizer_t=held.optimizer_t, samples=held.samples, clock=held.clock,
                          held=held)
        if not self.enabled:
            return None
        ckpt = world.agreed(comm, self._chief_reads_bounded if world.chief else lambda: None)
        head, clock = np.zeros(4, np.int64), np.zeros(4, np.float64)
        if ckpt is not None:
            head[:] = 1, ckpt.step, ckpt.optimizer_t, samples_trained(ckpt, self.data.per_worker)
            clock[:] = clock_of(ckpt)
        with world.waiting("checkpoint header broadcast", peer=world.cluster.chief_rank):
            comm.Bcast(head, root=world.chief_in(comm))
            comm.Bcast(clock, root=world.chief_in(comm))
        if not head[0]:
            return None
        # a checkpoint of named tensors: every rank reads its own boxes from it (`restore`)
        named = np.zeros(PATH_BYTES, np.uint8)
        if ckpt is not None and ckpt.named:
            raw = ckpt.path.encode()
            named[:len(raw)] = np.frombuffer(raw, np.uint8)
        with world.waiting("checkpoint path broadcast", peer=world.cluster.chief_rank):
            comm.Bcast(named, root=world.chief_in(comm))
        resume = Resume(step=int(head[1]), optimizer_t=int(head[2]), checkpoint=ckpt, samples=int(head[3]),
                        clock=(*map(float, clock[:3]), int(clock[3])),
                        named=bytes(named).rstrip(b"\0").decode() or None)
        self.saved_step, self._base = resume.step, (resume.step, resume.samples)
        self.saved_path = ckpt.path if ckpt is not None else None
        return resume

    def samples_at(self, step):
        """The training samples taken up to `step` of this run (what its checkpoint records)."""
        base_step, base_samples = self._base
        return base_samples + (int(step) - base_step) * self.plan.per_step

    def _chief_reads_bounded(self):
        # A file system can hang (a dead NFS server, a FIFO): bounded like any wait.
        with self.world.waiting(f"reading checkpoints in {self.outputs.checkpoint_dir}", peer="the file system"):
            return self._chief_reads()

    def _chief_reads(self):
        outputs = self.outputs
        d = outputs.checkpoint_dir  # created and tried by check_outputs at start-up
        found = checkpoint.list_checkpoints(d)
        if outputs.resume == "no":
            if found:
                raise HpctrainError(
                    f"--resume no, but {d} holds checkpoints of an earlier run (newest "
                    f"{found[0][1].rsplit('/', 1)[-1]}); remove them or use another --checkpoint-dir")
            return None
        # a pipeline's chief hands each stage its slice of the file, holding none whole (lazy; --zero 3 too)
        ckpt = load_latest(d, self.plan.resume_key, lazy=self.plan.pipelined or self.plan.ring.zero == 3,
                           warn=lambda line: print(f"hpctrain: warning: {line}", file=sys.stderr, flush=True))
        if ckpt is None and found:
            raise HpctrainError(f"--checkpoint-dir {d}: none of its {len(found)} checkpoints is "
                                f"valid (see the warnings above); move them away to start fresh")
        if ckpt is None and outputs.resume == "yes":
            raise HpctrainError(f"--resume yes, but --checkpoint-dir {d} holds no checkpoint")
        if ckpt is not None:
            ckpt = as_checkpoint(ckpt) if isinstance(ckpt, NamedCheckpoint) else ckpt
            self._check_data(ckpt)
            self._check_sizes(ckpt)
            line = tuning_line(ckpt.attrs.get("tuning"), self.plan.recorded["tuning"])
            if line:
                print(f"hpctrain: warning: {line}", file=sys.stderr, flush=True)
        return ckpt

    def _check_sizes(self, ckpt):
        """The model identity was compared: tensors of other sizes are a crafted file."""
        spec = self.plan.spec.full
        if ckpt.named:
            have = ckpt.source.tensors
            in_file = spec.name_in_file(have)
            for name, shape, _, _ in spec.tensors + spec.state:
                if in_file(name) not in have or tuple(have[in_file(name)][0]) != tuple(shape):
                    raise HpctrainError(f"{ckpt.path}: no tensor {name} of shape {tuple(shape)}, as this model has")
            return
        for what, have, want in (("parameters", ckpt.params.size, spec.num_params),
                                 ("model state", ckpt.model_state.size, spec.num_state)):
            if have != want:
                raise HpctrainError(f"{ckpt.path}: {have} floats of {what}, this model has {want}")

    def restore(self, comm, resume, parts):
        """Collective over comm: every part's box of the resumed checkpoint
        into its view (state/consumers.py). A checkpoint of named tensors:
        each rank reads its own boxes from the rank files; an old flat one:
        the chief reads every rank's boxes and sends them (flat_read)."""
        world, plan = self.world, self.plan
        if resume.held is not None:   # the in-memory commit: read as a checkpoint folder is
            world.agreed(comm, restore, parts, resume.held.read, world.xp, what="restoring the in-memory commit")
        elif resume.named:
            def read_own():
                try:
                    with open_checkpoint(resume.named) as ckpt:
                        restore(parts, ckpt.read_as(plan.spec), world.xp)
                except (Corrupt, Refused) as e:
                    raise HpctrainError(f"{resume.named}: {e}") from None
            world.agreed(comm, read_own, what="checkpoint read")
        else:
            ckpt = resume.checkpoint
            read = flat_read(ckpt, plan.spec, plan.optimizer.name) if ckpt is not None else None
            FromChief(comm, world.chief_in(comm), read, world.waiting).restore(parts, world.xp)
        device.synchronize(world.xp)

    def _check_data(self, ckpt):
        """A checkpoint of a language model trained on another vocabulary is
        refused; one of other data is refused, or with --resume-other-data
        goes on from the new data's first epoch, its samples counted from 0
        (--epochs: E epochs of the new data)."""
        data = self.data
        # First the model against the data, as every command holds it (data/fit.py): a
        # language model goes on only on text of the vocabulary it was trained on, even
        # with --resume-other-data (the same ids of another vocabulary are other tokens).
        check_fit(f"checkpoint {ckpt.path}", self.plan.spec.input_kind, data.dir,
                  text=recorded_text(ckpt.attrs, ckpt.path),
                  advice="resume on text of its vocabulary, or start fresh with another --checkpoint-dir")
        line = check_data(ckpt, data.digest, data.dir, self.outputs.resume_other_data)
        if line:
            print(f"hpctrain: warning: {line}", file=sys.stderr, flush=True)
        have = ckpt.attrs.get("data_digest")
        if have and have != data.digest:   # --resume-other-data (check_data refused it otherwise)
            ckpt.data_positions = np.zeros_like(ckpt.data_positions)
            ckpt.attrs["samples"] = 0

    def resumed_line(self, resume, steps):
        """The chief's line for a resumed run whose last step is `steps` (resumed_line below)."""
        return resumed_line(self.plan, self.saved_path, resume, steps)

    def seek_readers(self, reader, resume):
        """Every worker: its reader to the checkpoint's `resume_point`, whatever
        number of workers wrote it."""
        world, cluster = self.world, self.world.cluster
        point = np.zeros(2, np.int64)
        if resume.held is not None:
            point[:] = resume.held.position
        elif resume.checkpoint is not None:
            point[:] = resume_point(resume.checkpoint.data_positions)
        with world.waiting("checkpoint broadcast (data positions)", peer=cluster.chief_rank):
            cluster.worker_comm.Bcast(point, root=0)
        epoch, pos = (int(v) for v in point)

        def seek():
            try:
                reader.seek(epoch, pos)
            except HpctrainError as e:
                raise HpctrainError(f"{e}: the checkpoint's data position does not fit this data "
                                    f"(was --data changed?)") from None
        world.agreed(cluster.worker_comm, seek)

    # --- while training (loops/frame.py says when) --------------------------------

    def gather_positions(self, reader, comm=None):
        """Every rank of comm (the workers'; a pipeline's first stage, one
        rank per replica): (ranks, 2) int64 reader positions on the chief,
        its rank 0; None elsewhere."""
        world, cluster = self.world, self.world.cluster
        comm = cluster.worker_comm if comm is None else comm
        mine = np.array(reader.position, np.int64)
        everyone = np.empty((comm.Get_size(), 2), np.int64) if world.chief else None
        with world.waiting("checkpoint gather (data positions)", peer=cluster.chief_rank):
            comm.Gather(mine, everyone, root=0)
        return everyone

    def save_parts(self, comm, step, parts, keys, optimizer_t, positions, compression=None):
        """Collective over comm: the checkpoint of `step` from every rank's
        `parts` (state/layouts.py; keys: the optimizer's state arrays), with
        the data positions (`positions`, the chief's) and --compression's
        state (`compression`: checkpoints/powersgd_state.Saved, or None) beside.
        Each rank writes its writer parts (and its box of the compression's
        error feedback), the chief the index last
        (checkpoints/named.py). Not finite parameters: no checkpoint, every
        rank stops alike. A failure to write stops every rank of comm with one
        error line. Returns the path."""
        world, plan = self.world, self.plan
        device.synchronize(world.xp)
        if not finite(parameters(parts, plan.spec.full), comm, world.waiting):
            raise self._diverged(step, collective=True)
        tensors, attrs, small = self._contents(step, keys, optimizer_t, positions, compression)
        with self.timeline.span("checkpoint", cat="checkpoint"):
            # every rank writes its file: busy, not stalled, while others wait for it (its MPI waits have deadlines)
            with world.watchdog.busy():
                path = write_checkpoint(self.outputs.checkpoint_dir, step, comm, world.chief_in(comm),
                                        self.pieces(parts + (compression.parts if compression else [])),
                                        tensors, attrs, small,
                                        keep=self.outputs.keep_checkpoints, waiting=world.waiting)
        self.saved_step, self.saved_path = step, path
        return path

    def pieces(self, parts):
        """What this rank writes of `parts`: its writer parts' (name, box, host values) in the run's precision."""
        return [(p.name, p.box, np.ascontiguousarray(device.to_host(p.view), self.plan.precision.params))
                for p in parts if p.writer]

    def _diverged(self, step, collective):
        return HpctrainError(f"the parameters of step {step} are not finite: training diverged (try a lower "
                             f"--lr); no checkpoint written", exit_code=EXIT_DIVERGED, collective=collective,
                             report=self.world.chief or not collective)

    def _contents(self, step, keys, optimizer_t, positions, compression):
        """The checkpoint's tensors {name: (shape, dtype, aliases)}, attributes
        and the small datasets the chief writes into the index."""
        plan, spec = self.plan, self.plan.spec.full
        shapes, arrays, more = (compression.tensors, compression.arrays, compression.attrs) if compression \
            else ({}, {}, {})
        keys, name, dtype = sorted(keys), plan.optimizer.name, np.dtype(plan.precision.params).str
        ties = spec.aliases()   # a tied tensor once, with the names that read it (the GPT's head/W)
        tensors = {t: (tuple(shape), dtype, ties.get(t, [])) for t, shape, _, _ in spec.tensors + spec.state}
        tensors.update({f"{name}.{key}/{t}": (tuple(shape), dtype, []) for key in keys
                        for t, shape, _, _ in spec.tensors})
        tensors.update({t: (tuple(shape), dtype, []) for t, shape in shapes.items()})
        attrs = {"optimizer_t": int(optimizer_t), "optimizer_state": ",".join(keys),
                 "model_state": int(spec.num_state), **({"compression_state": ",".join(arrays)} if arrays else {}),
                 **dict(plan.recorded, samples=self.samples_at(step), data=self.data.dir,
                        data_digest=self.data.digest, config=json.dumps(plan.config, sort_keys=True),
                        **self.best.checkpoint_attrs(), **(self.clock() if self.clock else {}),
                        **model_record(plan.spec, plan), **more),
                 **plan.resume_key}
        small = {"data_positions": np.asarray(positions if positions is not None else np.zeros((0, 2)), np.int64),
                 **{f"compression/{k}": device.to_host(a) for k, a in arrays.items()}}
        return tensors, attrs, small

    # --- ps mode: the servers write their parts at the cut, the chief the rest ---

    def folder_for_servers(self, step):
        """ps's chief, around a cut: the temporary folder the servers write
        their parts into when they take it (named.new_folder: a context
        manager that removes it on the way out)."""
        return new_folder(self.outputs.checkpoint_dir, step)

    def save_written(self, step, folder, parts, written, keys, t, positions):
        """ps's chief, once the servers wrote their parts into `folder`
        (`written`: their named.write_part outcomes, each with `finite`, its
        parameters'): its own writer `parts` (the non-trainable state) beside
        them, then the index (named.finish), while servers and workers keep
        going. Not finite parameters or a failure to write: no checkpoint
        (folder_for_servers removes the folder), one error line, and the job
        aborts (the others are not at a point where they could agree)."""
        if not all(w.get("finite", True) for w in written):
            raise self._diverged(step, collective=False)
        tensors, attrs, small = self._contents(step, keys, t, positions, None)
        with self.timeline.span("checkpoint", cat="checkpoint"):
            mine = write_part(folder, self.world.cluster.rank, self.pieces(parts))
            path = finish(self.outputs.checkpoint_dir, step, folder, tensors, attrs, small, [mine, *written],
                          keep=self.outputs.keep_checkpoints)
        self.saved_step, self.saved_path = step, path
        return path

    # --- pre-emption ----------------------------------------------------------

    def raise_preempted(self, comm, step):
        """After every rank of comm stopped at `step` (and the checkpoint is
        written): raise the EXIT_PREEMPTED error everywhere, the chief's line
        naming the signal (whichever rank got it) and the checkpoint."""
        from mpi4py import MPI
        world = self.world
        sig = np.array([world.stop.signum], np.int64)
        with world.waiting("stop agreement", peer=None):
            comm.Allreduce(MPI.IN_PLACE, sig, op=MPI.MAX)
        name = signal.Signals(int(sig[0])).name if sig[0] else "a signal"
        if self.saved_path and self.saved_step == step:
            where = f"checkpoint {self.saved_path}; run the same command again to resume"
        elif not self.enabled:
            where = "no checkpoint written (no --checkpoint-dir): a new run starts from step 0"
        elif self.saved_path:
            where = (f"no checkpoint of step {step} written; the newest is {self.saved_path} "
                     f"(step {self.saved_step}): run the same command again to resume from it")
        else:
            where = f"no checkpoint of step {step} written, and none before it: a new run starts from step 0"
        raise HpctrainError(f"stopped by {name} after step {step}; {where}",
                            exit_code=EXIT_PREEMPTED, collective=True, report=world.chief)


def resumed_line(plan, saved_path, resume, steps):
    """The chief's line for a resumed run; on another number of workers it
    says where the data goes on and what --scale-lr makes of the lr."""
    step, workers = resume.step, plan.data.workers
    note = f" (--steps {steps}: nothing left to train)" if step >= steps else ""
    line = f"resumed from {saved_path} at step {step}{note}"
    before = int(resume.checkpoint.attrs.get("num_workers", workers)) if resume.checkpoint else workers
    if before != workers:
        epoch, pos = resume_point(resume.checkpoint.data_positions)
        line += (f"; written with {_workers(before)}, this run has {workers}: the rest of epoch "
                 f"{epoch} (from sample {pos}) is dealt over {_workers(workers)}")
        if plan.epochs is not None:
            line += (f"; --epochs {plan.epochs:g}: {resume.samples} samples taken so far, "
                     f"the rest at {plan.data.per_update_line()}: the run ends at step {steps}")
        if plan.schedule.scale_lr:
            line += (f"; --scale-lr: lr {plan.lr(step):g} at step {step} for "
                     f"{_workers(workers)} (was {plan.lr(step) * before / workers:g})")
    return line


def _workers(n):
    return f"{n} worker{'' if n == 1 else 's'}"


def tuning_line(saved, now):
    """The warning for a resume whose layers round otherwise than the run
    that wrote the checkpoint (its recorded `tuning`: "NumPy" or the compiled
    layers' label, run/identity.py; compared by its key, tuning.rounding),
    or None. Not a refusal: the run goes on as the arithmetic says, but
    not bit-exact with the uninterrupted run.
    A checkpoint from before the key was recorded says nothing."""
    if saved is None or rounding(str(saved)) == rounding(now):
        return None
    return (f"the checkpoint's layers rounded as {saved}, this run's as {now} (another CPU type, "
            f"--compiled-layers or --blas): the resumed run's bits will differ from an uninterrupted one's")
