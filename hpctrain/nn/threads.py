"""A rank's compute threads: where one rank has several cores (one rank on a
node, or a launcher that binds a rank to several), the convolutions split
their blocks of images over these threads instead of leaving the cores to
BLAS's own threads.

Why: measured on the 2-core machine (batch 32, 28x28 Fashion-MNIST), two
OpenBLAS threads made the zoo's cnn step no faster than one (47.9 against
46.9 ms) and resnet's median slower (91.6 against 46.8 ms, twice the CPU):
the GEMMs of a block of images are small and narrow (N = 16 to 64 output
channels) and im2col's copies are single-threaded anyway. Two threads of
ours, each doing im2col and its GEMM on its own images with BLAS at one
thread, ran a 3x3 convolution's forward 1.6-1.9x faster than one.

Each worker holds its own BLAS to one thread (OpenBLAS's
openblas_set_num_threads_local, 0.3.27 and later), and so does the calling
thread while it does its part: two threads calling a multi-threaded
OpenBLAS at once are run one after the other. Where that
call is missing (another BLAS), there are no workers: count() is 1 and
every layer runs as before. NumPy releases the GIL in copyto and matmul, so
Python threads are enough. A layer that uses them keeps the blocks it
would compute alone and adds their results in the same order, so the bits
are the same on any number of threads (tests/test_threads.py).

    python -m pytest -q tests/test_threads.py
"""
import ctypes
import math
import threading

# The least work worth a part of its own: handing a part to a worker and
# waiting for it costs 30-90 us on the 2-core VM (waking a thread on another
# core is a trip through the hypervisor), about what an elementwise pass
# over MIN_FLOATS floats takes. A product's part also stays above
# OpenBLAS's small-matrix kernels (M*N*K <= 100**3 on AVX-512), which sum
# in another order than its blocked GEMM: (7 x 130) @ (130 x 200) split at
# column 64 gave other bits, products above them split exactly.
MIN_FLOATS = 1 << 17
MIN_MACS = 1 << 22

# A product is split only along its output's rows, each part starting at a
# multiple of ROW_TILE rows. Why: OpenBLAS's SGEMM groups a row-major
# output's rows into tiles (the kernel's N unroll: 12 on the Haswell/Zen
# kernel), and a row's sum comes out in other bits when it falls in another
# tile shape (measured on an AMD EPYC, OpenBLAS 0.3.31 'Haswell' core:
# (6144 x 32) @ (32 x 64) cut every 4, 8, 16 or 256 rows gave other bits,
# every 12, 24 or 48 the same). Columns are worse: cut anywhere but a half,
# columns either side of the cut changed. 48 is a multiple of every x86
# SGEMM row tile we know of (4, 8, 12, 16, 24), so the same rule should hold
# on AVX-512 kernels too (not yet run on one: the AMD machine found it).
ROW_TILE = 48

_workers = []
_set_local = None
_here = threading.local()   # .worker: True in a worker (a split there runs serially)


class _Worker:
    """One thread waiting for parts: `go` released hands it one, `done`
    released says it finished. Raw locks, CPython's cheapest wait (a
    concurrent.futures hand-off measured 37-74 us here)."""

    def __init__(self, name, set_local):
        self.go, self.done = threading.Lock(), threading.Lock()
        self.go.acquire()
        self.done.acquire()
        self.task = self.error = None
        self.thread = threading.Thread(target=self._loop, args=(set_local,), name=name, daemon=True)
        self.thread.start()

    def _loop(self, set_local):
        set_local(1)
        _here.worker = True
        while True:
            self.go.acquire()
            task = self.task
            if task is not None:
                try:
                    task()
                except BaseException as exc:   # raised again in the caller
                    self.error = exc
            self.done.release()
            if task is None:
                return

    def start(self, task):
        self.task, self.error = task, None
        self.go.release()

    def wait(self):
        self.done.acquire()
        error, self.error = self.error, None
        return error


def _blas_local_threads():
    """OpenBLAS's per-thread thread count setter (it returns the count in
    force before; 0 gives the thread the global count back), from the
    library NumPy loaded, or None."""
    __import__("numpy")   # loads its BLAS (a call, not an import pyflakes would call unused)
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            fn = getattr(ctypes.CDLL(path), "openblas_set_num_threads_local")
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


