"""One step's gradient, loss and stop flag, written once: a ring step
(loops/ring_step.py), a pipeline stage's chunks (pipeline/engine.py) and a
ps worker (loops/ps.py) each hold a StepGradient.

Its micro-batches (--accumulate-steps K, a pipeline's M) are summed in one
order, g_0, += g_1 ... (`Accumulation`), so ring, ps and a pipeline give
the same bits (the last addition, g + sum or sum + g, is one value); a tied
tensor's later uses (nn/tied.py; combine=False) apart, combined once the sum
is whole; their losses' mean. The update reads the sum where it always did:
ring mode adds it into the last micro-batch's gradient a layer at a time
(`layer_done`: each bucket starts at once), ps at once (`into`), a pipeline
chunk sums into the buffer its replicas average (`combine_tied`).

The loss and stop flag are summed over the ranks in a float64 allreduce of
their own (the buckets exchange the gradient only). A ring step starts it as
soon as the host holds the loss (`loss_ready`; from a GPU through pinned
memory, started in `summed()`): the loop never waits for the optimizer's
kernels. A pipeline sums [loss, stop, fp16 notes] after its update
(`sum_now`). The fp16 notes (--compression fp16: parameters not finite, a
value not finite put on the wire), summed, tell a 16-bit overflow from
divergence (`overflowed`); a ring step asks after its update
(`wire_overflowed`). A ps worker's push carries its loss: no comm there.

    mpirun -n 3 python -m mpi4py -m pytest --only-mpi tests/test_step_gradient.py
"""
import numpy as np
from mpi4py import MPI

from ..base.device import all_finite
from ..base.precision import FLOAT32
from .strategy import waiting


class Accumulation:
    """The running sum of arrays of one shape, into `out` (owned by the caller)."""

    def __init__(self, out):
        self.out, self.count = out, 0

    def add(self, array):
        """The next one: the first is copied, every other added in order."""
        if self.count:
            self.out += array
        else:
            self.out[...] = array
        self.count += 1

    def add_range(self, part, lo, hi):
        """As add, for the next one's [lo:hi] only (`part`); counted() once every range is in."""
        if self.count:
            self.out[lo:hi] += part
        else:
            self.out[lo:hi] = part

    def counted(self):
        self.count += 1

    def into(self, target, lo=None, hi=None):
        """target[lo:hi] += the sum's [lo:hi] (all of it without lo, hi)."""
        view = target[lo:hi]   # a view, added into in place (GradSlots has no item assignment)
        view += self.out[lo:hi]

    def mean(self):
        """The sum times 1 / count (a new array)."""
        return self.out * (1.0 / self.count)

    def restart(self):
        """The next add starts a new sum (the buffer is kept)."""
        self.count = 0


