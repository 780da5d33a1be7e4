"""Data for hpctrain: images (MNIST, Fashion-MNIST, KMNIST, EMNIST, CIFAR-10, and a
user's own images and arrays) and text (token shards): readers of each
source, HDF5 shard writers, the workers' readers and augmentation.

Turn IDX files into class-balanced HDF5 shards once, then let the workers
take their batches of each epoch's permutation of the training set from them:

    python -m hpctrain.data prepare --source data/mnist-5k --out data/mnist --shards 8
    python -m hpctrain.data fetch --dataset mnist --out data/raw/mnist
    python -m hpctrain.data prepare --source data/raw/mnist --out data/mnist --force
    python -m hpctrain.data prepare --source data/shakespeare/input.txt --out data/shakespeare-chars --text chars

In code: `ShardReader(dir, worker, num_workers, batch_size, seed).next_batch()`
for training batches, `load_test(dir, part, parts)` for a rank's share of the
test set (`load_test(dir, split="val")`: the --val-fraction part). Text:
`TokenReader(dir, worker, num_workers, batch_size, seed, block_size)`,
`load_test_windows(dir, block_size, part, parts)`, `load_vocabulary(dir)`.
No MPI here (house rule): callers pass worker numbers, not ranks.

One job per module:
    idx.py       IDX files (raw or gzip) -> uint8 arrays
    cifar.py     CIFAR-10 binary batches -> uint8 arrays
    file_errors.py a source file's open/read errors -> one HpctrainError line (idx, cifar)
    images.py    a folder of class folders of images (Pillow) -> uint8 arrays; one image -> a model input
    arrays.py    .npz, .npy, HDF5 and CSV sources -> uint8 arrays; the memory check before reading
    sources.py   which source a --source is (IDX, CIFAR-10, a user's files or folders) and its arrays
    prepare.py   any of the sources -> class-balanced HDF5 shards + manifest.json, atomically
    text.py      a text --source (a file, a folder's .txt files) -> bytes, checked (binary, empty, UTF-8)
    vocab.py     the text vocabularies (chars, bytes, a byte-level BPE with tokenizers): encode, decode
    prepare_text.py  text -> token shards (its last --val-fraction held out) + manifest.json, atomically
    tokens.py    TokenReader (training windows), load_test_windows (the held-out windows), read in place
    verify.py    every listed file's sha256 against the manifest (data verify)
    splits.py    the reader a directory takes (images or tokens): training batches, held-out parts
    fit.py       whether a model can read a directory: images or text, and a language model's vocabulary
    augment.py   --augment crop,flip: per sample, from (seed, epoch, sample id)
    fetch.py     download the published files, verify their MD5, unpack archives safely
    manifest.py  format constants, paths, load_manifest and its structure check
    reader.py    ShardReader (training batches), load_test (test or val set parts)
    __main__.py  the command line (python -m hpctrain.data prepare|fetch|verify)
"""

from .augment import check_dir as check_augment
from .fetch import CIFAR10_BATCHES, EMNIST_SPLITS, MD5, MIRRORS, STANDARD_FILES, extract, fetch
from .idx import read_idx
from .manifest import (FORMAT, FORMAT_VERSION, MANIFEST, bundled_sample_dir, bundled_text_path, default_data_dir,
                       input_kind, is_prepared, load_manifest, model_shape, repo_root,
                       shard_name, train_samples)
from .prepare import prepare
from .prepare_text import prepare_text
from .reader import ShardReader, has_val, load_test
from .tokens import TokenReader, load_test_windows, read_tokens
from .vocab import load_vocabulary

__all__ = [
    "CIFAR10_BATCHES", "EMNIST_SPLITS", "FORMAT", "FORMAT_VERSION", "MANIFEST", "MD5", "MIRRORS",
    "STANDARD_FILES", "extract",
    "ShardReader", "TokenReader", "bundled_sample_dir", "bundled_text_path", "check_augment", "default_data_dir", "fetch", "has_val", "is_prepared",
    "input_kind", "load_manifest", "load_test", "load_test_windows", "load_vocabulary", "model_shape", "prepare",
    "prepare_text", "read_idx", "read_tokens", "repo_root", "shard_name", "train_samples",
]
