"""DistributedOptimizer for NumPy loops, broadcast_parameters and
broadcast_optimizer_state: Horovod's optimizer lines over hpctrain's fused
buckets.

The gradients (a list, or a dict name -> array, fixed shapes) are laid out
one after another in one flat buffer per dtype, cut into buckets of about
`fusion_mb` MiB that end on tensor starts, in the order backward finishes
them (from the last tensor to the first): comm/fusion.bucket_bounds, the
program's own cut (comm/data_parallel.model_buckets), so a model whose
gradients are laid out as the program lays out its layers is summed in the
same buckets, by the same ring, to the same bits. Where the gradients are
already consecutive views of one buffer (`flat_like` makes such a set),
that buffer is summed in place: no copy in, no copy out.

From the user's backward, `ready(i)` (i: the index or name) says tensor i
is final: a bucket is handed to the engine's thread (engine.py) as soon as
every tensor from its start to the end is ready, and is summed there while
backward goes on; `synchronize()` waits for the rest and writes the
averages back into the gradient arrays. Or, with no overlap, one call:
`allreduce_gradients()`. Where the ranks nap (more ranks than cores,
runtime.py's `wait_mode`), the buckets are handed over together, in the
same order, once the last tensor of their buffer is ready, and a first
bucket's smaller cut (`first_bucket_mb`, the torch optimizer's), which
exists only to start early, is not made: the cores have no idle time for
the overlap to fill, and a bucket started during backward only has the engine's thread
wait for the other ranks' backward, a napping poll every 160 us (each
sleep ~20 us of CPU here) taken from the ranks that compute; started
together, a step's buckets wait for them once. nanoGPT's loop at 4 ranks
on 2 cores (docs/library.md): the engine's thread 9.6 -> 6.2 ms of CPU a
step. backward_passes_per_step=k: the k passes' gradients
are added (copied ones here; in-place ones by the user's backward) and
summed over the ranks after the k-th.

compression=Compression.powersgd (or Compression.PowerSGD(rank=...)): the
program's PowerSGD (comm/powersgd.PowerSgd) over each float32 flat buffer,
bucket by bucket: its weight matrices (2-D and up, where the factors are
smaller: optim/compression_math.powersgd_layout) as two low-rank factors,
each parameter's error feedback kept in the PowerSgd's buffer-sized error
from step to step, Q warm-started; the rest of the bucket float32. The same
code and bits as `hpctrain train --compression powersgd` on a buffer laid out
alike.

    mpirun -n 2 python examples/numpy_mlp.py
"""
import numpy as np

from ..comm.fusion import bucket_bounds
from ..comm.powersgd import PowerSgd
from ..optim.compression_math import powersgd_layout
from .arrays import host_array
from .calls import Call, agree
from .collectives import Average, Compression, Sum, _call, allreduce_async_, broadcast_async_, synchronize
from .errors import DistError
from .objects import broadcast_object
from .runtime import is_initialized, runtime

FUSION_MB = 4.0   # the program's --fusion-mb default (flags/cli.py)
# The torch optimizer's first bucket (DDP's first-bucket rule, its 1 MB): the sum of the
# output end starts while backward still runs, where one 4 MB bucket waits for its last gradient.
FIRST_BUCKET_MB = 1.0


def flat_like(shapes, dtype=np.float32):
    """(flat buffer, [views in it]) for gradients of `shapes`, one after
    another: a DistributedOptimizer over the views sums them in place."""
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    flat = np.zeros(sum(sizes), dtype)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return flat, [flat[a:b].reshape(s) for a, b, s in zip(offsets[:-1], offsets[1:], shapes)]


def _views_of_one(arrays):
    """The 1-D buffer the arrays lie in one after another (C order, no
    gaps), or None."""
    base = arrays[0].base if arrays else None
    while base is not None and base.base is not None and isinstance(base.base, np.ndarray):
        base = base.base
    if base is None or base.ndim != 1 or not base.flags.c_contiguous or base.dtype != arrays[0].dtype:
        return None
    start = base.ctypes.data
    at = (arrays[0].ctypes.data - start) // base.itemsize
    first = at
    for a in arrays:
        if not a.flags.c_contiguous or a.dtype != base.dtype or a.ctypes.data != start + at * base.itemsize \
                or not np.shares_memory(a, base):
            return None
        at += a.size
    return base[first:at]


def first_bucket_bounds(n, bucket_elems, first_elems, cuts):
    """comm/fusion.bucket_bounds with the first bucket (the end, ready first)
    cut at first_elems instead (None: the program's cut, unchanged)."""
    if first_elems is None or bucket_elems <= 0 or first_elems >= bucket_elems:
        return bucket_bounds(n, bucket_elems, cuts)
    first = bucket_bounds(n, first_elems, cuts)[0]
    if first[0] == 0:
        return [first]
    return [first] + bucket_bounds(first[0], bucket_elems, [c for c in cuts if c < first[0]])