class StepGradient:
    """A step's gradient over its micro-batches, its loss and its stop flag
    (see the module's docstring). parts: [(sum buffer, tied-uses buffer)] of
    the parts whose micro-batches are summed (none: one micro-batch a step,
    nothing summed); dtype: the losses'; comm, copier, watchdog: the loss and
    stop flag's allreduce (comm None: none)."""

    def __init__(self, xp, dtype, parts=(), comm=None, copier=None, watchdog=None):
        # per part: its gradient's sum into `out` (the caller's), its tied uses' into one of their own
        self.sums = [(Accumulation(out), Accumulation(xp.zeros_like(extra))) for out, extra in parts]
        self.losses = Accumulation(xp.zeros(1, dtype))
        self.comm, self.copier, self.watchdog = comm, copier, watchdog
        if copier is not None:   # a ring step's: the loss copied to the host as forward has it
            self._host_loss = copier.host_empty(1, FLOAT32.compute)   # the loss, as the model computes it
        self._mine, self._sum = np.zeros(2, np.float64), np.zeros(2, np.float64)   # a ring step's [loss, stop]
        self._head = np.zeros(4, np.float64)   # a pipeline's [loss, stop, parameters not finite, wire not finite]
        self._copied = self._request = None

    # --- the micro-batches --------------------------------------------------

    def begin(self, stop=False):
        """A new step: its sums start again; this rank's wish to stop."""
        for grads, extra in self.sums:
            grads.restart()
            extra.restart()
        self.losses.restart()
        self._mine[1] = 1.0 if stop else 0.0

    def add(self, grads, extra, loss=None, part=0):
        """A micro-batch's gradient and its tied tensors' later uses (`grads`
        None: added a range at a time, add_range), and its loss if given."""
        grad_sum, extra_sum = self.sums[part]
        if grads is None:
            grad_sum.counted()
        else:
            grad_sum.add(grads)
        extra_sum.add(extra)
        if loss is not None:
            self.losses.add(loss)

    def add_range(self, grads, lo, hi, part=0):
        """A micro-batch's gradient's [lo:hi] (--zero 2 adds a layer at a time
        as backprop finishes it: its slots hold one bucket); add(None, ...) after."""
        self.sums[part][0].add_range(grads, lo, hi)

    def tied_sums(self, part=0):
        """The part's tied tensors' later uses summed over the step (a buffer
        shaped as the runner's extra; pipeline/tied.py hands a copy's to its owner)."""
        return self.sums[part][1].out

    def add_loss(self, loss):
        self.losses.add(loss)

    def loss_mean(self):
        """The micro-batches' losses summed in order, times 1/K (a new 1-element array)."""
        return self.losses.mean()

    def layer_done(self, run, i, grads, extra, lo, hi):
        """The last micro-batch's layer i (its gradient [lo:hi] of `grads`) is
        done: the sum of the others added in, and each tied tensor whose last
        use it is gets its uses' sums over the step, then their sum
        (nn/tied.py). Ring mode, as each layer's bucket is about to start."""
        grad_sum, extra_sum = self.sums[0]
        grad_sum.into(grads, lo, hi)
        for group in run.ties.done_by(i):
            extra_sum.into(extra, *run.ties.extra_range(group))
        run.combine(i, grads, extra)

    def into(self, model):
        """The last micro-batch's gradient (a whole model's, nn/sequential.Sequential)
        += the others' sum, tied tensors combined: a ps worker's push."""
        grad_sum, extra_sum = self.sums[0]
        grad_sum.into(model.grads)
        extra_sum.into(model.extra)
        model.combine()

    def combine_tied(self, run, a, b, part=0):
        """After the step's last backward of layers [a, b) (a pipeline chunk,
        whose sum is the gradient its replicas average): each tied tensor's
        summed uses added into its gradient, in backprop order."""
        grad_sum, extra_sum = self.sums[part]
        for i in range(b - 1, a - 1, -1):
            run.combine(i, grad_sum.out, extra_sum.out)

    # --- the loss and stop flag ---------------------------------------------

    def loss_ready(self, loss):
        """Forward wrote this rank's loss (1 element): from the host it goes out at once."""
        self._copied = self.copier.to_host(loss, self._host_loss, after=self.copier.mark())
        if self._copied is None:   # a host array: nothing to wait for
            self._start()

    def _start(self):
        self._mine[0] = self._host_loss[0]
        self._request = self.comm.Iallreduce(self._mine, self._sum, op=MPI.SUM)

    def summed(self):
        """(loss summed over the ranks, did any rank ask to stop): waits for the sum loss_ready started."""
        if self._request is None:
            self.copier.wait(self._copied)
            self._start()
        with waiting(self.watchdog, "loss and stop allreduce"):
            self._request.Wait()
        self._request = self._copied = None
        return float(self._sum[0]), bool(self._sum[1] > 0)

    def sum_now(self, loss, stop, notes, waits):
        """A pipeline's [loss, stop, fp16_notes] summed over comm after its update:
        (loss, any rank stops, the fp16 sum overflowed), the same everywhere."""
        head = self._head
        head[0], head[1], head[2:] = loss, 1.0 if stop else 0.0, (0.0, 0.0) if notes is None else notes
        with waiting(self.watchdog, "loss and stop allreduce"):
            waits.allreduce(self.comm, head, MPI.SUM)
        return float(head[0]), bool(head[1] > 0), overflowed(head[2:])


def fp16_notes(params, exchange):
    """(any of `params` not finite, this rank put a value that is not finite
    on the fp16 wire) as float64 0/1; None without --compression fp16 (no scan)."""
    if exchange is None or exchange.kind != "fp16":
        return None
    finite = all(all_finite(p) for p in params)
    return np.array([not finite, not exchange.sent_finite], np.float64)


def overflowed(notes):
    """Summed fp16 notes: some parameter is not finite though every value on
    the wire was, i.e. a sum past fp16's 65504 became inf in 16 bits."""
    return bool(notes[0] > 0 and notes[1] == 0)


def wire_overflowed(params, exchange, comm, waiting_for, replicated):
    """After a ring step whose summed loss was finite: did the fp16 sum
    overflow (the same answer on every rank of comm)? replicated: every rank
    holds the same `params`, so comm is asked only where they are not
    finite (--zero 3's shards and --tensor-parallel's slices ask every step)."""
    notes = fp16_notes(params, exchange)
    if notes is None or (replicated and not notes[0]):
        return False
    with waiting_for("fp16 overflow check (allreduce)"):
        comm.Allreduce(MPI.IN_PLACE, notes, op=MPI.SUM)
    return overflowed(notes)
