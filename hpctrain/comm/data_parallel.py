"""One data-parallel update: the replicas' average of a gradient and the
optimizer's step on it, the same object for ring mode (loops/ring_step.py)
and for every pipeline stage (pipeline/engine.py). ps mode keeps its own
servers (comm/ps/).

What it owns, per step:
- the buckets: ring mode's, a pure function of the layer boundaries and
  --fusion-mb (`model_buckets`), cut to each part's slice (`cut`), so a
  pipeline stage's replicas sum in ring mode's order;
- the allreduce strategy: each bucket allreduced, or with --zero 1
  (--shard-optimizer on) reduce-scattered, this rank's part updated and the
  parameters allgathered (`reduce`, `update`, `gather`); with --zero 2 the
  gradient too is sharded: the buckets live in a few slots
  (nn/grad_slots.py) and each reduce-scatter leaves this rank's part in
  the slot, where the optimizer reads it (`Summed`), or with --clip-norm
  in its compact gradient shard (`GradShard`), which the norm and then the
  optimizer read: the same sums, the same update, the same bits as stage 1;
  with --zero 3 the optimizer updates the parameters' shard in place
  (nn/sharded_store.ParamShard) and nothing is allgathered after it: the
  store gathers each bucket when its layers run;
- the compression exchange (comm/compressed_exchange.py), through which a
  bucket is summed instead of the strategy's own allreduce;
- the optimizer of each part, its state sized by what this rank updates;
- --clip-norm: the one gradient norm over every part (comm/grad_norm.py),
  its factor folded into every optimizer's gradient scale (`clip_scale`).

A part is a pair of flat buffers, parameters and gradients: the whole
model's in ring mode, a chunk's slice in a pipeline (one, or V with the
interleaved schedule). Ring mode drives its one part bucket by bucket from
comm/fusion.py's communication thread, as backprop finishes each; a
pipeline stage calls `reduce_all`, `update_all`, `gather_all` after its
last backward. Either way the sums, the norm and the per-element update
are the same, so a pipeline ends with `--accumulate-steps M`'s parameters
and a sharded run with an unsharded one's, bit for bit.

    mpirun -n 4 python -m hpctrain.train --steps 200 --zero 1 --clip-norm 1
    mpirun -n 4 python -m hpctrain.train --steps 200 --zero 2 --clip-norm 1
    mpirun -n 4 python -m hpctrain.train --steps 200 --zero 3 --clip-norm 1
    mpirun -n 4 python -m hpctrain.train --pipeline-stages 2 --micro-batches 4 --clip-norm 1 --shard-optimizer on
"""
from ..base.chunks import chunk_parts
from ..optim.optimizers import make_optimizer
from .fusion import bucket_bounds, ready_from
from .grad_norm import GradNorm, part_ranges


def model_buckets(layer_ranges, num_params, fusion_elems):
    """Ring mode's buckets [(lo, hi)] of the whole model's gradient buffer, in
    the order they become ready: ending on layer starts, fused up to
    fusion_elems elements (comm/fusion.bucket_bounds)."""
    return bucket_bounds(num_params, fusion_elems, ready_from(layer_ranges))


def cut(buckets, lo, hi):
    """Each bucket's part inside model range [lo, hi), relative to lo; empty ones left out."""
    return [(max(a, lo) - lo, min(b, hi) - lo) for a, b in buckets if max(a, lo) < min(b, hi)]


class Part:
    """One pair of flat buffers the update runs over, at offset `lo` of the
    model's (0 in ring mode), the model's chunk `chunk` (0 in ring mode):
    its buckets and the ranges of them this rank updates (buffer
    coordinates), its optimizer and its exchange (None: the strategy);
    with --zero 2 `grads` is the model's nn/grad_slots.GradSlots and
    `shard` this rank's summed part of it (GradShard; with --clip-norm
    only, else None: each part is updated from its slot); with --zero 3
    `param_shard` the parameters' (nn/sharded_store.ParamShard), which the
    optimizer updates in place, and `params` their slots."""
    __slots__ = ("params", "grads", "lo", "chunk", "buckets", "owned", "optimizer", "exchange", "shard",
                 "param_shard")

    def __init__(self, params, grads, lo=0, chunk=0, exchange=None, param_shard=None):
        self.params, self.grads, self.lo, self.chunk, self.exchange = params, grads, lo, chunk, exchange
        self.param_shard = param_shard   # --zero 3: the parameters' ParamShard (params: its slots)
        self.buckets = self.owned = self.optimizer = self.shard = None