class _Flat:
    """One dtype's tensors: their flat buffer, offsets and buckets."""

    def __init__(self, indices, arrays, fusion_elems, first_elems=None):
        self.indices = indices
        self.sizes = [a.size for a in arrays]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(int).tolist()
        n = self.offsets[-1]
        self.inplace = _views_of_one(arrays)
        self.buf = self.inplace if self.inplace is not None else np.zeros(n, arrays[0].dtype)
        self.buckets = first_bucket_bounds(n, fusion_elems, first_elems, self.offsets[:-1])
        self.launched = 0          # buckets handed to the engine this step
        self.done_from = len(indices)   # tensors [done_from:] are ready


class DistributedOptimizer:
    """Averages a NumPy loop's gradients over the ranks, overlapped with its
    backward. grads: a list of arrays, or a dict name -> array (the arrays
    the user's backward writes; their shapes are fixed). The update itself
    stays the user's: after synchronize() (or allreduce_gradients()) the
    arrays hold the averages."""

    def __init__(self, grads, op=Average, compression=Compression.none, backward_passes_per_step=1,
                 fusion_mb=FUSION_MB, process_set=None, name="grad", first_bucket_mb=None):
        self.names = list(grads) if isinstance(grads, dict) else list(range(len(grads)))
        self.grads = [host_array(g, "DistributedOptimizer", writable=True)
                      for g in (grads.values() if isinstance(grads, dict) else grads)]
        if not self.grads:
            raise DistError("DistributedOptimizer: no gradients")
        self.op, self.compression, self.process_set, self.name = op, compression, process_set, name
        self.passes = int(backward_passes_per_step)
        if self.passes < 1:
            raise DistError(f"DistributedOptimizer: backward_passes_per_step={backward_passes_per_step} (at least 1)")
        by_dtype = {}
        for i, g in enumerate(self.grads):
            by_dtype.setdefault(g.dtype, []).append(i)
        def elems(mb, dt):
            return None if mb is None else int(mb * (1 << 20)) // np.dtype(dt).itemsize
        # where the ranks nap the buckets start together after backward (_advance): a small first
        # bucket would only add a ring, so the program's cut alone (nanoGPT's loop at 4 ranks on 2
        # cores: one bucket, not two; docs/library.md)
        first_mb = None if is_initialized() and runtime().waits.nap else first_bucket_mb
        self.flats = [_Flat(ix, [self.grads[i] for i in ix], elems(fusion_mb, dt), elems(first_mb, dt))
                      for dt, ix in by_dtype.items()]
        self.where = {i: (f, k) for f in self.flats for k, i in enumerate(f.indices)}
        self.counts = [0] * len(self.grads)
        self.handles = []
        self.current = list(self.grads)   # where each average goes this step: ready()'s `grad`, or the array given here
        self.steps = 0                    # synchronize() calls: PowerSGD's step
        self._layouts = self._powersgd_layouts(compression, op)   # flat's index -> its compressed matrices
        # the buffers PowerSGD does not take (not float32) go as they are
        self._plain = Compression.none if getattr(compression, "kind", compression) == "powersgd" else compression
        self._exchanges = {}              # flat's index -> its PowerSgd, made by the first bucket's work

    def _powersgd_layouts(self, compression, op):
        if getattr(compression, "kind", compression) != "powersgd":
            return {}
        if op not in (Sum, Average):
            raise DistError(f"DistributedOptimizer: compression=powersgd compresses a Sum or Average, not {op}")
        layouts = {}
        for k, flat in enumerate(self.flats):
            if flat.buf.dtype == np.float32:   # (the program's PowerSGD is float32's)
                tensors = [(str(self.names[i]), self.grads[i].shape, flat.offsets[j], flat.offsets[j + 1])
                           for j, i in enumerate(flat.indices)]
                layouts[k] = powersgd_layout(tensors, compression.rank, compression.min_rate)[0]
        return layouts

    def _index(self, i):
        if isinstance(i, (int, np.integer)) and not isinstance(self.names[0], str):
            return int(i)
        try:
            return self.names.index(i)
        except ValueError:
            raise DistError(f"DistributedOptimizer.ready: no gradient {i!r}") from None

    def ready(self, i, grad=None):
        """Tensor i's gradient (the array given at construction, or `grad`,
        of its shape: a framework that makes a new gradient array each step)
        is final for this backward pass; synchronize() writes the average
        into that array."""
        i = self._index(i)
        flat, k = self.where[i]
        src = self.grads[i] if grad is None else host_array(grad, "ready", writable=True)
        if src.shape != self.grads[i].shape:
            raise DistError(f"DistributedOptimizer.ready({self.names[i]!r}): shape {src.shape}, "
                            f"not {self.grads[i].shape}")
        if self.counts[i] >= self.passes:
            # its bucket may be on the wire already: a second write would race the sum
            raise DistError(f"DistributedOptimizer.ready({self.names[i]!r}) called {self.counts[i] + 1} times in a "
                            f"step of backward_passes_per_step={self.passes}: call synchronize() first")
        self.counts[i] += 1
        self.current[i] = src
        if flat.inplace is None or grad is not None:
            part = flat.buf[flat.offsets[k]:flat.offsets[k + 1]]
            if self.counts[i] == 1:
                part[...] = src.reshape(-1)
            else:
                part += src.reshape(-1)
        if self.counts[i] == self.passes:
            self._advance(flat)

    def _advance(self, flat):
        """Hand the engine every bucket that lies wholly in the ready region
        from the end; where the ranks nap, all of them once the region is
        the whole buffer (the module's docstring says why)."""
        while flat.done_from > 0 and self.counts[flat.indices[flat.done_from - 1]] >= self.passes:
            flat.done_from -= 1
        ready_from = flat.offsets[flat.done_from]
        if ready_from > 0 and runtime().waits.nap:
            return
        while flat.launched < len(flat.buckets) and flat.buckets[flat.launched][0] >= ready_from:
            self._launch(flat, flat.launched)
            flat.launched += 1

    def _launch(self, flat, b):
        lo, hi = flat.buckets[b]
        k = self.flats.index(flat)
        if k in self._layouts:
            self.handles.append(self._powersgd_async(k, b, lo, hi))
            return
        self.handles.append(allreduce_async_(flat.buf[lo:hi], op=self.op, compression=self._plain,
                                             name=f"{self.name}[{lo}:{hi}]", process_set=self.process_set))

    def _powersgd_async(self, k, b, lo, hi):
        """Bucket b ([lo, hi) of flat k) through its PowerSgd, after the call check."""
        settings, op, step, buf = self.compression, self.op, self.steps, self.flats[k].buf
        call = Call("allreduce", buf.dtype, (hi - lo,), op, "powersgd", name=f"{self.name}[{lo}:{hi}]")

        def work(g):
            ag = agree(g, call, 0)
            exchange = self._exchanges.get(k)
            if exchange is None:
                exchange = self._exchanges[k] = PowerSgd(
                    g.strategy, buf, self._layouts[k], start=settings.start, warm_start=settings.warm_start,
                    eps=settings.epsilon, error_feedback=settings.error_feedback, seed=settings.seed)
            if b == 0:   # the step's first bucket
                exchange.begin(step)
            exchange.allreduce(lo, hi)   # the sum
            if op == Average and len(ag.active) > 1:
                buf[lo:hi] /= np.float32(len(ag.active))
            return None
        return _call(work, call.describe(), self.process_set)

    def synchronize(self):
        """Wait for every bucket (tensors not marked ready are taken as they
        are now); the gradient arrays (ready()'s, or those given at
        construction) then hold the averages; returns them."""
        for i in range(len(self.grads)):
            while self.counts[i] < self.passes:
                self.ready(i)
        for flat in self.flats:
            self._advance(flat)
        for h in self.handles:
            synchronize(h)
        self.handles = []
        for flat in self.flats:
            for k, i in enumerate(flat.indices):
                if flat.inplace is None or self.current[i] is not self.grads[i]:
                    self.current[i].reshape(-1)[...] = flat.buf[flat.offsets[k]:flat.offsets[k + 1]]
            flat.launched, flat.done_from = 0, len(flat.indices)
        self.counts = [0] * len(self.grads)
        self.steps += 1
        out, self.current = self.current, list(self.grads)
        return out

    def allreduce_gradients(self, grads=None):
        """The whole step in one call, after backward: every gradient (the
        arrays given at construction, or `grads` in the same order) summed
        and averaged in place; returns them."""
        given = grads if grads is not None else [None] * len(self.grads)
        if isinstance(given, dict):
            given = [given[n] for n in self.names]
        for i in reversed(range(len(self.grads))):
            for _ in range(self.passes - self.counts[i]):
                self.ready(i, given[i])
        return self.synchronize()


