"""What every training loop does around its steps, written once: the clock
(samples/s counts the training loop alone, evaluations excluded), the
per-step accounting, the progress line's cadence and mean loss, the
periodic evaluation, when a checkpoint is due, the training phase (during
which a stop signal is the loop's to take), the divergence check, the
"stopping" line and the final record. loop_ring.py and loop_ps.py (and the
pipeline loop to come) each own their step; the frame owns the rest.

    mpirun -n 4 python -m hpctrain.train --steps 200 --log-every 50 --eval-every 100
"""
import contextlib
import math
import time

from .. import device
from ..comm.device_buffers import bcast
from ..errors import EXIT_DIVERGED, HpctrainError
from ..report.report import finish_everywhere


def diverged(step, loss, speaks, collective=True):
    """The error that ends a run whose loss became inf or nan (exit 4: a requeue
    would only diverge again; the last checkpoint, if any, is from before).
    speaks: this rank prints the line."""
    return HpctrainError(f"the loss became {loss} at step {step}: training diverged (try a lower --lr "
                         f"or --warmup-steps); no checkpoint of these parameters is written",
                         exit_code=EXIT_DIVERGED, collective=collective, report=speaks)


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
    """One run's loop frame. start: the step this run starts at (a resumed
    run's checkpoint step, else 0)."""

    def __init__(self, session, config, report, checkpoints, start):
        self.session, self.config, self.report, self.checkpoints = session, config, report, checkpoints
        self.start = start
        self.log = LossLog(config.args.log_every, start)
        every = config.args.checkpoint_every if checkpoints.enabled else 0
        self._every = every
        self._next_checkpoint = (start // every + 1) * every if every else None
        self.comm_s = self.compute_s = 0.0
        self._t0 = None
        self.loop_s = None   # the training loop's seconds, once it ended

    @contextlib.contextmanager
    def training(self):
        """The training loop: its clock runs, and a stop signal is the loop's
        to take (the next step carries it to every rank). Leaving it normally,
        the run is finishing: a signal then may find a rank stuck, and the
        watchdog acts on it (stop_signal.StopSignal). Leaving it for a signal (the
        loop returns True from `stopping`), the loop's own end follows:
        the checkpoint and exit 75 together."""
        self._t0 = time.perf_counter()
        with self.session.stop.training() as phase:
            self._phase = phase
            yield self
            self.loop_s = time.perf_counter() - self._t0

    def elapsed(self):
        """Seconds of training so far, evaluations excluded."""
        return time.perf_counter() - self._t0

    def timed(self, t0, t1, t2, exposed_comm_s=None, exposed_update_s=0.0, update_s=0.0):
        """One step's accounting: compute from t0 to t1, then communication to t2."""
        self.compute_s += t1 - t0
        self.comm_s += t2 - t1
        self.session.timeline.step_ended()
        self.session.stats.record(step_s=t2 - t0, compute_s=t1 - t0, wait_s=t2 - t1,
                                  comm_exposed_s=t2 - t1 if exposed_comm_s is None else exposed_comm_s,
                                  optimizer_exposed_s=exposed_update_s, optimizer_total_s=update_s)

    def summed_loss(self, step, loss, ranks, per_step, grad_norm=None):
        """After a step whose loss was summed over `ranks` (the same bits on
        every rank, so all find it diverged alike): the divergence check, the
        mean since the last line, the chief's progress line. grad_norm: a
        callable, asked only when a line is due (--clip-norm's mean norm)."""
        if not math.isfinite(loss):
            raise diverged(step, loss / ranks, self.session.chief)
        self.log.add(loss)
        if self.log.due(step, last=step == self.config.steps):
            mean_loss = self.log.take(step) / ranks
            if self.session.chief:
                self.report.progress(step, mean_loss, self.samples(step, per_step), self.elapsed(),
                                     grad_norm=grad_norm() if grad_norm else None)

    def after_step(self, model, step):
        """The chief's periodic evaluation; its time is not training time."""
        if self.session.chief:
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
        if self.session.chief:
            print(f"stopping after step {step}: signal received", flush=True)
            self.report.metrics.close()

    def share_model_state(self, model):
        """The chief's non-trainable state (batch-norm running statistics) to
        every worker before the evaluation they share. Each worker's own
        statistics follow its own batches; the chief's are the model's (what
        it evaluates alone, checkpoints and saves): DDP's broadcast_buffers,
        once at the end instead of at every step."""
        if not model.state.size:
            return
        session = self.session
        device.synchronize(session.xp)
        with session.watchdog.waiting("model state broadcast", peer=session.cluster.chief_rank):
            bcast(session.cluster.worker_comm, model.state, root=0)

    def samples(self, step, per_step):
        return (step - self.start) * per_step

    def finish(self, model, step, per_step, extra, alone=False):
        """The final evaluation, the chief's record and --save, on every worker
        (alone: the chief by itself, ps with a worker left behind). Parameters
        that are not finite (a NaN gradient in the last step: the loss, read
        before the update, was finite) are no result: exit 4, nothing saved.
        Every worker holds the same parameters here, so all find it alike."""
        if not device.all_finite(model.params):
            raise HpctrainError(f"the parameters after step {step} are not finite: training diverged in its last "
                                f"step (try a lower --lr or --warmup-steps); no --save, no final record",
                                exit_code=EXIT_DIVERGED, collective=not alone, report=self.session.chief)
        if not alone:
            self.share_model_state(model)
        return finish_everywhere(self.session, self.report, model, step, self.loop_s, self.samples(step, per_step),
                                 self.comm_s, self.compute_s, self.checkpoints, extra=extra, alone=alone)
