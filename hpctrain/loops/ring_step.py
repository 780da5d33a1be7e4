"""One ring-mode step's machinery, built top to bottom, each piece from the
ones before it:

1. the model, over its flat parameter and gradient buffers (the buckets
   exchange the gradients only; sharded, each bucket's allgather carries
   the parameters);
2. the step's gradient over its micro-batches, its loss and stop flag (their
   own small allreduce): comm/step_gradient.py;
3. with --compression, the buckets' exchange (comm/compressed_exchange.py);
4. the data-parallel update (comm/data_parallel.py), the one a pipeline
   stage runs too: ring mode's buckets (a pure function of the layer
   boundaries and --fusion-mb), the strategy's allreduce (sharded:
   reduce-scatter, this rank's part updated, allgather), the optimizer
   (its state sized by what this rank updates: sharded ~1/N), the one
   gradient norm and clip factor with --clip-norm;
5. the fused allreduce (comm/fusion.py), which sums each bucket as
   backprop finishes it and then runs the update on it, as Horovod's hooks
   start reductions and `step()` waits.

Per step the loop calls `begin(lr, stop)`, the trainer's (the model's, or
with --thread-split samples its slices': nn/sample_split.py)
`forward_backward(..., on_layer_done=step.layer_done, loss_out=step.loss_out,
on_forward_done=step.forward_done, combine=step.combine)`, `step.fused.wait()`, then reads
`summed()`: the loss summed over the ranks and whether any rank asked to
stop, the same bits everywhere (their allreduce starts at forward_done and
runs beside backprop and the buckets).

With --accumulate-steps K, the first K - 1 micro-batches of a step go
through `accumulate(x, y, noise)` (no exchange: Horovod's
backward_passes_per_step, DDP's no_sync), and the last one as above: as each
layer's gradient is done its accumulated part is added in before its bucket
starts, the loss summed over the ranks is the mean of each rank's K losses, and the optimizer's
gradient scale is 1/(workers x K): one step over K x B samples.

With --compression (comm/compressed_exchange.py) each bucket is exchanged compressed
(`exchange`): fp16/bf16 as 16-bit words, PowerSGD as low-rank factors with
this rank's error feedback; the optimizer and the norm see the
decompressed sum as they see today's.

    mpirun -n 4 python -m hpctrain.train --steps 200 --zero 2 --clip-norm 1
    mpirun -n 4 python -m hpctrain.train --steps 200 --compression powersgd --powersgd-start 20
"""
from ..comm.compressed_exchange import make_exchange, sharding_for
from ..comm.data_parallel import DataParallelUpdate, NormScope, Part, model_buckets
from ..comm.fusion import FusedAllreduce, overlaps, ready_from
from ..comm.step_gradient import StepGradient, wire_overflowed
from ..base import device
from ..comm.zero3 import Gatherer
from ..nn.grad_slots import OVERLAPPED, GradSlots
from ..nn.sample_split import SampleSplit
from ..nn.sharded_store import ParamShard, ShardedStore, zero3_slots
from ..optim.compression_math import powersgd_layout
from ..base.precision import FLOAT32


