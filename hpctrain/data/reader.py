"""Reading prepared shards: a worker's training batches and a rank's share of the test set.

    reader = ShardReader("data/mnist", worker, num_workers, batch_size, seed)
    x, y = reader.next_batch()          # float32 (B, 784) in [0, 1], int64 (B,)
    ShardReader(..., arrays=("labels",)).next_batch()   # (None, y): the images never read
    x, y = load_test("data/mnist", part, parts)

Each epoch is one permutation of the whole training set, dealt over the
workers step by step (`deal`), so a checkpoint's position means the same to
any number of workers. Every shard is checked against the manifest (sha256,
shapes, dtypes) before it is used.
No MPI here (house rule): callers pass worker numbers, not ranks.

    python -c "from hpctrain.data import ShardReader; print(ShardReader('data/mnist', 0, 1, 64, 0).num_samples)"
"""

import math
from pathlib import Path

import h5py
import numpy as np

from hpctrain.base.chunks import chunk_parts
from hpctrain.base.errors import HpctrainError
from hpctrain.base.precision import FLOAT32

from . import augment as augment_mod
from .manifest import MANIFEST, _sha256, load_manifest


def _open_h5(path, **options):
    # Many ranks open the same shard; HDF5's file locks fail on some parallel
    # filesystems and buy nothing for read-only access.
    try:
        return h5py.File(path, "r", locking=False, **options)
    except (TypeError, ValueError):  # h5py < 3.5, or HDF5 too old for the option
        return h5py.File(path, "r", **options)


ARRAYS = ("images", "labels")   # a shard's datasets


def _image_manifest(data_dir):
    """The manifest of a directory of image shards; token shards (prepare
    --text) are one line: their reader is tokens.py."""
    manifest = load_manifest(data_dir)
    if manifest.get("kind") == "tokens":
        raise HpctrainError(f"{data_dir}: holds text as tokens (prepare --text), not images; "
                            f"read it with data.TokenReader and data.load_test_windows")
    return manifest


def _verify_shard(data_dir, entry, image_shape):
    """The shard's path, once it matches the manifest: present, its sha256,
    uint8 images and labels of the listed shapes. Nothing is allocated before
    this, because the sizes come from the manifest, which is input too."""
    path = Path(data_dir) / entry["file"]
    if not path.is_file():
        raise HpctrainError(f"{path}: missing shard (listed in {MANIFEST}); prepare again "
                            f"with --force")
    got = _sha256(path)
    if got != entry["sha256"]:
        raise HpctrainError(f"{path}: corrupt shard (sha256 {got[:12]}..., manifest says "
                            f"{entry['sha256'][:12]}...); prepare again with --force")
    n = entry["num_samples"]
    try:
        with _open_h5(path) as f:
            images, labels = f.get("images"), f.get("labels")
            ok = (isinstance(images, h5py.Dataset) and isinstance(labels, h5py.Dataset)
                  and images.shape == (n, *image_shape) and labels.shape == (n,)
                  and images.dtype == np.uint8 and labels.dtype == np.uint8)
            if not ok:
                raise HpctrainError(
                    f"{path}: bad shard: expected uint8 images {(n, *image_shape)} and "
                    f"labels {(n,)}, found {_describe(images)} and {_describe(labels)}")
    except OSError as e:
        raise _unreadable(path, e) from None
    return path


def _read_rows(path, start, stop, num_classes, arrays=ARRAYS):
    """Rows [start, stop) of a verified shard, (images, labels), each None
    unless named in `arrays`; the labels checked."""
    try:
        with _open_h5(path) as f:
            x, y = (f[name][start:stop] if name in arrays else None for name in ARRAYS)
    except OSError as e:
        raise _unreadable(path, e) from None
    if y is not None:
        _check_labels(path, y, num_classes, start)
    return x, y


