"""The parameter store of --zero 3 (nn/store.py's contract): no rank keeps
the whole model's parameters. Each rank holds its shard, the part of
every one of ring mode's buckets its strategy owns (`ParamShard`, in the
sharded optimizer's compact layout, so the optimizer updates it in
place); a bucket's parameters are gathered into a bucket-sized slot just
before its layers run forward, and again before they run backward, and
the slot is reused by a later bucket when they are done.

The slots are nn/grad_slots.GradSlots' (the same cut: the buckets take
the shared slots in turn, one where each gather is done right before
the layers that need it run, two with a prefetch; a bucket that holds a
tied tensor's home a slot of its own, since the GPT's head reads the
embedding at the other end of the model, and so do the small buckets
forward gathers last: `tail_homes`). Backward gathers nothing for the
model's first layer where that layer's backward without dx reads no
parameters (`needs_params_without_dx`, nn/layers.py). Each
layer is bound once to its bucket's slot; the runner (nn/sequential.py)
calls the hooks a layer at a time (`per_layer`), and `_need` gathers the
buckets layer i reads (its own, and the home of a tied tensor it uses)
unless its slot still holds them: the last bucket of a forward is still
there for the first of the backward, which is where FSDP too skips the
gather. A slot's copy is current while the shard's version of
its bucket is the one it was gathered at (ParamShard.changed: the
optimizer's update of bucket j; `forget()`: the initial draw, a resume).

A bucket whose layers all declare `grads_may_overwrite_params` (Linear:
its backward reads W for dx only, and computes dx before dW) has no
gradient slot of its own: its layers' gradient views are views of its
parameters' slot (GradSlots' `over`, `zero3_slots`), each layer writing its
gradient over its own parameters once it has read them, and the bucket's
reduce-scatter and update run there. Once the bucket's last layer in
backward is done, the slot holds no parameters (`grads_done`); a bucket
that backward writes without gathering it (the model's first layer) takes
its slot as the gather would (`_claim`), and the fused allreduce's wait for
the slot's previous bucket (`reuses`) covers the gradient before it. The
MLPs' buckets hold one slot each instead of two (issue 60: 0.41 to 0.34 of
an unsharded rank's peak at N = 4, docs/ring.md).

Who gathers is the caller's (`gather(j, view)`, comm/zero3.py: this
rank's part copied in, the strategy's allgather), so this module needs
no MPI. With overlap (`thread`: comm/fusion.FusedAllreduce) the gathers
run on the communication thread, in order with the buckets'
reduce-scatters, and each is posted one bucket ahead (FSDP's forward and
backward prefetch): when a layer of bucket j runs, the gather of the
bucket after it in this pass (j - 1 forward, j + 1 backward) is posted,
into the other shared slot, so it moves while bucket j computes; in
backward it goes ahead of bucket j's own reduce-scatter. Two shared
slots then, one read and one being filled: at most three buckets of
parameters (with a tied home's) are alive at once.

    mpirun -n 2 python -m mpi4py -m pytest --only-mpi tests/test_zero3.py
"""
import numpy as np

from .grad_slots import GradSlots, bucket_finder, slot_elements


class ParamShard:
    """This rank's parts of the model's parameters: `owned[j]` (lo, hi),
    model offsets, of bucket j (buckets: ring mode's, [(lo, hi)]), laid
    one after another in buffer order in `buf` (the sharded optimizer's
    compact layout: optim/sharded.Sharded)."""

    def __init__(self, buckets, owned, xp, dtype):
        self.buckets, self.owned = list(buckets), [(int(a), int(b)) for a, b in owned]
        order = sorted(range(len(self.owned)), key=lambda j: self.owned[j][0])
        self.offset, c = [0] * len(self.owned), 0
        for j in order:
            self.offset[j] = c
            c += self.owned[j][1] - self.owned[j][0]
        self.size, self.xp = c, xp
        self.buf = xp.zeros(c, dtype)
        self.version = [0] * len(self.owned)   # bumped as bucket j's part changes (`changed`)

    def changed(self, j):
        """Bucket j's part was written (the optimizer's update): gathered copies of it are old."""
        self.version[j] += 1

    def changed_all(self):
        for j in range(len(self.version)):
            self.version[j] += 1

    @property
    def ranges(self):
        """The owned ranges, sorted, non-empty (what Sharded takes as `owned`)."""
        return sorted(r for r in self.owned if r[1] > r[0])

    def part(self, j):
        """Bucket j's owned part in the shard (a view)."""
        a, b = self.owned[j]
        return self.buf[self.offset[j]:self.offset[j] + b - a]