class GradShard:
    """--zero 2: this rank's part of the summed gradient, in its sharded
    optimizer's compact layout (the owned ranges one after another, 1/N of
    the model); `[lo:hi]` of an owned range (buffer coordinates) is its
    view there, as the norm's pieces read it."""

    def __init__(self, optimizer, xp, dtype):
        self.optimizer = optimizer
        self.buf = xp.zeros(optimizer.size, dtype)

    def __getitem__(self, key):
        c = self.optimizer.compact_offset(key.start, key.stop)
        return self.buf[c:c + key.stop - key.start]


class Summed:
    """--zero 2 and 3 without --clip-norm: a bucket's summed part where the
    reduce-scatter left it, in its slot, indexed as the sharded optimizer's
    compact layout would hold it (`[c + x:c + y]` is `view[x:y]`, c its
    compact offset): the optimizer reads it there, no 1/N copy of the
    gradient is kept."""

    def __init__(self, view, offset):
        self.view, self.offset = view, offset

    def __getitem__(self, key):
        return self.view[key.start - self.offset:key.stop - self.offset]


class NormScope:
    """Where the clip norm's pieces are added (comm/grad_norm.GradNorm):
    comm (None: this rank holds every part), how many chunks the model is
    cut into, how many replicas hold pieces of one chunk's parts and this
    rank's index among them, and the watchdog of the collective."""

    def __init__(self, comm=None, chunks=1, replicas=1, replica=0, watchdog=None, tensor=None):
        self.comm, self.chunks, self.replicas, self.replica, self.watchdog = comm, chunks, replicas, replica, watchdog
        self.tensor = tensor   # --tensor-parallel: a comm/grad_norm.TensorNorm