def _tensors(params):
    """[(name, array)] of a list, a dict, or (name, tensor) pairs (named_parameters())."""
    if isinstance(params, dict):
        return list(params.items())
    items = list(params)
    if items and isinstance(items[0], tuple) and len(items[0]) == 2:
        return items
    return list(enumerate(items))


def broadcast_parameters(params, root_rank=0, process_set=None):
    """Every array of params (a list, a dict, or (name, tensor) pairs) set to root_rank's, in place."""
    handles = [broadcast_async_(p, root_rank, name=f"param {name}", process_set=process_set)
               for name, p in _tensors(params)]
    for h in handles:
        synchronize(h)


def broadcast_optimizer_state(state, root_rank=0, process_set=None):
    """An optimizer's state (a dict of arrays, scalars such as lr and step,
    lists and dicts of them) made root_rank's on every rank: arrays in
    place, everything else written into the dict (and its nested dicts and
    lists). Returns state. One message (objects.py's encoding, no pickle)."""
    root = broadcast_object(state, root_rank, name="optimizer state", process_set=process_set)
    return _assign(state, root, "state")


def _assign(mine, theirs, where):
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for key in list(theirs):
            mine[key] = _assign(mine.get(key), theirs[key], f"{where}[{key!r}]")
        return mine
    if isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):
        for k, value in enumerate(theirs):
            mine[k] = _assign(mine[k], value, f"{where}[{k}]")
        return mine
    if isinstance(mine, np.ndarray) and isinstance(theirs, np.ndarray) and mine.shape == theirs.shape \
            and mine.flags.writeable:
        mine[...] = theirs
        return mine
    return theirs