class ShardedStore:
    """Layers bound to `slots` (GradSlots over the parameters: views of the
    bucket slots), gradients to `grads` (GradSlots, --zero 2's), the state
    in its own flat buffer; the parameters themselves in `shard`.
    gather(j, view): fills `view`, bucket j's slot, with its parameters."""
    per_layer = True   # the runner calls the hooks one layer at a time

    def __init__(self, spec, slots, grads, state, shard, gather, base=(0, 0)):
        self.spec, self.params, self.grads, self.state, self.shard = spec, slots, grads, state, shard
        self.gather, self.base = gather, tuple(base)
        self.resident = [None] * len(slots.slots)   # slot -> (bucket, shard version) its parameters are
        # with a communication thread (comm/fusion.FusedAllreduce, `thread`): the gathers run
        # there, and each layer's next bucket is posted ahead (prefetch); slot -> (bucket, version) posted
        self.thread, self.pending = None, {}
        self.gathers = self.posted = 0   # buckets gathered, and of them posted to a thread (tests count them)
        # layer i -> the buckets it reads: its own (`own`, None without tensors), a tied tensor's home
        self.own = own_buckets(spec, slots.bucket_at)
        self.reads = [[] if j is None else [j] for j in self.own]
        for t in spec.ties:
            j = slots.bucket_at(t.lo)
            if j not in self.reads[t.user]:
                self.reads[t.user].append(j)
        # backward: the model's first layer with parameters runs it without dx (nn/sequential.py), and
        # one that needs no parameters for that (Linear, Conv2d, Embedding: needs_params_without_dx)
        # reads none: its bucket is not gathered again for it, nor prefetched, unless a later layer's
        # backward reads it (an MLP's first layer: a bucket's gather fewer each step)
        self.back_reads = [list(r) for r in self.reads]
        if spec.param_layers and not spec.layers[spec.param_layers[0]].needs_params_without_dx:
            self.back_reads[spec.param_layers[0]] = []
        self.back_needed = {j for r in self.back_reads for j in r}
        # the buckets whose gradient is written over their parameters (grads.over): bucket -> the layer whose
        # backward finishes it (its lowest), after which its slot holds no parameters
        self.last_writer = {}
        for i in spec.param_layers:
            if self.own[i] in grads.over and self.own[i] not in self.last_writer:
                self.last_writer[self.own[i]] = i

    def views(self, i):
        spec = self.spec
        return (spec.views(self.params, i), spec.views(self.grads, i),
                spec.views(self.state, i, of="state", base=self.base[1]))

    def _need(self, a, b, ahead, reads, needed=None):
        """Layers [a, b) run next: the buckets they read (`reads[i]`) gathered;
        then the bucket `ahead` of each one's own (its neighbour in this
        pass's order) posted, if this pass reads it (`needed`; None: every
        bucket) (not of a tied home: the GPT's head reads the embedding's, at
        the other end of the pass)."""
        for i in range(a, b):
            for j in reads[i]:
                self.ensure(j)
            if self.thread is not None and self.own[i] is not None and reads[i]:
                k = self.own[i] + ahead
                if needed is None or k in needed:
                    self._prefetch(k, reads[i])

    def ensure(self, j):
        """Bucket j's parameters in its slot (gathered unless they are there)."""
        slot, now = self.params.slot_of[j], (j, self.shard.version[j])
        if self.resident[slot] == now:
            return
        if self.pending.get(slot) is not None:
            self._collect(self.pending[slot][0])   # whatever was posted there is done first
            if self.resident[slot] == now:
                return
        self.resident[slot] = None   # half-gathered is not there
        if self.thread is None:
            self._gather(j, slot)
            self.resident[slot] = now
        else:
            self._post(j, slot, now)
            self._collect(j)

    def _gather(self, j, slot):
        lo, hi = self.params.buckets[j]
        self.gather(j, self.params.slots[slot][:hi - lo])
        self.gathers += 1

    def _post(self, j, slot, now):
        self.pending[slot] = now
        self.posted += 1
        self.thread.post(j, lambda: self._gather(j, slot))

    def _collect(self, j):
        for k in self.thread.collect(j):
            slot = self.params.slot_of[k]
            self.resident[slot] = self.pending.pop(slot)

    def _prefetch(self, k, reading):
        """Post bucket k's gather where its slot is not one the running layer reads."""
        if not 0 <= k < len(self.params.buckets):
            return
        slot, now = self.params.slot_of[k], (k, self.shard.version[k])
        if self.resident[slot] == now or slot in self.pending or \
                any(self.params.slot_of[j] == slot for j in reading):
            return
        self.resident[slot] = None
        self._post(k, slot, now)

    def before_forward(self, a, b):
        self._need(a, b, -1, self.reads)   # forward runs from the last bucket (the model's start) to bucket 0

    def after_forward(self, a, b):
        """Nothing: a slot is reused when a later bucket needs it."""

    def before_backward(self, a, b):
        self._need(a, b, +1, self.back_reads, self.back_needed)
        for i in range(a, b):
            if self.own[i] in self.last_writer and not self.back_reads[i]:
                self._claim(self.own[i])

    def _claim(self, j):
        """Bucket j's gradient is about to be written in its parameters' slot
        without a gather: whatever was posted there done first, and the slot
        no longer holds what it held."""
        slot = self.params.slot_of[j]
        if self.pending.get(slot) is not None:
            self._collect(self.pending[slot][0])
        self.resident[slot] = None

    def grads_done(self, a, b):
        """A bucket whose gradient is written over its parameters, once its
        last layer is done: its slot holds the gradient (the fused allreduce
        takes each bucket: comm/fusion.py)."""
        for i in range(a, b):
            j = self.own[i]
            if self.last_writer.get(j) == i:
                self.resident[self.params.slot_of[j]] = None

    def forget(self):
        """Every slot stale (the shard was written whole: the initial draw, a resume)."""
        self.shard.changed_all()

    def init_pieces(self, dtype):
        """The initial draw a bucket at a time (nn/sequential.LayerRange.init):
        (lo, hi, a host buffer for model range [lo, hi), put(host)), buffer
        order; put keeps this rank's part of it."""
        shard = self.shard
        for j in sorted(range(len(shard.buckets)), key=lambda j: shard.buckets[j][0]):
            lo, hi = shard.buckets[j]

            def put(host, j=j, lo=lo):
                a, b = shard.owned[j]
                shard.part(j)[...] = shard.xp.asarray(host[a - lo:b - lo])
            yield lo, hi, np.zeros(hi - lo, dtype), put
        self.forget()