class DataParallelUpdate:
    """parts: [Part]; buckets: model_buckets(...), the whole model's; strategy:
    the replicas' allreduce (comm/; None for one replica: nothing to sum);
    optimizer: (name, keyword arguments of optim.make_optimizer); xp: the
    array module; grad_scale: what turns the summed gradient into the mean
    (1 / (replicas x micro-batches)); zero: the ZeRO stage (run/plan.Ring.zero;
    with a strategy): 1 and up sharded (each replica updates its part of
    each bucket), 2 and up each part's grads a GradSlots; clip:
    an optim.clipping.Clip or None; scope: a NormScope (with clip)."""

    def __init__(self, parts, buckets, strategy, optimizer, xp, grad_scale, zero=0, clip=None, scope=None):
        self.parts, self.strategy, self.grad_scale = parts, strategy, grad_scale
        self.sharded = zero >= 1 and strategy is not None
        self.shard_grads = self.sharded and zero >= 2
        name, kwargs = optimizer
        for p in parts:
            p.buckets = cut(buckets, p.lo, p.lo + p.grads.size)
            p.owned = [self._owned(lo, hi) for lo, hi in p.buckets]
            # at: the part's slice of the model, where the model's weight-decay ranges fall in it
            p.optimizer = make_optimizer(name, p.grads.size, xp, owned=p.owned if self.sharded else None,
                                         at=[(p.lo, p.lo + p.grads.size)], **kwargs)
            if self.shard_grads and clip is not None:
                # the summed parts kept until every bucket is summed: the clip norm reads them all;
                # without it each bucket is updated right after its sum, from its slot (`_summed`)
                p.shard = GradShard(p.optimizer, xp, p.grads.dtype)
            if p.param_shard is not None and p.param_shard.ranges != p.optimizer.ranges:
                raise ValueError("--zero 3: the parameter shard and the optimizer own different ranges")
        self.clip = clip
        self.norm = self._norm(buckets, scope or NormScope()) if clip is not None else None
        self._summed = {}   # (part, bucket) -> its summed part in its slot, without a GradShard, until updated

    def _owned(self, lo, hi):
        """What this rank updates of bucket [lo, hi) (buffer coordinates): its shard, or all of it."""
        if not self.sharded:
            return lo, hi
        a, b = self.strategy.shard(hi - lo)
        return lo + a, lo + b

    def _norm(self, buckets, scope):
        # ring mode's parts: its buckets cut by its strategy (one rank's strategy is one part);
        # each rank sums what it holds summed: its part (sharded), else everything on replica 0
        parts = self.strategy.parts if self.strategy is not None else (lambda n: chunk_parts(n, 1))
        held = [(p.chunk, p.lo, p.owned if self.sharded else [(0, p.grads.size)] if scope.replica == 0 else [])
                for p in self.parts]
        return GradNorm(part_ranges(buckets, parts), held, scope.chunks, scope.replicas, scope.replica,
                        scope.comm, scope.watchdog, scope.tensor)

    @property
    def optimizers(self):
        return [p.optimizer for p in self.parts]

    @property
    def deferred(self):
        """With --clip-norm no bucket is updated before every bucket is summed and clip_scale() ran."""
        return self.clip is not None

    def begin(self, lr, step=0):
        """Before 0-based `step`'s backprop: its learning rate, and (--compression
        powersgd) whether it is compressed."""
        for p in self.parts:
            p.optimizer.begin(lr, self.grad_scale)
            if p.exchange is not None:
                p.exchange.begin(step)

    # --- one bucket: k the part, i the bucket ---------------------------------------

    def reduce(self, k, i):
        """Sum bucket i of part k over the replicas (sharded: this rank's part of it)."""
        p, strategy = self.parts[k], self.strategy
        lo, hi = p.buckets[i]
        if strategy is None:
            return
        if self.shard_grads:
            # the bucket's slot is free again once its part is in the shard, or (no shard) updated:
            # the fused allreduce runs update(k, i) straight after, before any layer writes the slot again
            bucket = p.grads[lo:hi]
            a, b = p.exchange.reduce_scatter(lo, hi) if p.exchange is not None else strategy.reduce_scatter(bucket)
            if a < b and p.shard is None:
                self._summed[k, i] = Summed(bucket[a:b], p.optimizer.compact_offset(lo + a, lo + b))
            elif a < b:
                p.shard[lo + a:lo + b][...] = bucket[a:b]
        elif self.sharded:
            p.exchange.reduce_scatter(lo, hi) if p.exchange is not None else strategy.reduce_scatter(p.grads[lo:hi])
        elif p.exchange is not None:
            p.exchange.allreduce(lo, hi)
        else:
            strategy.allreduce(p.grads[lo:hi])

    def update(self, k, i):
        """The optimizer on what this rank updates of bucket i of part k."""
        p = self.parts[k]
        lo, hi = p.owned[i]
        summed = self._summed.pop((k, i), None) if self.shard_grads else None
        if lo < hi:
            if self.shard_grads:
                grads = p.shard.buf if p.shard is not None else summed
                if p.param_shard is not None:
                    p.optimizer.update_compact(p.param_shard.buf, grads, lo, hi, shard=True)
                    p.param_shard.changed(i)   # a slot's gathered copy of bucket i is old now
                else:
                    p.optimizer.update_compact(p.params, grads, lo, hi)
            else:
                p.optimizer.update(p.params, p.grads, lo, hi)

    def gather(self, k, i):
        """Sharded: every replica's updated part of bucket i of part k to every
        replica (--zero 3: none; the store gathers a bucket when its layers run)."""
        if self.sharded and self.parts[k].param_shard is None:
            lo, hi = self.parts[k].buckets[i]
            self.strategy.allgather(self.parts[k].params[lo:hi])

    def sent_bytes(self, k, i):
        """Bytes of bucket i of part k this rank hands its strategy (compressed or not)."""
        p = self.parts[k]
        lo, hi = p.buckets[i]
        return p.exchange.sent_bytes(lo, hi) if p.exchange is not None else (hi - lo) * p.grads.itemsize

    def clip_scale(self):
        """--clip-norm, once every bucket of every part is summed: the factor
        of the one norm, folded into every optimizer's gradient scale."""
        held = [p.grads if p.shard is None else p.shard for p in self.parts]
        scale = self.clip.scaled(self.norm.partials(held), self.grad_scale)
        for p in self.parts:
            p.optimizer.set_grad_scale(scale)

    # --- every bucket, one after another (a pipeline stage) ------------------------------

    def reduce_all(self):
        for k, p in enumerate(self.parts):
            for i in range(len(p.buckets)):
                self.reduce(k, i)

    def update_all(self):
        """The clip factor (--clip-norm), then every bucket's update."""
        if self.deferred:
            self.clip_scale()
        for k, p in enumerate(self.parts):
            for i in range(len(p.buckets)):
                self.update(k, i)

    def gather_all(self):
        for k, p in enumerate(self.parts):
            for i in range(len(p.buckets)):
                self.gather(k, i)
