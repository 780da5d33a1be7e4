"""What every training loop does around its steps, written once: a run's
start (its checkpoints, the resume point, the last step, the report; then,
once the loop has built its state, the resume's tail: the state restored,
the readers at the checkpoint's position, the chief's line), the batches,
the clock (samples/s counts the training loop alone, evaluations excluded),
the per-step accounting, the progress line's cadence and mean loss, the
periodic evaluation, when a checkpoint is due, the training phase (during
which a stop signal is the loop's to take), the divergence check, the
"stopping" line, and a run's end (the final validation, the last checkpoint,
the pre-emption exit, or the evaluation and the chief's final record and
--save). loops/ring.py, ps.py and pipe.py each own their step; the frame owns
the rest.

    mpirun -n 4 python -m hpctrain.train --steps 200 --log-every 50 --eval-every 100
"""
import contextlib
import math
import time

import numpy as np
from mpi4py import MPI

from ..checkpoints.resume import Checkpoints
from ..base.errors import EXIT_DIVERGED, HpctrainError
from ..report.best import Best
from ..report.params import save_params
from ..report.report import Report, peak_memory_and_step_medians, results_note
from ..report.step_stats import StepStats


def diverged(step, loss, speaks, collective=True):
    """The error that ends a run whose loss became inf or nan (exit 4: a requeue
    would only diverge again; the last checkpoint, if any, is from before).
    speaks: this rank prints the line."""
    return HpctrainError(f"the loss became {loss} at step {step}: training diverged (try a lower --lr "
                         f"or --warmup-steps); no checkpoint of these parameters is written",
                         exit_code=EXIT_DIVERGED, collective=collective, report=speaks)


def wire_overflow(step, speaks):
    """The exit-4 error of a step whose fp16 exchange overflowed: every
    gradient was finite, their sum in 16 bits was not (loops/ring_step.py
    wire_overflowed), so a lower lr is not the cure: a wider wire is."""
    return HpctrainError(f"the gradients' sum at step {step} overflowed the 16-bit wire of --compression fp16 "
                         f"(a value past fp16's largest, 65504, after dividing by the ranks) though every rank's "
                         f"gradient was finite: use --compression bf16 (float32's range, the same bytes) or none; "
                         f"no checkpoint of these parameters is written",
                         exit_code=EXIT_DIVERGED, collective=True, report=speaks)


