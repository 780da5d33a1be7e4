"""Reading prepared shards: a worker's training batches and a rank's share of the test set.

    reader = ShardReader("data/mnist", worker, num_workers, batch_size, seed)
    x, y = reader.next_batch()          # float32 (B, 784) in [0, 1], int64 (B,)
    x, y = load_test("data/mnist", part, parts)

Each worker opens only its own shards (or its own slice of one shard), each
checked against the manifest (sha256, shapes, dtypes) before it is used.
No MPI here (house rule): callers pass worker numbers, not ranks.

    python -c "from hpctrain.data import ShardReader; print(ShardReader('data/mnist', 0, 1, 64, 0).num_samples)"
"""

import math
from pathlib import Path

import h5py
import numpy as np

from hpctrain.errors import HpctrainError

from .manifest import MANIFEST, _sha256, load_manifest


def _open_h5(path):
    # Many ranks open the same shard; HDF5's file locks fail on some parallel
    # filesystems and buy nothing for read-only access.
    try:
        return h5py.File(path, "r", locking=False)
    except (TypeError, ValueError):  # h5py < 3.5, or HDF5 too old for the option
        return h5py.File(path, "r")


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


def _read_rows(path, start, stop, num_classes):
    """Rows [start, stop) of a verified shard, its labels checked."""
    try:
        with _open_h5(path) as f:
            x, y = f["images"][start:stop], f["labels"][start:stop]
    except OSError as e:
        raise _unreadable(path, e) from None
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


def _bounds(n, parts):
    """Near-equal contiguous split of range(n): part i is [b[i], b[i+1])."""
    return [(i * n) // parts for i in range(parts + 1)]


def _to_float(images, out=None):
    # Divide in float32 (not multiply by 1/255) so training batches and the
    # test set see bit-identical pixel values.
    return np.divide(images, 255, out=out, dtype=np.float32)


def _worker_reads(shards, worker, num_workers):
    """[(entry, start, stop)]: the rows of which shards this worker reads."""
    S, W, w = len(shards), num_workers, worker
    if W <= S:
        return [(shards[s], 0, shards[s]["num_samples"]) for s in range(w, S, W)]
    sharing = len(range(w % S, W, S))
    b = _bounds(shards[w % S]["num_samples"], sharing)
    j = w // S
    return [(shards[w % S], b[j], b[j + 1])]


class ShardReader:
    """Training batches for one worker, from its own shards only.

    With S shards and W <= S workers, worker w loads shards w, w+W, w+2W, ...
    With W > S, the workers sharing shard w % S each load a near-equal,
    contiguous slice of it. Either way the workers' parts are disjoint and
    together cover the training set. The part is held in memory as uint8.

    next_batch() returns arrays that the next call overwrites: copy them if
    they must outlive the step. position/seek make the batch sequence resumable.
    """

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

        manifest = load_manifest(self.data_dir)
        shape = tuple(manifest["image_shape"])
        self.num_features = math.prod(shape)
        self.num_classes = int(manifest["num_classes"])
        shards = manifest["train"]["shards"]
        total = manifest["train"]["num_samples"]
        if self.num_workers > total:
            raise HpctrainError(f"{self.data_dir}: more workers ({self.num_workers}) than "
                                f"training samples ({total})")
        reads = _worker_reads(shards, self.worker, self.num_workers)
        self._load(reads, shape, self.num_classes)
        self.files = [entry["file"] for entry, _, _ in reads]
        self.num_samples = len(self.labels)
        if self.num_samples == 0:
            S, W, w = len(shards), self.num_workers, self.worker
            entry = reads[0][0]
            raise HpctrainError(
                f"{self.data_dir}: worker {w} of {W} gets no training samples "
                f"({entry['file']} has {entry['num_samples']} samples for "
                f"{len(range(w % S, W, S))} workers); use fewer workers or more shards")

        self._epoch, self._offset = 0, 0
        self._perm_epoch, self._perm = None, None
        self._ubuf = np.empty((self.batch_size, self.num_features), np.uint8)
        self._x = np.empty((self.batch_size, self.num_features), np.float32)
        self._y = np.empty(self.batch_size, np.int64)

    def _load(self, reads, shape, num_classes):
        # Every shard matches the manifest before the manifest's sizes are
        # allocated. Then each part is read straight into its place: peak
        # memory is the worker's data plus one part, not twice the data.
        paths = [_verify_shard(self.data_dir, entry, shape) for entry, _, _ in reads]
        count = sum(stop - start for _, start, stop in reads)
        try:
            self.images = np.empty((count, self.num_features), np.uint8)
            self.labels = np.empty(count, np.int64)
        except (MemoryError, ValueError):
            raise HpctrainError(f"{self.data_dir}: worker {self.worker}'s part ({count} samples "
                                f"of {self.num_features} values) does not fit in memory; use "
                                f"more workers") from None
        at = 0
        for path, (_, start, stop) in zip(paths, reads):
            x, y = _read_rows(path, start, stop, num_classes)
            self.images[at: at + len(x)] = x.reshape(len(x), -1)
            self.labels[at: at + len(y)] = y
            at += len(x)
            del x, y

    @property
    def position(self):
        """(epoch, offset) of the next batch; pass it to seek() to resume there."""
        return self._epoch, self._offset

    def seek(self, epoch, offset):
        n, B = self.num_samples, self.batch_size
        if epoch < 0 or offset < 0 or (offset > 0 and offset + B > n) or offset % B:
            raise HpctrainError(f"{self.data_dir}: cannot seek worker {self.worker} to "
                                f"epoch {epoch}, offset {offset} ({n} samples, batch {B})")
        self._epoch, self._offset = int(epoch), int(offset)

    def _permutation(self):
        if self._perm_epoch != self._epoch:
            rng = np.random.default_rng([self.seed, self._epoch, self.worker])
            self._perm, self._perm_epoch = rng.permutation(self.num_samples), self._epoch
        return self._perm

    def next_batch(self):
        """(x float32 (B, features) in [0, 1], y int64 (B,)); both reused by the next call."""
        n, B = self.num_samples, self.batch_size
        perm = self._permutation()
        if n >= B:
            idx = perm[self._offset:self._offset + B]
        else:
            # A part smaller than one batch still yields full batches, one epoch each.
            idx = np.resize(perm, B)
        self._offset += B
        if self._offset + B > n:
            # Drop the remainder rather than pad, so every batch is B distinct samples.
            self._epoch, self._offset = self._epoch + 1, 0
        np.take(self.images, idx, axis=0, out=self._ubuf, mode="clip")
        _to_float(self._ubuf, out=self._x)
        np.take(self.labels, idx, out=self._y, mode="clip")
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
    manifest = load_manifest(data_dir)
    shape = tuple(manifest["image_shape"])
    features = math.prod(shape)
    if split not in manifest:
        raise HpctrainError(f"{data_dir}: no {split} part; prepare again with --val-fraction F")
    b = _bounds(manifest[split]["num_samples"], parts)
    lo, hi = b[part], b[part + 1]
    xs, ys = [np.empty((0, features), np.uint8 if raw else np.float32)], [np.empty(0, np.int64)]
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
