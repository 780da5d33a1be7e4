"""One ring-mode step's machinery, built top to bottom, each piece from the
ones before it:

1. the wire `[loss, stop, grads...]` (comm/wire.py), and with
   --shard-optimizer a second wire whose body holds the parameters (each
   bucket's allgather then carries them);
2. the model over those buffers (backprop writes the gradient into the wire);
3. the buckets, a pure function of the layer boundaries and --fusion-mb;
4. the optimizer, its state sized by the ranges this rank owns (sharded:
   its shard of each bucket, ~1/N; else everything);
5. with --clip-norm, the norm over the buckets;
6. the fused allreduce, which sums each bucket as backprop finishes it and
   then runs the optimizer on it (`BucketUpdate`, in gradient
   coordinates), as Horovod's hooks start reductions and `step()` waits.

Per step the loop calls `begin(lr, stop)`, the model's
`forward_backward(..., on_layer_done=step.layer_done, loss_out=step.loss_out,
on_forward_done=step.forward_done, combine=step.combine)`, `step.fused.wait()`, then reads
`summed()`: the loss summed over the ranks and whether any rank asked to
stop, the same bits everywhere.

With --accumulate-steps K, the first K - 1 micro-batches of a step go
through `accumulate(x, y, noise)` (no exchange: Horovod's
backward_passes_per_step, DDP's no_sync), and the last one as above: as each
layer's gradient is done its accumulated part is added in before its bucket
starts, the loss slot gets the mean of the K losses, and the optimizer's
gradient scale is 1/(workers x K): one step over K x B samples.

With --compression (comm/compressed_exchange.py) each bucket is exchanged compressed
(`exchange`): fp16/bf16 as 16-bit words, PowerSGD as low-rank factors with
this rank's error feedback; the optimizer, the norm and the stop flag see
the decompressed sum as they see today's.

    mpirun -n 4 python -m hpctrain.train --steps 200 --shard-optimizer on --clip-norm 1
    mpirun -n 4 python -m hpctrain.train --steps 200 --compression powersgd --powersgd-start 20
"""
import numpy as np
from mpi4py import MPI

from ..comm.compressed_exchange import make_exchange, sharding_for
from ..comm.fusion import FusedAllreduce, bucket_bounds, owned_ranges
from ..comm.grad_norm import BucketNorm
from ..comm.wire import GRADS, LOSS, STOP, Wire
from ..device import all_finite
from ..nn.accumulate import Accumulation
from ..optim.compression_math import powersgd_layout
from ..optim.optimizers import make_optimizer


class BucketUpdate:
    """What the fused allreduce runs on each summed range of the wire: the
    optimizer on the same range of the model's buffers. Sharded, the loss and
    stop slots' sums are first copied into the parameter wire, whose
    allgather then brings them to every rank (comm/wire.py pass_head)."""

    def __init__(self, optimizer, model, wire, param_wire=None):
        self.optimizer, self.model, self.wire, self.param_wire = optimizer, model, wire, param_wire

    def __call__(self, lo, hi):
        if self.param_wire is not None:
            self.wire.pass_head(self.param_wire, lo, hi)
        self.optimizer.update(self.model.params, self.model.grads, *self.wire.body_range(lo, hi))


class ClipScale:
    """--clip-norm: once every bucket is summed, the factor from the whole
    gradient's norm, folded into the optimizer's gradient scale."""

    def __init__(self, optimizer, clip, norm, grad_scale):
        self.optimizer, self.clip, self.norm, self.grad_scale = optimizer, clip, norm, grad_scale

    def __call__(self):
        self.optimizer.set_grad_scale(self.clip.scaled(self.norm.partials(), self.grad_scale))


