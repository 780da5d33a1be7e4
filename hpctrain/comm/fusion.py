"""Tensor fusion with overlap: the flat gradient buffer is cut into buckets of
about --fusion-mb, and each bucket's allreduce starts as soon as backprop has
finished every gradient in it, while backprop of earlier layers goes on.

Backprop finishes the last layer first, so the finished region grows from the
end of the buffer towards its start; buckets are cut from the end so they
become ready in order. A communication thread runs the allreduces one after
another (MPI needs someone to drive progress: the thread blocks inside MPI
with the GIL released, and NumPy's matrix products release it too), and right
after a bucket's allreduce it runs the update of those elements, so the main
thread's wait at the end covers only what is not yet done. Bucket boundaries do not depend on timing, and each bucket is
reduced by the same algorithm as without overlap: results are bit-for-bit
those of reducing the same buckets one after another.

    mpirun -n 2 python -m hpctrain.mnist --fusion-mb 1      # overlapped buckets
    mpirun -n 2 python -m hpctrain.mnist --fusion-mb 0      # one allreduce after backprop

What a bucket's sum and update are is the data-parallel update's
(comm/data_parallel.py: allreduce, or with --shard-optimizer reduce-scatter,
this rank's part updated, the parameters allgathered; through the
compression exchange with --compression); this module only decides when,
and on which thread.

On a GPU, the two threads may compute on two streams (CuPy's per-thread
default streams, or any stream a thread makes current), so nothing but
events orders their kernels: `layer_done` records one (`marks.mark()`) on
backprop's stream and hands it to the communication thread with the bucket;
that thread's stream waits for it (`marks.use`) before the strategy reads
the bucket, and it hands back an event recorded after the bucket's update,
which `wait()` makes the main stream wait for, so the next forward reads
updated parameters. Neither host thread blocks for the other's kernels (the
main thread used to synchronize its whole stream in `layer_done`).

Deferred updates (--clip-norm): the clip factor needs the norm of the
whole summed gradient, known only after the last bucket. Then the buckets
are summed as above (overlapped with backprop), but no bucket's update (nor,
sharded, its allgather) runs until wait() has seen every sum and called the
update's clip_scale(); the updates and allgathers then run in wait(), bucket
by bucket, in the main thread. The sums still hide behind backprop; the
update no longer does.
"""
import queue
import threading
import time

from ..base import device
from .strategy import waiting


def bucket_bounds(n, bucket_elems, cuts=()):
    """[(lo, hi)] covering [0, n), in the order they become ready (from the end).

    Buckets end on `cuts` (the offsets where a layer's gradient starts), as
    Horovod and DDP keep tensors whole: a bucket split inside a layer could not
    start before that whole layer is done anyway. Consecutive layers are fused
    while the bucket stays within bucket_elems; bucket_elems <= 0 means one
    bucket (no fusion, no overlap)."""
    if bucket_elems <= 0 or n == 0:
        return [(0, n)]
    points = sorted({c for c in cuts if 0 < c < n} | {0}, reverse=True)
    bounds, hi, lo = [], n, None
    for p in points:
        if lo is not None and hi - p > bucket_elems:
            bounds.append((lo, hi))
            hi = lo
        lo = p
    bounds.append((0, hi))
    return bounds


def ready_from(layer_ranges):
    """For each layer i (its range (lo, hi) in the gradient buffer): the lowest
    offset that is final once layer i's gradient is done. Layers finish from
    last to first, so that is layer i's start (0 for layer 0, whatever it holds)."""
    return [0] + [lo for lo, _ in layer_ranges[1:]]


def overlaps(overlap, buckets, strategy):
    """Whether a communication thread sums the buckets (--overlap on): one
    rank has nothing to reduce, one bucket nothing to overlap."""
    return bool(overlap) and len(buckets) > 1 and strategy is not None and strategy.size > 1


