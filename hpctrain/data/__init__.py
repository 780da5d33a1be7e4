"""Image data for hpctrain (MNIST, Fashion-MNIST, KMNIST, EMNIST, CIFAR-10, and a
user's own images and arrays): readers of each source, HDF5 shard writer, the
workers' shard reader and its augmentation.

Turn IDX files into class-balanced HDF5 shards once, then let the workers
take their batches of each epoch's permutation of the training set from them:

    python -m hpctrain.data prepare --source data/mnist-5k --out data/mnist --shards 8
    python -m hpctrain.data fetch --dataset mnist --out data/raw/mnist
    python -m hpctrain.data prepare --source data/raw/mnist --out data/mnist --force

In code: `ShardReader(dir, worker, num_workers, batch_size, seed).next_batch()`
for training batches, `load_test(dir, part, parts)` for a rank's share of the
test set (`load_test(dir, split="val")`: the --val-fraction part). No MPI here
(house rule): callers pass worker numbers, not ranks.

One job per module:
    idx.py       IDX files (raw or gzip) -> uint8 arrays
    cifar.py     CIFAR-10 binary batches -> uint8 arrays
    file_errors.py a source file's open/read errors -> one HpctrainError line (idx, cifar)
    images.py    a folder of class folders of images (Pillow) -> uint8 arrays; one image -> a model input
    arrays.py    .npz, .npy, HDF5 and CSV sources -> uint8 arrays; the memory check before reading
    sources.py   which source a --source is (IDX, CIFAR-10, a user's files or folders) and its arrays
    prepare.py   any of the sources -> class-balanced HDF5 shards + manifest.json, atomically
    augment.py   --augment crop,flip: per sample, from (seed, epoch, sample id)
    fetch.py     download the published files, verify their MD5, unpack archives safely
    manifest.py  format constants, paths, load_manifest and its structure check
    reader.py    ShardReader (training batches), load_test (test or val set parts)
    __main__.py  the command line (python -m hpctrain.data prepare|fetch)
"""

from .augment import check_dir as check_augment
from .fetch import CIFAR10_BATCHES, EMNIST_SPLITS, MD5, MIRRORS, STANDARD_FILES, extract, fetch
from .idx import read_idx
from .manifest import (FORMAT, FORMAT_VERSION, MANIFEST, bundled_sample_dir, default_data_dir,
                       input_kind, is_prepared, load_manifest, model_shape, repo_root,
                       shard_name)
from .prepare import prepare
from .reader import ShardReader, has_val, load_test

__all__ = [
    "CIFAR10_BATCHES", "EMNIST_SPLITS", "FORMAT", "FORMAT_VERSION", "MANIFEST", "MD5", "MIRRORS",
    "STANDARD_FILES", "extract",
    "ShardReader", "bundled_sample_dir", "check_augment", "default_data_dir", "fetch", "has_val", "is_prepared",
    "input_kind", "load_manifest", "load_test", "model_shape", "prepare", "read_idx", "repo_root",
    "shard_name",
]