class RingStep:
    """The buffers, model, optimizer and fused allreduce of one ring run.

    spec: the model's spec (nn/spec.py); strategy: the allreduce (comm/);
    comm: the ranks of the strategy (the sharded norm's parts travel there);
    optimizer: (name, keyword arguments of optim.make_optimizer);
    fusion_elems: bucket size in elements (0: one bucket); clip: a
    clipping.Clip or None; marks, overlap, timeline, watchdog: as
    FusedAllreduce takes them; compression: a run/plan.Compression or None
    (the buckets' exchange, comm/compressed_exchange.py; `exchange` is None without)."""

    def __init__(self, spec, strategy, comm, xp, optimizer, fusion_elems, sharded=False, clip=None,
                 marks=None, overlap=True, timeline=None, watchdog=None, accumulate=1, compression=None):
        n = spec.num_params
        self.sharded, self.clip, self.accumulate_steps = sharded, clip, int(accumulate)
        self.grad_scale = 1.0 / (comm.Get_size() * self.accumulate_steps)
        self.wire = Wire(n, xp)
        self.param_wire = Wire(n, xp) if sharded else None
        self.model = spec.build(xp, params=self.param_wire.body if sharded else None, grads=self.wire.body)
        ready_from = self.wire.ready_from(self.model.layer_ranges)
        self.buckets = bucket_bounds(self.wire.size, fusion_elems, ready_from)
        # sharded with --compression on several nodes: hier's node shards (comm/compressed_exchange.py)
        strategy = sharding_for(strategy, compression) if sharded else strategy
        self.strategy = strategy
        owned = [self.wire.body_range(lo, hi) for lo, hi in owned_ranges(strategy, self.buckets)] \
            if sharded else None
        name, kwargs = optimizer
        self.optimizer = make_optimizer(name, n, xp, owned=owned, **kwargs)
        # The norm of the gradient part only (the loss and stop slots ride
        # along), the same bits sharded or not (comm/grad_norm.py).
        self.norm = BucketNorm(strategy, self.buckets, self.wire.buffer, skip=GRADS, sharded=sharded,
                               comm=getattr(strategy, "shard_comm", comm),
                               watchdog=watchdog) if clip else None
        # --compression: the buckets' exchange; PowerSGD's matrices in wire
        # offsets (GRADS on), fp16/bf16's float32 loss and stop slots.
        self.matrices, self.layout_key = powersgd_layout(spec.tensors, compression.rank, compression.min_rate) \
            if compression is not None and compression.kind == "powersgd" else ([], "")
        self.exchange = make_exchange(compression, strategy, self.wire.buffer, self.matrices, offset=GRADS,
                                      exact=GRADS) if compression is not None else None
        # Clipping needs the whole summed gradient's norm, so the updates wait
        # for the last bucket (comm/fusion.py's deferred updates).
        self.fused = FusedAllreduce(
            strategy, self.wire.buffer, ready_from, self.buckets, marks=marks,
            on_reduced=BucketUpdate(self.optimizer, self.model, self.wire, self.param_wire),
            before_updates=ClipScale(self.optimizer, clip, self.norm, self.grad_scale) if clip else None,
            overlap=overlap, timeline=timeline, watchdog=watchdog,
            gather=self.param_wire.buffer if sharded else None, exchange=self.exchange)
        self.layer_done, self.loss_out, self.forward_done = self.fused.layer_done, self.wire.loss, None
        # the model sums a tied tensor's uses itself, but for accumulated steps: layer_done does
        self.combine = self.accumulate_steps == 1
        if self.accumulate_steps > 1:
            # the first K - 1 micro-batches' gradients and losses (nn/accumulate.py)
            self.acc = Accumulation(xp.zeros(n, self.wire.dtype))
            # a tied tensor's later uses, summed apart and combined at the end (nn/tied.py)
            self.acc_extra = Accumulation(xp.zeros_like(self.model.extra))
            self.acc_loss, self.loss_out = Accumulation(xp.zeros(1, self.wire.dtype)), xp.zeros(1, self.wire.dtype)
            self.layer_done, self.forward_done = self._layer_done_accumulated, self._forward_done_accumulated

    def accumulate(self, x, y, noise=None):
        """One of a step's first K - 1 micro-batches: its gradient and loss
        added up here, nothing exchanged."""
        loss = self.model.forward_backward(x, y, noise=noise, combine=False)
        self.acc.add(self.model.grads)
        self.acc_extra.add(self.model.extra)
        self.acc_loss.add(loss)

    def _forward_done_accumulated(self):
        # the last micro-batch's loss is in loss_out: the wire carries the mean of the K
        self.acc_loss.add(self.loss_out)
        self.wire.loss[...] = self.acc_loss.mean()

    def _layer_done_accumulated(self, k):
        model = self.model
        lo, hi = model.layer_ranges[k]
        self.acc.into(model.grads, lo, hi)
        # the last micro-batch ran with combine=False: a tied tensor owned here
        # gets its uses' sums over the step, then their sum (nn/tied.py)
        i = model.spec.param_layers[k]
        for group in model.run.ties.done_by(i):
            self.acc_extra.into(model.extra, *model.run.ties.extra_range(group))
        model.run.combine(i, model.grads, model.extra)
        self.fused.layer_done(k)

    def begin(self, lr, stop, step=0):
        """Before backprop of 0-based `step`: its learning rate, this rank's
        wish to stop, and (--compression powersgd) whether it is compressed."""
        self.wire.set_stop(stop)
        if self.exchange is not None:
            self.exchange.begin(step)
        self.optimizer.begin(lr, self.grad_scale)
        if self.accumulate_steps > 1:
            self.acc.restart()
            self.acc_extra.restart()
            self.acc_loss.restart()

    @property
    def error(self):
        """This rank's PowerSGD error feedback over the model's parameters (a view), or None."""
        error = getattr(self.exchange, "error", None)
        return None if error is None else error[GRADS:]

    def sent_bytes(self):
        """Bytes this rank hands its strategy per step (compressed), or None."""
        if self.exchange is None:
            return None
        return sum(self.exchange.sent_bytes(lo, hi) for lo, hi in self.buckets)

    def wire_overflowed(self, comm, waiting):
        """--compression fp16, after a step whose summed loss was finite:
        whether its parameters are not (the same bits on every rank) though
        every rank's gradient was finite as it went on the wire, i.e. a sum
        past fp16's 65504 became inf in 16 bits. Collective over comm (the
        workers) only when the parameters are not finite; `waiting`: the
        world's deadline for it."""
        if self.exchange is None or self.exchange.kind != "fp16" or all_finite(self.model.params):
            return False
        everyone = np.array([self.exchange.sent_finite], np.int64)
        with waiting("fp16 overflow check (allreduce)"):
            comm.Allreduce(MPI.IN_PLACE, everyone, op=MPI.MIN)
        return bool(everyone[0])

    def summed(self):
        """(loss summed over the ranks, did any rank ask to stop), read from the
        host copy fused.wait() leaves (comm/fusion.py's `head`), never from the
        device: the main thread does not wait for the optimizer's kernels."""
        head = self.fused.head
        return float(head[LOSS]), bool(head[STOP] > 0)

    def close(self):
        self.fused.close()