def _read_shard(data_dir, entry, image_shape, num_classes, start=0, stop=None):
    """Rows [start, stop) of one shard, after checking it against the manifest."""
    path = _verify_shard(data_dir, entry, image_shape)
    stop = entry["num_samples"] if stop is None else stop
    return _read_rows(path, start, stop, num_classes)


def _unreadable(path, e):
    return HpctrainError(f"{path}: unreadable HDF5 shard ({e}); prepare again with --force")


def _check_labels(path, labels, num_classes, start):
    # A label past num_classes would index past the model's outputs (or,
    # through NumPy's negative indexing, silently train the wrong class).
    bad = np.flatnonzero(labels >= num_classes)
    if len(bad):
        raise HpctrainError(f"{path}: label {int(labels[bad[0]])} in row {start + int(bad[0])} "
                            f"is not below the manifest's num_classes {num_classes}; "
                            f"prepare again with --force")


def _describe(obj):
    if isinstance(obj, h5py.Dataset):
        return f"{obj.dtype} {obj.shape}"
    return "nothing" if obj is None else type(obj).__name__


def _to_float(images, out=None, dtype=FLOAT32.compute):
    # Divide in the compute dtype (not multiply by 1/255) so training batches
    # and the test set see bit-identical pixel values.
    return np.divide(images, 255, out=out, dtype=dtype)


# A training set up to this size is read once and held whole by every worker
# (MNIST: 47 MB, CIFAR-10: 150 MB): any epoch's dealing is then a gather from
# memory. A bigger one is read anew at each epoch's start, each worker keeping
# only its own samples of the epoch (1/W), in slabs of SLAB_BYTES from each
# shard. Reading the whole set every epoch costs each worker 1.6 ms per step
# at 4 workers on the bundled sample (28 ms per 17-step epoch), a tenth of a
# step: worth avoiding while the set fits.
RESIDENT_BYTES = 1 << 30
SLAB_BYTES = 32 << 20


def deal(num_samples, num_workers, batch_size, seed, epoch, start=0):
    """The dealing of one epoch: int64 (steps, W, B) global sample ids.

    An epoch is one permutation of the whole training set, a pure function of
    (seed, epoch). From position `start` on (0, or where a run of another
    world size stopped) it is dealt in blocks of W*B, one per step: in each
    block worker w takes the w-th B. What is left when fewer than W*B remain
    is dropped, so every step has W*B distinct samples and an epoch drops
    fewer than W*B."""
    N, W, B = int(num_samples), int(num_workers), int(batch_size)
    perm = np.random.default_rng([int(seed), int(epoch)]).permutation(N)
    steps = (N - start) // (W * B)
    return perm[start:start + steps * W * B].reshape(steps, W, B)