SMALL_TAIL = 8   # the buckets forward gathers last keep slots of their own while together <= 1/8 of the largest


def tail_homes(buckets):
    """The buckets forward gathers last (0, 1, ...: the model's end, a
    classifier's small head) while together at most 1/SMALL_TAIL of the
    largest bucket: slots of their own, so the shared slot still holds the
    bucket forward gathered before them when backward starts there, and
    backward gathers that one (the largest kind) no more, for at most 1/8
    of a slot. (An MLP of 1024 x 1024 at 4 MiB buckets: its 10,250-element
    head's bucket alone; backward then gathers nothing.)"""
    largest, total, out = max(hi - lo for lo, hi in buckets), 0, []
    for lo, hi in buckets:
        total += hi - lo
        if total * SMALL_TAIL > largest:
            break
        out.append((lo, hi))
    return out


def own_buckets(spec, bucket_at):
    """Layer i -> the index of the bucket its tensors are in (a layer's
    tensors lie in one bucket: a bucket never splits a layer), None for a
    layer without tensors; bucket_at: offset -> bucket (grad_slots.bucket_finder)."""
    return [bucket_at(entries[0][2]) if entries and entries[-1][3] > entries[0][2] else None
            for entries in spec.layer_tensors]


def grads_over_params(spec, buckets):
    """The indices of the `buckets` whose gradient may be written over their
    parameters: every layer with tensors there declares
    grads_may_overwrite_params, and no tied tensor is read there or lives
    there (the head reads the embedding's at the other end of the pass)."""
    bucket_at = bucket_finder(buckets)
    own = own_buckets(spec, bucket_at)
    tied, ok = set(), {}
    for t in spec.ties:
        tied |= {bucket_at(t.lo), own[t.user]}
    for i, j in enumerate(own):
        if j is not None:
            ok[j] = ok.get(j, True) and spec.layers[i].grads_may_overwrite_params
    return {j for j, fine in ok.items() if fine and j not in tied}


def zero3_slots(spec, buckets, xp, dtype, shared=1):
    """(the parameters' slots, the gradient's) of --zero 3 over ring mode's
    `buckets`: the parameters' `shared` the buckets take in turn (one while
    each gather is done before its layers run; a prefetch needs a second),
    one per tied home's bucket and per small bucket of the tail
    (tail_homes); the gradient's the same but for the buckets it is written
    over the parameters in (grads_over_params), which have none."""
    n, homes = spec.num_params, [(t.lo, t.hi) for t in spec.ties]
    params = GradSlots(n, buckets, xp, dtype, homes=[*homes, *tail_homes(buckets)], shared=shared)
    return params, GradSlots(n, buckets, xp, dtype, homes=homes, shared=shared,
                             over=(params, grads_over_params(spec, buckets)))


def zero3_slot_elements(spec, buckets, shared=1):
    """Elements (the gradient's, the parameters') the slots of zero3_slots
    hold for a model `spec` over `buckets` (the start-up memory check's count)."""
    return (slot_elements(spec, buckets, shared, over=grads_over_params(spec, buckets)),
            slot_elements(spec, buckets, shared, extra=tail_homes(buckets)))