class FusedAllreduce:
    """Drive the buckets of one part of a data-parallel update (`update`:
    comm/data_parallel.DataParallelUpdate, its part `part`: in training the
    whole model's gradient buffer) from backprop's layer callbacks: each
    bucket's sum (`update.reduce`), then, unless the update is deferred
    (--clip-norm), its update and, sharded, its allgather (`update.update`,
    `update.gather`).

    ready_from[i]: the lowest buffer offset that is final once layer i's gradient
    is done (layers finish from last to first); the part's buckets are
    bucket_bounds(...) of the same buffer. Per step: `layer_done(i)` from
    backprop, then `wait()`. `marks`: device.stream_marks(xp), the events
    that order the two threads' streams (default: NumPy's, which do
    nothing). Deferred, every update (and allgather) waits, in wait(), for
    the last bucket's sum and update.clip_scale().
    """

    def __init__(self, update, ready_from, marks=None, overlap=True, timeline=None, watchdog=None, part=0):
        self.update, self.part = update, part
        self.ready_from = list(ready_from)
        self.buckets = list(update.parts[part].buckets)
        self.marks = marks or device.HostMarks()
        self.overlap = overlaps(overlap, self.buckets, update.strategy)
        self.timeline = timeline
        self.watchdog = watchdog
        # --zero 2: the buckets' gradient slots (nn/grad_slots.py); a bucket's
        # slot is free once the bucket that used it before is summed, so each
        # bucket is summed as soon as it is done, with overlap or without
        self.slots = update.parts[part].grads if update.shard_grads else None
        self._next = 0          # index of the next bucket to launch
        self._received = 0      # buckets the communication thread has handed back this step
        # Last step's accounting (seconds): the main thread's wait in wait(), and
        # how much of it was allreduce and how much optimizer update (the rest of
        # their time was hidden behind backprop); update_s is all update time.
        self.wait_s = self.exposed_comm_s = self.exposed_update_s = self.update_s = 0.0
        self._spans = []        # (start, end, is_update) of this step's work
        if self.overlap:
            self._todo = queue.SimpleQueue()
            self._done = queue.SimpleQueue()
            self._gathered = queue.SimpleQueue()   # --zero 3: the gathers posted (`post`), in order
            self._thread = threading.Thread(target=self._worker, name="hpctrain-allreduce", daemon=True)
            self._thread.start()

    # --- called by the training loop ---------------------------------------
    def layer_done(self, layer):
        """Launch every bucket that lies wholly in the finished region (with
        overlap; without, everything waits for wait(), but with --zero 2's
        slots, where it is summed here). With slots, when the next layer
        starts a bucket whose slot an earlier bucket holds, wait for that one."""
        if not self.overlap and self.slots is None:
            return
        finished_from = self.ready_from[layer]
        self._launch_until(lambda lo: lo >= finished_from)
        if self.slots is not None and layer > 0:
            before = self.slots.reuses(self.slots.bucket_at(self.ready_from[layer - 1]))
            if before is not None and self.overlap:
                self._receive(before + 1)

    def wait(self):
        """Launch what is left, then wait until every bucket is reduced (and its
        callback has run). The host does not wait for the device: later
        kernels on this thread's stream are ordered after the buckets' work."""
        t0 = time.perf_counter()
        self._launch_until(lambda lo: True)
        if self.overlap:
            self._receive(len(self.buckets))
        if self.update.deferred:
            self.update.clip_scale()   # every sum is in: the clip norm
            for i in range(len(self.buckets)):
                self._update(i)
        self._next = self._received = 0
        t1 = time.perf_counter()
        self.wait_s = t1 - t0
        comm = update = total_update = 0.0
        for start, end, is_update in self._spans:
            exposed = max(0.0, min(end, t1) - max(start, t0))
            if is_update:
                update += exposed
                total_update += end - start
            else:
                comm += exposed
        self.exposed_comm_s, self.exposed_update_s, self.update_s = comm, update, total_update
        self._spans.clear()

    def close(self):
        """End the communication thread (a second run in one process must not
        find the first one's thread and communicator still there)."""
        if self.overlap:
            self._todo.put(None)
            self._thread.join(timeout=5)

    # --- --zero 3's gathers, on the same thread ---------------------------------
    def post(self, j, gather):
        """Run gather() (bucket j's parameters into their slot) on the
        communication thread, in order with the buckets' sums: two threads'
        collectives on one communicator would race. With overlap only."""
        self._todo.put(_Gather(j, gather, self.marks.mark()))   # the slot's readers so far come first

    def collect(self, j):
        """Wait for the posted gather of bucket j: the buckets gathered until
        it (in posting order, j last)."""
        done = []
        while not done or done[-1] != j:
            with waiting(self.watchdog, "parameter gather"):
                item = self._gathered.get()
            if isinstance(item, BaseException):
                raise item
            k, mark = item
            self.marks.use(mark)   # the layers read the slot after the gather wrote it
            done.append(k)
        return done

    # --- internals -----------------------------------------------------------
    def _receive(self, count):
        """Wait until the communication thread has handed back the first
        `count` buckets (summed, and unless deferred updated)."""
        while self._received < count:
            with waiting(self.watchdog, "fused allreduce"):
                item = self._done.get()
            if isinstance(item, BaseException):
                raise item
            self.marks.use(item)   # later kernels (the next forward, a slot's next writer) wait for it
            self._received += 1

    def _launch_until(self, ready):
        """Launch the next buckets while ready(bucket's lo). Without overlap
        they are reduced here, on this thread's stream, which every strategy
        synchronizes or waits for itself before MPI reads."""
        if self._next == len(self.buckets) or not ready(self.buckets[self._next][0]):
            return
        # One event for every bucket launched now: all were written by the
        # kernels queued so far on backprop's stream.
        backprop = self.marks.mark() if self.overlap else None
        while self._next < len(self.buckets) and ready(self.buckets[self._next][0]):
            if self.overlap:
                self._todo.put((self._next, backprop))
            else:
                self._reduce(self._next)
            self._next += 1

    def _reduce(self, i):
        """Sum bucket i (all of it, or this rank's part when sharded); then,
        unless deferred, its update (and allgather)."""
        (lo, hi), update = self.buckets[i], self.update
        t0 = time.perf_counter()
        update.reduce(self.part, i)
        t1 = time.perf_counter()
        self._spans.append((t0, t1, False))
        if self.timeline is not None:
            what = "reduce-scatter" if update.sharded else "allreduce"
            self.timeline.add(f"{what} [{lo}:{hi})", "comm", t0, t1, {"bytes": update.sent_bytes(self.part, i)})
        if not update.deferred:
            self._update(i)

    def _update(self, i):
        """The update of this rank's summed part of bucket i; sharded, then the
        allgather of the bucket's parameters."""
        (lo, hi), update = self.buckets[i], self.update
        t1 = time.perf_counter()
        update.update(self.part, i)
        t2 = time.perf_counter()
        self._spans.append((t1, t2, True))
        if self.timeline is not None:
            a, b = update.parts[self.part].owned[i]
            self.timeline.add(f"optimizer [{a}:{b})", "optimizer", t1, t2)
        if update.sharded and update.parts[self.part].param_shard is None:   # --zero 3 gathers before use
            update.gather(self.part, i)
            t3 = time.perf_counter()
            self._spans.append((t2, t3, False))
            if self.timeline is not None:
                itemsize = update.parts[self.part].params.itemsize
                self.timeline.add(f"allgather [{lo}:{hi})", "comm", t2, t3, {"bytes": (hi - lo) * itemsize})

    def _worker(self):
        self.marks.bind_thread()
        while True:
            item = self._todo.get()
            if item is None:
                return
            if isinstance(item, _Gather):
                try:
                    self.marks.use(item.readers)
                    item.gather()
                    self._gathered.put((item.bucket, self.marks.mark()))
                except BaseException as exc:   # surface in the main thread
                    self._gathered.put(exc)
                continue
            bucket, backprop = item
            try:
                self.marks.use(backprop)   # MPI and copies read the bucket after backprop wrote it
                self._reduce(bucket)
                self._done.put(self.marks.mark())   # the next forward runs after this bucket's update
            except BaseException as exc:  # surface in the main thread
                self._done.put(exc)


class _Gather:
    """A --zero 3 gather for the communication thread: bucket index, the
    call, and the event after which the slot's last readers are done."""
    __slots__ = ("bucket", "gather", "readers")

    def __init__(self, bucket, gather, readers):
        self.bucket, self.gather, self.readers = bucket, gather, readers