class RingStep:
    """The model, loss and stop, update and fused allreduce of one ring run.

    spec: the model's spec (nn/spec.py); strategy: the allreduce (comm/);
    comm: the ranks of the strategy (the loss and stop flag's allreduce, and
    the sharded norm's pieces, travel there);
    optimizer: (name, keyword arguments of optim.make_optimizer);
    fusion_elems: bucket size in elements (0: one bucket); clip: a
    clipping.Clip or None; marks, overlap, timeline, watchdog: as
    FusedAllreduce takes them (the watchdog: the collectives' deadline);
    compression: a run/plan.Compression or None (the buckets' exchange,
    comm/compressed_exchange.py; `exchange` is None without); dtype: the
    model's buffers' (the plan's precision.params); zero: the ZeRO stage,
    0-3 (the plan's ring.zero): 1 the optimizer over this rank's part of
    each bucket; 2 the gradient too (the model built over
    nn/grad_slots.GradSlots, each bucket's part summed and updated (with --clip-norm kept in this rank's shard) as
    backprop finishes it, and with --accumulate-steps the first
    micro-batches added a layer at a time); 3 the parameters too (the model
    built over nn/sharded_store.ShardedStore, each bucket gathered as its
    layers run, on the communication thread one bucket ahead with overlap).
    --tensor-parallel: `tensor` (comm/grad_norm.TensorNorm: the clip norm's
    pieces added over the tensor axis too) and `everyone` (the loss and stop
    flag summed over every rank, not one tensor rank's replicas: a rank
    that stops alone would leave its tensor group waiting mid-layer).
    slices: --thread-split samples' slices (1: the model runs each batch
    whole; more: `trainer` is nn/sample_split.SampleSplit, --zero 0 or 1)."""

    def __init__(self, spec, strategy, comm, xp, optimizer, fusion_elems, zero=0, clip=None,
                 marks=None, overlap=True, timeline=None, watchdog=None, accumulate=1, compression=None,
                 dtype=FLOAT32.params, tensor=None, everyone=None, slices=1):
        n = spec.num_params
        self.zero, self.clip, self.accumulate_steps = int(zero), clip, int(accumulate)
        self.sharded = sharded = self.zero >= 1   # the optimizer over this rank's part of each bucket
        buckets = model_buckets(spec.layer_ranges, n, fusion_elems)
        # sharded with --compression on several nodes: hier's node shards (comm/compressed_exchange.py)
        strategy = sharding_for(strategy, compression) if sharded else strategy
        self.strategy, self.store, param_shard = strategy, None, None
        if self.zero == 3:
            if compression is not None and compression.kind == "powersgd":
                raise ValueError("--zero 3 does not take --compression powersgd")   # cli.py refuses it in one line
            # --zero 3: the parameters in shards, each bucket gathered into a slot as its layers run
            # (nn/sharded_store.py); with overlap the gathers go on the buckets' thread, one ahead
            # (a Linear bucket's gradient written over its gathered parameters: one slot for both)
            shared = OVERLAPPED if overlaps(overlap, buckets, strategy) else 1
            param_shard = ParamShard(buckets, [_offset(lo, strategy.shard(hi - lo)) for lo, hi in buckets], xp,
                                     dtype)
            self.store = ShardedStore(spec, *zero3_slots(spec, buckets, xp, dtype, shared),
                                      xp.zeros(spec.num_state, dtype), param_shard,
                                      Gatherer(strategy, param_shard, xp, timeline))
            self.model = spec.build_on(self.store, xp, dtype)
        elif self.zero == 2:
            if compression is not None and compression.kind == "powersgd":
                raise ValueError("--zero 2 does not take --compression powersgd")   # cli.py refuses it in one line
            # --zero 2: no full-length gradient, each bucket's in a slot (nn/grad_slots.py);
            # a second slot where the communication thread sums one bucket while backprop writes the next
            shared = OVERLAPPED if overlaps(overlap, buckets, strategy) else 1
            self.model = spec.build(xp, dtype=dtype, grads=GradSlots(n, buckets, xp, dtype, shared=shared,
                                                                     homes=[(t.lo, t.hi) for t in spec.ties]))
        else:
            self.model = spec.build(xp, dtype=dtype)
        # what runs a (micro-)batch forward and backward: the model, or with --thread-split samples
        # its slices on the compute threads, summed into the model's gradient (nn/sample_split.py)
        self.trainer = SampleSplit(spec, self.model, slices, xp) if slices > 1 else self.model
        grads = self.model.grads   # the buckets' buffer: the gradients only
        self.everyone = everyone if everyone is not None and everyone is not comm else None
        # --compression: the buckets' exchange; PowerSGD's matrices in gradient offsets
        self.matrices, self.layout_key = powersgd_layout(spec.tensors, compression.rank, compression.min_rate) \
            if compression is not None and compression.kind == "powersgd" else ([], "")
        self.exchange = make_exchange(compression, strategy, grads, self.matrices) \
            if compression is not None else None
        # sharded, the norm's pieces are every rank's part: summed over the ranks holding them
        shards = getattr(strategy, "shard_comm", comm)
        scope = NormScope(shards, replicas=shards.Get_size(), replica=shards.Get_rank(), watchdog=watchdog,
                          tensor=tensor) if sharded else NormScope(watchdog=watchdog, tensor=tensor)
        self.update = DataParallelUpdate(
            [Part(self.model.params, grads, exchange=self.exchange, param_shard=param_shard)],
            buckets, strategy, optimizer, xp, 1.0 / (comm.Get_size() * self.accumulate_steps), zero=self.zero,
            clip=clip, scope=scope)
        self.optimizer, self.buckets = self.update.parts[0].optimizer, self.update.parts[0].buckets
        self.fused = FusedAllreduce(self.update, ready_from(self.model.layer_ranges), marks=marks, overlap=overlap,
                                    timeline=timeline, watchdog=watchdog)
        self.layer_done, self.forward_done = self.fused.layer_done, self._forward_done
        if self.store is not None and self.fused.overlap:
            self.store.thread = self.fused   # --zero 3: the gathers on the communication thread
        self.loss_out = xp.zeros(1, grads.dtype)   # forward_backward writes the loss there
        # the model sums a tied tensor's uses itself, but for accumulated steps: layer_done does
        self.combine = self.accumulate_steps == 1
        # the first K - 1 micro-batches' gradients, tied uses and losses summed apart (comm/step_gradient.py);
        # the loss and stop flag summed over every rank of the run
        self.gradient = StepGradient(xp, grads.dtype, [(xp.zeros(n, grads.dtype), self.model.extra)]
                                     if self.accumulate_steps > 1 else (),
                                     everyone or comm, device.copier(xp), watchdog)
        if self.accumulate_steps > 1:
            self.layer_done, self.forward_done = self._layer_done_accumulated, self._forward_done_accumulated

    @property
    def param_shard(self):
        """--zero 3: this rank's ParamShard (the parameters), else None."""
        return None if self.store is None else self.store.shard

    def accumulate(self, x, y, noise=None):
        """One of a step's first K - 1 micro-batches: its gradient and loss
        added up here, nothing exchanged."""
        model, gradient = self.model, self.gradient
        if self.zero >= 2:   # the slots hold a bucket at a time: each layer added as it is done
            def add_layer(k):
                lo, hi = model.layer_ranges[k]
                gradient.add_range(model.grads[lo:hi], lo, hi)
            loss = self.trainer.forward_backward(x, y, noise=noise, combine=False, on_layer_done=add_layer)
            gradient.add(None, model.extra, loss)
        else:
            loss = self.trainer.forward_backward(x, y, noise=noise, combine=False)
            gradient.add(model.grads, model.extra, loss)

    def _forward_done(self):
        self.gradient.loss_ready(self.loss_out)

    def _forward_done_accumulated(self):
        # the last micro-batch's loss is in loss_out: the ranks sum the mean of the K
        self.gradient.add_loss(self.loss_out)
        self.loss_out[...] = self.gradient.loss_mean()
        self.gradient.loss_ready(self.loss_out)

    def _layer_done_accumulated(self, k):
        # the last micro-batch ran with combine=False: the step's sums go in before the bucket starts
        model = self.model
        self.gradient.layer_done(model.run, model.spec.param_layers[k], model.grads, model.extra,
                                 *model.layer_ranges[k])
        self.fused.layer_done(k)

    def begin(self, lr, stop, step=0):
        """Before backprop of 0-based `step`: its learning rate, this rank's
        wish to stop, and (--compression powersgd) whether it is compressed."""
        self.gradient.begin(stop)
        self.update.begin(lr, step)

    @property
    def error(self):
        """This rank's PowerSGD error feedback over the model's parameters (a view), or None."""
        return getattr(self.exchange, "error", None)

    def sent_bytes(self):
        """Bytes this rank hands its strategy per step (compressed), or None."""
        if self.exchange is None:
            return None
        return sum(self.exchange.sent_bytes(lo, hi) for lo, hi in self.buckets)

    def wire_overflowed(self, comm, waiting):
        """--compression fp16, after a step whose summed loss was finite:
        whether its 16-bit sum overflowed (comm/step_gradient.wire_overflowed;
        comm: the workers, `waiting`: the world's deadline). --zero 3: each
        rank sees its shard only; --tensor-parallel: its slice, and every
        rank of the run must answer alike."""
        params = self.store.shard.buf if self.store is not None else self.model.params
        return wire_overflowed([params], self.exchange, self.everyone or comm, waiting,
                               replicated=self.store is None and self.everyone is None)

    def summed(self):
        """(loss summed over the ranks, did any rank ask to stop), after
        fused.wait(): their own allreduce (comm/step_gradient.py), never a
        wait for the optimizer's kernels on the device."""
        return self.gradient.summed()

    def close(self):
        if self.store is not None:
            self.store.thread = None   # later gathers (the final evaluation, --save) on this thread
        self.fused.close()


def _offset(lo, part):
    """A bucket's owned part (a, b) at the bucket's model offset lo."""
    return lo + part[0], lo + part[1]