class LossLog:
    """The progress line's cadence and the mean loss since the last one: a
    line when the step crossed a multiple of --log-every (an async ps worker's
    step may jump past one), and at the last step if not yet logged."""

    def __init__(self, every, start):
        self.every, self.logged = every, start
        self.next = (start // every + 1) * every
        self.total, self.count = 0.0, 0

    def add(self, loss):
        self.total += loss
        self.count += 1

    def due(self, step, last):
        return step >= self.next or (last and step != self.logged)

    def take(self, step):
        """The mean since the last line; the next line counts from `step`."""
        mean = self.total / self.count
        self.total, self.count = 0.0, 0
        self.logged, self.next = step, (step // self.every + 1) * self.every
        return mean


class Frame:
    """One run's loop frame (world: run/world.World, plan: run/plan.Plan,
    inputs: run/inputs.Inputs, timeline: the chief's trace). Made by every
    rank of `comm`, the ranks that resume together (ring: the workers; ps
    and a pipeline: the world), with whom it finds the resume point: the
    chief reads the newest checkpoint, every rank learns its step."""

    def __init__(self, world, plan, inputs, timeline, comm):
        self.world, self.plan, self.inputs, self.timeline = world, plan, inputs, timeline
        best = Best(plan.outputs.keep_best, by_loss=plan.data.text)
        self.checkpoints = Checkpoints(world, plan, timeline, best, clock=self.clock)
        self.resume = self.checkpoints.load(comm)   # None: a fresh run
        self.steps = plan.last_step(self.resume)     # the run's last step
        self.start = self.resume.step if self.resume is not None else 0
        self.report = Report(world, plan, self.steps, timeline, best)
        self.stats = StepStats()
        self.log = LossLog(plan.outputs.log_every, self.start)
        every = plan.outputs.checkpoint_every if self.checkpoints.enabled else 0
        self._every = every
        self._next_checkpoint = (self.start // every + 1) * every if every else None
        self.comm_s = self.compute_s = 0.0
        self._t0 = None
        self.loop_s = None   # the training loop's seconds, once it ended
        self._noisy = plan.spec.draws_noise   # dropout: masks of (seed, epoch, sample id)

    # --- the start ----------------------------------------------------------------

    def resumed(self, reader, restore=None, initialize=None):
        """Once the loop has built its state: a resumed run's state restored
        (restore(resume), the loop's own: its buffers differ; the chief's
        checkpoint closed after it), every worker's reader at the
        checkpoint's data position, the chief's line; a fresh run with
        --init-from its parameters from PATH (initialize(), the loop's:
        self.init_from on its parts); and the report learns where the run
        starts (a fresh run: a fresh metrics file). Collective over the workers."""
        resume = self.resume
        if resume is None and self.plan.init_from and initialize is not None:
            initialize()
            self.world.say(f"hpctrain: parameters from --init-from {self.plan.init_from} ({self.plan.model}); "
                           f"the optimizer starts fresh")
        if resume is not None:
            try:
                if restore is not None:
                    restore(resume)
            finally:   # the chief's checkpoint (open files: its index, a lazy flat file) read: closed
                if resume.checkpoint is not None:
                    resume.checkpoint.close()
            self.checkpoints.seek_readers(reader, resume)
            if resume.held is None:
                self.world.say(self.checkpoints.resumed_line(resume, self.steps))
            else:   # after a lost rank: run/survival.py's line
                self.world.survival.restored(self.world.say)
        # (an in-memory commit is no checkpoint on disk, but the metrics go on from it as from one)
        held = resume is not None and resume.held is not None
        self.report.resume_at(resume.step if held else self.checkpoints.saved_step, resume)

    def init_from(self, comm, parts):
        """Collective over comm: this rank's parameters' parts (parts: all it
        holds, state/layouts.py) from --init-from's tensors, each rank reading
        its own boxes from the file (interop/pretrained.py)."""
        from ..base import device
        from ..interop.pretrained import initialize
        self.world.agreed(comm, initialize, self.plan.init_from, self.plan.spec, parts, self.world.xp,
                          what="--init-from read")
        device.synchronize(self.world.xp)

    def batch(self, reader, own=False):
        """The reader's next batch on the model's device: (x, y, noise), noise
        the (seed, epoch, sample ids) that dropout's masks are drawn from, or
        None for a model without dropout. own: arrays of its own (a
        pipeline holds several micro-batches at once, and the reader reuses
        its buffers); a stage's reader may give None for what it does not read."""
        xp = self.world.xp
        x, y = reader.next_batch()
        if own:
            x, y = (None if a is None else xp.array(a) for a in (x, y))
        else:
            x, y = xp.asarray(x), xp.asarray(y)
        if not self._noisy:
            return x, y, None
        epoch, ids = reader.last_draw
        return x, y, (self.plan.data.seed, epoch, np.array(ids) if own else ids)

    # --- the steps ------------------------------------------------------------------

    @contextlib.contextmanager
    def training(self):
        """The training loop: its clock runs, and a stop signal is the loop's
        to take (the next step carries it to every rank). Leaving it normally,
        the run is finishing: a signal then may find a rank stuck, and the
        watchdog acts on it (run/stop_signal.StopSignal). Leaving it for a signal (the
        loop returns True from `stopping`), the loop's own end follows:
        the checkpoint and exit 75 together."""
        self._t0 = time.perf_counter()
        with self.world.stop.training() as phase:
            self._phase = phase
            yield self
            self.loop_s = time.perf_counter() - self._t0
            self.stats.training_ended()

    def elapsed(self):
        """Seconds of training so far, evaluations excluded."""
        return time.perf_counter() - self._t0

    def clock(self):
        """The run's time so far over every segment (a resumed run's earlier
        ones as its checkpoint recorded them), as each checkpoint records it:
        wall seconds since the first run started, compute and communication
        seconds, and the runs (1 + resumes) that took them."""
        wall, compute, comm, runs = self.resume.clock if self.resume is not None else (0.0, 0.0, 0.0, 0)
        return {"elapsed_s": round(wall + time.perf_counter() - self.world.t_start, 3),
                "compute_s_total": round(compute + self.compute_s, 4), "comm_s_total": round(comm + self.comm_s, 4),
                "segments": runs + 1}

    def timed(self, t0, t1, t2, exposed_comm_s=None, exposed_update_s=0.0, update_s=0.0):
        """One step's accounting: compute from t0 to t1, then communication to t2."""
        self.compute_s += t1 - t0
        self.comm_s += t2 - t1
        self.timeline.step_ended()
        self.stats.record(step_s=t2 - t0, compute_s=t1 - t0, wait_s=t2 - t1,
                          comm_exposed_s=t2 - t1 if exposed_comm_s is None else exposed_comm_s,
                          optimizer_exposed_s=exposed_update_s, optimizer_total_s=update_s)

    def summed_loss(self, step, loss, ranks, grad_norm=None):
        """After a step whose loss was summed over `ranks` (the same bits on
        every rank, so all find it diverged alike): the divergence check, the
        mean since the last line, the chief's progress line. grad_norm: a
        callable, asked only when a line is due (--clip-norm's mean norm)."""
        if not math.isfinite(loss):
            raise diverged(step, loss / ranks, self.world.chief)
        self.log.add(loss)
        if self.log.due(step, last=step == self.steps):
            mean_loss = self.log.take(step) / ranks
            if self.world.chief:
                self.report.progress(step, mean_loss, self.samples(step), self.elapsed(),
                                     grad_norm=grad_norm() if grad_norm else None)

    def after_step(self, model, step):
        """The chief's periodic evaluation; its time is not training time.
        model: report/evaluated.py's (a collective one, a pipeline's, is
        evaluated by every rank together)."""
        if model.collective or self.world.chief:
            self._t0 += self.report.periodic_eval(model, step)

    def checkpoint_due(self, step):
        """True once per --checkpoint-every crossing (not again at a step
        already saved, such as the one a run resumed from)."""
        if not self._every or step < self._next_checkpoint or step == self.checkpoints.saved_step:
            return False
        self._next_checkpoint = (step // self._every + 1) * self._every
        return True

    def stopping(self, step):
        """A signal stopped the run before its last step: say so (the chief);
        the loop then writes the checkpoint and ends with exit 75."""
        self._phase.stopped = True
        if self.world.chief:
            print(f"stopping after step {step}: signal received", flush=True)
            self.report.metrics.close()

    def step_ended(self, step, loss, ranks, clip, model, stopped, save, overflowed=None, commit=None):
        """The ring's and the pipeline's tail of a step, once its loss and stop
        flag are summed (the same bits on every rank): the loss line
        (summed_loss, clip: --clip-norm's Clip or None), the fp16 wire's
        overflow (overflowed(): True where the parameters went non-finite
        though every gradient sent was finite; the same answer on every rank),
        the periodic evaluation of `model`, then True to leave the loop (some
        rank asked to stop) or, when due, the checkpoint (save(step)) and False;
        under --on-failure shrink, when due, the in-memory commit (commit(step))."""
        self.summed_loss(step, loss, ranks, grad_norm=clip.mean_norm if clip else None)
        if overflowed is not None and overflowed():
            raise wire_overflow(step, self.world.chief)
        self.after_step(model, step)
        if stopped:
            if step < self.steps:
                self.stopping(step)
            return True
        survival = self.world.survival
        if survival is not None and survival.due(step) and commit is not None:
            commit(step)   # before the checkpoint: a rank lost while it is written costs no steps
        if self.checkpoint_due(step):
            save(step)
        if survival is not None:
            survival.stepped(step, self.checkpoints.saved_step)   # (the exit-75 line names it)
        return False

    def samples(self, step):
        """Training samples this run took up to `step`, globally."""
        return (step - self.start) * self.plan.per_step

    # --- the end --------------------------------------------------------------------

    def end(self, step, preempted, comm, model, save=None, extra=None, state_bytes=None, alone=False):
        """After the training loop, on every rank of comm (the ranks that
        resumed together): the chief's final validation (before the last
        checkpoint, which records the best), the last checkpoint (save(step),
        the loop's own, unless this step is saved already), then the
        pre-emption exit (75 everywhere), or the results: the largest
        optimizer state any rank holds (state_bytes: this rank's) and the
        final evaluation (none with --final-eval off) and record (`finish`). model: report/evaluated.py's
        (a collective one, a pipeline's, is evaluated by every rank together)."""
        world, checkpoints = self.world, self.checkpoints
        if world.survival is not None:   # a rank lost from here on is lost in the run's end, not in a step
            world.survival.ending()
        final_eval = self.plan.outputs.final_eval == "on"
        if (world.chief or model.collective) and self.plan.data.has_val and not preempted and final_eval:
            self.report.final_val(model, step)
        if save is not None and checkpoints.enabled and checkpoints.saved_step != step:
            save(step)
        if preempted:
            checkpoints.raise_preempted(comm, step)
        extra = dict(extra or {})
        if world.survival is not None:   # --on-failure shrink: the lost ranks the run went on without
            extra["recoveries"] = list(world.survival.recoveries)
            extra["commits"] = world.survival.totals()
        if state_bytes is not None:   # sharded: about 1/N of it
            most = np.array([state_bytes], np.int64)
            with world.waiting("optimizer state size allreduce", peer=None):
                comm.Allreduce(MPI.IN_PLACE, most, op=MPI.MAX)
            extra["optimizer_state_bytes"] = int(most[0])
        return self.finish(model, step, extra, alone)

    def finish(self, model, step, extra, alone=False):
        """The final evaluation, --save, the chief's record, on every worker
        (alone: the chief by itself, ps with a worker left behind; the
        others return None). Parameters that are not finite (a NaN gradient
        in the last step: the loss, read before the update, was finite) are
        no result: exit 4, nothing saved. Every worker holds the same
        parameters here (or a collective model agrees), so all find it alike.
        If --save failed, every worker exits with the chief's line (no abort:
        nobody is left waiting)."""
        world, report, checkpoints, outputs = self.world, self.report, self.checkpoints, self.plan.outputs
        if alone and not world.chief:
            return None
        if not model.finite():
            raise HpctrainError(f"the parameters after step {step} are not finite: training diverged in its last "
                                f"step (try a lower --lr or --warmup-steps); no --save, no final record",
                                exit_code=EXIT_DIVERGED, collective=not alone, report=world.chief)
        if not alone:
            model.share_state()
        if self.plan.outputs.final_eval == "off":
            test = None   # --final-eval off: every rank skips the evaluation alike (the record says so)
        elif self.plan.data.val_is_test:
            # text: the held-out tail final_val evaluated already (end() ran it on the chief, or on
            # every rank of a collective model); every rank skips the collective evaluation alike
            test = report.final_test_from_val() or (0.0, 0.0, 0)
        else:
            if alone:
                with world.watchdog.busy():
                    test = model.evaluate("test")
            else:
                test = model.evaluate_parts(self.inputs)
            n = max(test[2], 1)
            test = (test[0] / n, test[1] / n, test[2])
        checkpoint = checkpoints.saved_path if checkpoints.saved_step == step else None
        save_error = None
        if model.collective:
            save_error = save_params(outputs.save, model, step, checkpoint, agree=model.agree, chief=world.chief)
        elif world.chief:
            with world.watchdog.busy(), world.waiting(f"writing --save {outputs.save}", peer="the file system"):
                save_error = save_params(outputs.save, model, step, checkpoint)
        result = {"test": test, "medians": peak_memory_and_step_medians(world, self.stats, alone), "model": model,
                  "save_error": save_error,
                  "checkpoint": (checkpoints.saved_path, checkpoints.saved_step) if checkpoints.saved_path else None}
        record = None
        if world.chief:
            record, save_error = report.final(result, step, self.loop_s, self.samples(step), self.comm_s,
                                              self.compute_s, extra)
        if alone:
            _raise_if(save_error)
            return record
        world.agreed(world.cluster.worker_comm, _raise_if, save_error, what="the chief's final record and --save")
        # Every worker knows now: a deadline line from here on says so.
        world.watchdog.results_written(results_note(self.plan.outputs))
        return record


def _raise_if(line):
    if line:
        raise HpctrainError(line)