_FEISTEL_ROUNDS = 4
_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def permuted(n, key, index):
    """Entries `index` (int64) of a seeded permutation of 0..n-1, each
    computed on its own, none of the others held: a Feistel network of
    _FEISTEL_ROUNDS rounds (splitmix64's mixing, round keys from `key`, a
    tuple of ints such as (seed, epoch)) is a bijection of the 2h-bit
    numbers, 2^2h the least such power at or above n (under 4n); a value
    at or past n is sent through it again until it falls below n (cycle
    walking: fewer than 4 passes expected), which keeps it a bijection of
    0..n-1. Memory: the indices asked for, whatever n."""
    index = np.asarray(index, np.int64)
    if n <= 1:
        return np.zeros_like(index)
    h = max(1, ((int(n) - 1).bit_length() + 1) // 2)
    mask, shift = np.uint64((1 << h) - 1), np.uint64(h)
    keys = np.random.default_rng([int(k) for k in key]).integers(0, 1 << 63, _FEISTEL_ROUNDS, dtype=np.uint64)
    x = index.astype(np.uint64)
    todo = np.arange(len(x))
    while len(todo):
        v = x[todo]
        left, right = v >> shift, v & mask
        for k in keys:
            f = (right + k) * _MIX[0]
            f = (f ^ (f >> np.uint64(30))) * _MIX[1]
            f = (f ^ (f >> np.uint64(27))) * _MIX[2]
            left, right = right, (left ^ f ^ (f >> np.uint64(31))) & mask
        x[todo] = (left << shift) | right
        todo = todo[x[todo] >= np.uint64(n)]
    return x.astype(np.int64)


class Dealt:
    """What a training reader of W workers shares, whatever it reads (images
    here, token windows in tokens.py): the dealing of each epoch (`deal`)
    from `position`, `seek` to another position (at any W), the ids of the
    last batch (`last_ids`, `last_draw`) and the step through the epochs
    (`_next`). `num_samples` (set by the reader) is what is dealt; `unit`
    names it in errors."""

    unit = "samples"

    def __init__(self, data_dir, worker, num_workers, batch_size, seed):
        if not (isinstance(num_workers, (int, np.integer)) and num_workers >= 1):
            raise HpctrainError(f"num_workers must be a positive integer, got {num_workers!r}")
        if not (isinstance(worker, (int, np.integer)) and 0 <= worker < num_workers):
            raise HpctrainError(f"worker must be in 0..{num_workers - 1}, got {worker!r}")
        if not (isinstance(batch_size, (int, np.integer)) and batch_size >= 1):
            raise HpctrainError(f"--batch-size must be a positive integer, got {batch_size!r}")
        self.data_dir = Path(data_dir)
        self.worker, self.num_workers = int(worker), int(num_workers)
        self.batch_size, self.seed = int(batch_size), int(seed)
        self._epoch, self._start = 0, 0     # the epoch dealt, from which position
        self._taken = 0                     # batches of it handed out
        self._steps = None                  # steps in it; None: not dealt yet
        self._ids = None                    # this worker's ids of the epoch, in order

    @property
    def position(self):
        """(epoch, pos) of the next batch; pass it to seek() to resume there (any W)."""
        return self._epoch, self._start + self._taken * self.num_workers * self.batch_size

    def seek(self, epoch, pos):
        if not (0 <= epoch and 0 <= pos <= self.num_samples):
            raise HpctrainError(f"{self.data_dir}: cannot seek to epoch {epoch}, position {pos} "
                                f"({self.num_samples} training {self.unit})")
        if (int(epoch), int(pos)) != self.position:
            self._epoch, self._start, self._taken, self._steps = int(epoch), int(pos), 0, None

    @property
    def last_ids(self):
        """Global ids (of the training set's samples, or windows' first tokens) of the last batch."""
        B = self.batch_size
        return self._ids[(self._taken - 1) * B: self._taken * B]

    @property
    def last_draw(self):
        """(epoch, ids) of the last batch: what a dropout mask is a function
        of (with the seed), whichever worker takes the sample."""
        return self._epoch, self.last_ids

    def _deal(self):
        """This worker's ids of the epoch from the current position."""
        while True:
            blocks = deal(self.num_samples, self.num_workers, self.batch_size, self.seed,
                          self._epoch, self._start)
            if len(blocks):
                break
            self._epoch, self._start = self._epoch + 1, 0   # nothing left to deal: the next epoch
        self._steps, self._taken = len(blocks), 0
        self._ids = np.ascontiguousarray(blocks[:, self.worker, :]).reshape(-1)

    def _next(self):
        """The index of the next batch in this worker's part of the epoch,
        dealing the next epoch when this one is done."""
        if self._steps is None or self._taken == self._steps:
            if self._steps is not None:   # the epoch is done: the next one from its start
                self._epoch, self._start = self._epoch + 1, 0
            self._deal()
        self._taken += 1
        return self._taken - 1


class ShardReader(Dealt):
    """Training batches for one of W workers, dealt from one permutation of
    the whole training set per epoch (`deal`), as Horovod's elastic sampler
    does, so that a run can stop and go on with another number of workers.

    position is (epoch, pos): the first pos samples of the epoch's permutation
    are taken (by this worker and, at the same step, the others). seek(epoch,
    pos) deals the rest of that epoch over this reader's W workers, whatever W
    was before: a sample is used at most once per epoch, and fewer than W*B
    are dropped per epoch (W: the workers that end the epoch).

    A worker holds the whole training set as uint8 when it is at most
    resident_bytes, otherwise only its own samples of the current epoch (1/W),
    read from every shard at the epoch's start (see RESIDENT_BYTES). Each shard
    is checked against the manifest first. next_batch() returns arrays that
    the next call overwrites: copy them if they must outlive the step.

    `arrays` names what it reads and holds, a part of ("images", "labels"):
    a pipeline's first stage takes the images, its last the labels, the
    stages between neither (then no shard is opened at all). What it does not
    read is None, in `images`/`labels` and in next_batch()'s pair; the
    dealing, `position`, `seek` and `last_draw` are the same whatever it reads.

    augment ("crop,flip", augment.py; None or "": none) transforms each
    training batch's images in place, per sample from (seed, epoch, sample id).
    """

    def __init__(self, data_dir, worker, num_workers, batch_size, seed, resident_bytes=RESIDENT_BYTES,
                 arrays=ARRAYS, augment=None, dtype=FLOAT32.compute):
        super().__init__(data_dir, worker, num_workers, batch_size, seed)
        self.arrays = tuple(name for name in ARRAYS if name in arrays)

        manifest = _image_manifest(self.data_dir)
        shape = tuple(manifest["image_shape"])
        self.num_features = math.prod(shape)
        self.augment = None
        if augment:
            augment_mod.check(augment, manifest, self.data_dir)
            self.augment = augment_mod.Augment(augment, shape, self.seed)
        self.num_classes = int(manifest["num_classes"])
        shards = manifest["train"]["shards"]
        self.num_samples = int(manifest["train"]["num_samples"])   # the whole training set
        per_step = self.num_workers * self.batch_size
        if self.num_samples < per_step:
            raise HpctrainError(f"{self.data_dir}: {self.num_samples} training samples, fewer than one "
                                f"step takes ({self.num_workers} workers x --batch-size "
                                f"{self.batch_size} = {per_step}); use a smaller --batch-size or "
                                f"fewer workers")
        # Every shard matches the manifest before any of its sizes is used;
        # a reader of neither array opens none.
        self._shards = [(_verify_shard(self.data_dir, e, shape) if self.arrays else None, int(e["num_samples"]))
                        for e in shards]
        self._first = np.cumsum([0] + [n for _, n in self._shards])   # global id of each shard's row 0

        self.images = self.labels = None    # the samples held: all, or the epoch's own
        self._rows = None                   # the rows of images that _ids are
        self.resident = self.num_samples * self.num_features <= resident_bytes
        if self.resident and self.arrays:
            self._allocate(self.num_samples, "the training set", "use fewer ranks per node")
            for (path, n), first in zip(self._shards, self._first):
                self._store(slice(first, first + n), *_read_rows(path, 0, n, self.num_classes, self.arrays))
        images, labels = "images" in self.arrays, "labels" in self.arrays
        self._ubuf = np.empty((self.batch_size, self.num_features), np.uint8) if images else None
        # the batches' pixels in the run's compute dtype (hpctrain/base/precision.py)
        self._x = np.empty((self.batch_size, self.num_features), dtype) if images else None
        self._y = np.empty(self.batch_size, np.int64) if labels else None

    def _store(self, at, x, y, rows=slice(None)):
        """Rows `rows` of a shard's read (x, y) into the held arrays at `at`."""
        if x is not None:
            self.images[at] = x.reshape(len(x), -1)[rows]
        if y is not None:
            self.labels[at] = y[rows]

    def _allocate(self, count, what, hint):
        try:
            if "images" in self.arrays:
                self.images = np.empty((count, self.num_features), np.uint8)
            if "labels" in self.arrays:
                self.labels = np.empty(count, np.int64)
        except (MemoryError, ValueError):
            raise HpctrainError(f"{self.data_dir}: worker {self.worker}'s copy of {what} ({count} "
                                f"samples of {self.num_features} values) does not fit in memory; "
                                f"{hint}") from None

    def _deal(self):
        """This worker's samples of the epoch from the current position, read into memory."""
        super()._deal()
        count = len(self._ids)
        if self.resident:
            self._rows = self._ids
            return
        self._rows = np.arange(count)
        if not self.arrays:
            return
        held = self.images if self.images is not None else self.labels
        if held is None or len(held) < count:
            self._allocate(count, "an epoch's part", "use more workers")
        # Shard by shard, slab by slab, in row order; each row lands at its
        # place in this worker's order of the epoch.
        order = np.argsort(self._ids, kind="stable")
        ids = self._ids[order]
        slab = max(1, SLAB_BYTES // max(1, self.num_features))
        for (path, n), first in zip(self._shards, self._first):
            for a in range(0, n, slab):
                b = min(a + slab, n)
                i, j = np.searchsorted(ids, [first + a, first + b])
                if i == j:
                    continue
                self._store(order[i:j], *_read_rows(path, a, b, self.num_classes, self.arrays),
                            rows=ids[i:j] - first - a)

    def next_batch(self):
        """(x float32 (B, features) in [0, 1], y int64 (B,)); both reused by
        the next call; either None where the reader does not read it."""
        B, k = self.batch_size, self._next()
        rows = self._rows[k * B:(k + 1) * B]
        if self._x is not None:
            np.take(self.images, rows, axis=0, out=self._ubuf, mode="clip")
            if self.augment is not None:
                self.augment.apply(self._ubuf, self._epoch, self.last_ids)
            _to_float(self._ubuf, out=self._x, dtype=self._x.dtype)
        if self._y is not None:
            np.take(self.labels, rows, out=self._y, mode="clip")
        return self._x, self._y


def has_val(data_dir):
    """Whether prepare held out a validation part (--val-fraction) in data_dir."""
    return "val" in load_manifest(data_dir)


def load_test(data_dir, part=0, parts=1, raw=False, split="test"):
    """Contiguous part `part` of `parts` of the test set: (x float32 (n, features), y int64 (n,)).
    With raw=True, x stays uint8 pixels (a quarter of the memory; scale by 1/255 per batch).
    split="val": the validation part instead (prepare --val-fraction).

    Parts are near-equal and together cover the test set once, so ranks can
    evaluate it together; a part is empty when parts exceeds the test set.
    """
    if not (isinstance(parts, (int, np.integer)) and parts >= 1 and 0 <= part < parts):
        raise HpctrainError(f"load_test: part must be in 0..parts-1 with parts >= 1, "
                            f"got part={part!r}, parts={parts!r}")
    manifest = _image_manifest(data_dir)
    shape = tuple(manifest["image_shape"])
    features = math.prod(shape)
    if split not in manifest:
        raise HpctrainError(f"{data_dir}: no {split} part; prepare again with --val-fraction F")
    lo, hi = chunk_parts(manifest[split]["num_samples"], parts)[part]
    xs, ys = [np.empty((0, features), np.uint8 if raw else FLOAT32.compute)], [np.empty(0, np.int64)]
    at = 0
    for entry in manifest[split]["shards"]:
        n = entry["num_samples"]
        start, stop = max(lo - at, 0), min(hi - at, n)
        if start < stop:
            x, y = _read_shard(data_dir, entry, shape, manifest["num_classes"], start, stop)
            x = x.reshape(len(x), -1)
            xs.append(x if raw else _to_float(x))
            ys.append(y.astype(np.int64))
        at += n
    return np.concatenate(xs), np.concatenate(ys)