def configure(count):
    """Use `count` compute threads from now on (1: none), the calling
    thread one of them. Returns the count in force: 1 where BLAS cannot be
    held to one thread in each."""
    global _workers, _set_local
    for worker in _workers:
        worker.start(None)
        worker.wait()
    _workers = []
    count = max(1, int(count))
    if count == 1:
        return 1
    _set_local = _blas_local_threads()
    if _set_local is None:
        return 1
    _workers = [_Worker(f"hpctrain-compute-{i + 1}", _set_local) for i in range(count - 1)]
    return count


def count():
    return len(_workers) + 1


def ranges(n, parts, unit=1):
    """`parts` contiguous ranges covering range(n), each a whole number of
    `unit`s (but the last), as even as that allows; empty ones left out."""
    units = -(-n // unit)
    parts = max(1, min(parts, units))
    cuts = [min(n, (units * p // parts) * unit) for p in range(parts + 1)]
    return [(lo, hi) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]


def run(fn, parts):
    """fn(part_index, *part) for every part: the last in this thread (its
    BLAS held to one thread meanwhile), the others on the workers; returns
    when all are done, raising the first error."""
    if len(parts) == 1 or not _workers or getattr(_here, "worker", False):
        for i, part in enumerate(parts):
            fn(i, *part)
        return
    if len(parts) > len(_workers) + 1:
        raise ValueError(f"{len(parts)} parts for {len(_workers) + 1} threads (split them with ranges())")
    started = []
    try:
        for i, part in enumerate(parts[:-1]):
            _workers[i].start(lambda i=i, part=part: fn(i, *part))
            started.append(_workers[i])
        before = _set_local(1)
        _here.worker = True   # a split inside this thread's part runs serially: the workers are busy
        try:
            fn(len(parts) - 1, *parts[-1])
        finally:
            _here.worker = False
            _set_local(before)
    finally:
        errors = [worker.wait() for worker in started]   # every part done before anything is raised
    for error in errors:
        if error is not None:
            raise error


def most(floats=0, macs=0):
    """The most parts work of `floats` elementwise floats or a product of
    `macs` multiply-adds is worth splitting into."""
    return max(1, floats // MIN_FLOATS, macs // MIN_MACS)


def row_unit(rows_per_item):
    """The fewest items (images, samples) whose output rows make a whole
    number of ROW_TILEs: the unit a product splits in."""
    return ROW_TILE // math.gcd(ROW_TILE, int(rows_per_item))


def serial():
    """Whether a split here runs in this thread alone: no workers, or this
    thread is one (its part of a split, or a slice of --thread-split
    samples: the others are busy). Every layer's step asks it first: a
    one-core rank's path is then one call, not the parts' arithmetic."""
    return not _workers or getattr(_here, "worker", False)


def pair(first, second, on=True):
    """first() here and second() on the worker at the same time where the
    rank has exactly two compute threads (and `on`: NumPy arrays), else one
    after the other. The worker starts some 30 us late (it waits for the
    GIL until this thread is inside NumPy): give it the lighter task.
    For a layer's two backward products (the weight's gradient and the
    input's), which cost the same multiply-adds: each done whole by one
    thread, the two threads are balanced and meet once, where splitting
    each over both meets twice and splits a 128-row weight gradient 48/80
    (whole ROW_TILEs). A product done whole has one thread's bits. With
    more threads each is split over all of them (split) instead."""
    if on and len(_workers) == 1 and not getattr(_here, "worker", False):
        run(lambda i: second() if i == 0 else first(), [(), ()])
    else:
        first()
        second()


def split(n, work, unit=1, floats=None, macs=None, on=True):
    """work(thread, lo, hi) over range(n) in ranges of whole `unit`s, one per
    compute thread (at most most(floats, macs) where either is given: what
    the work is worth), where `on` (NumPy arrays: CuPy's kernels have the
    GPU); otherwise work(0, 0, n) here. The sizes, not a count, so a serial
    rank (every step's path on one core) skips the arithmetic."""
    if not on or not _workers or getattr(_here, "worker", False):   # serial(), inlined: every layer's call asks
        work(0, 0, n)
        return
    parts = count() if floats is None and macs is None else min(count(), most(floats or 0, macs or 0))
    if parts == 1:   # small work: no ranges to make
        work(0, 0, n)
        return
    run(work, ranges(n, parts, unit))
