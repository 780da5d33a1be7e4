"""Reading prepared text (`prepare --text`): a worker's training windows and
a rank's part of the held-out windows.

    reader = TokenReader("data/shakespeare-chars", worker, num_workers, batch_size, seed, block_size=64)
    x, y = reader.next_batch()          # int64 (B, T) token ids, int64 (B, T) the next tokens
    x, y = load_test_windows("data/shakespeare-chars", 64, part, parts)
    x, y = load_test_windows("data/shakespeare-chars", 64, eval_tokens=8192)   # 128 windows, evenly spaced

A training sample is a window of T+1 tokens of the training split starting
at any offset (x its first T, y its last T); an epoch is one permutation of
every window offset, a pure function of (seed, epoch), dealt over the
workers step by step exactly as reader.py deals images (`deal`): any number
of workers sees the same windows, and the W batches of a step, in worker
order, are the one batch of W*B a single worker would take. The held-out
split is read as consecutive non-overlapping windows (every token predicted
once), cut into contiguous parts like load_test's; with `eval_tokens` N
(--eval-tokens) only an evenly spaced sample of them (`eval_windows`),
the same sample on any number of parts. Every shard is checked
against the manifest (sha256, dtype, length, ids below vocab_size) first.
No MPI here (house rule): callers pass worker numbers, not ranks.

    python -c "from hpctrain.data.tokens import TokenReader as R; print(R('data/shakespeare-chars', 0, 1, 12, 0, 64).num_samples)"
"""

from pathlib import Path

import h5py
import numpy as np

from hpctrain.base.chunks import chunk_parts
from hpctrain.base.errors import HpctrainError

from .manifest import MANIFEST, _sha256, load_manifest
from .reader import ARRAYS, Dealt, _describe, _open_h5, _unreadable


def _token_manifest(data_dir):
    manifest = load_manifest(data_dir)
    if manifest.get("kind") != "tokens":
        raise HpctrainError(f"{data_dir}: holds images, not text; prepare text with: "
                            f"hpctrain data prepare --source FILE.txt --out DIR --text chars")
    return manifest


def _read_shard(data_dir, entry, manifest):
    """One token shard's ids, once it matches the manifest: its sha256, a 1-D
    `tokens` dataset of the listed length and dtype, every id below vocab_size."""
    path = Path(data_dir) / entry["file"]
    if not path.is_file():
        raise HpctrainError(f"{path}: missing shard (listed in {MANIFEST}); prepare again with --force")
    got = _sha256(path)
    if got != entry["sha256"]:
        raise HpctrainError(f"{path}: corrupt shard (sha256 {got[:12]}..., manifest says "
                            f"{entry['sha256'][:12]}...); prepare again with --force")
    n, dtype = entry["num_tokens"], np.dtype(manifest["dtype"])
    try:
        with _open_h5(path) as f:
            tokens = f.get("tokens")
            if not (isinstance(tokens, h5py.Dataset) and tokens.shape == (n,) and tokens.dtype == dtype):
                raise HpctrainError(f"{path}: bad shard: expected {dtype} tokens ({n},), found {_describe(tokens)}")
            ids = tokens[:]
    except OSError as e:
        raise _unreadable(path, e) from None
    # An id past the vocabulary would index past the embedding (or its
    # negative twin, silently, through NumPy).
    bad = np.flatnonzero(ids >= manifest["vocab_size"])
    if len(bad):
        raise HpctrainError(f"{path}: token {int(ids[bad[0]])} at {int(bad[0])} is not below the manifest's "
                            f"vocab_size {manifest['vocab_size']}; prepare again with --force")
    return ids


def read_tokens(data_dir, split="train", manifest=None):
    """The whole token stream of a split (its shards in order), checked."""
    manifest = _token_manifest(data_dir) if manifest is None else manifest
    if split not in manifest:
        raise HpctrainError(f"{data_dir}: no {split} split")
    parts = [_read_shard(data_dir, e, manifest) for e in manifest[split]["shards"]]
    return np.concatenate(parts) if parts else np.empty(0, manifest["dtype"])


def _windows(tokens, offsets, block_size, x, y):
    """Windows of T+1 tokens at offsets: x their first T, y their last T."""
    at = offsets[:, None] + np.arange(block_size)
    if x is not None:
        x[...] = tokens[at]
    if y is not None:
        y[...] = tokens[at + 1]


class TokenReader(Dealt):
    """Training windows for one of W workers: ShardReader's dealing (reader.py
    `deal`) over the window offsets 0 .. n - T - 1 of the n training tokens,
    so position, seek and resuming on another number of workers mean what
    they mean for images. The training tokens are held whole (1 or 2 bytes
    each). `arrays` names what next_batch gives, a part of reader.ARRAYS:
    "images" the inputs x, "labels" the targets y (a pipeline's first and
    last stage); what it does not give is None. next_batch() returns arrays
    that the next call overwrites: copy them if they must outlive the step."""

    unit = "windows"

    def __init__(self, data_dir, worker, num_workers, batch_size, seed, block_size, arrays=ARRAYS):
        super().__init__(data_dir, worker, num_workers, batch_size, seed)
        if not (isinstance(block_size, (int, np.integer)) and block_size >= 1):
            raise HpctrainError(f"--block-size must be a positive integer, got {block_size!r}")
        self.block_size = int(block_size)
        manifest = _token_manifest(self.data_dir)
        self.vocab_size = int(manifest["vocab_size"])
        self.tokens = read_tokens(self.data_dir, "train", manifest)
        self.num_samples = max(0, len(self.tokens) - self.block_size)   # window offsets: the training set
        per_step = self.num_workers * self.batch_size
        if self.num_samples < per_step:
            raise HpctrainError(f"{self.data_dir}: {len(self.tokens)} training tokens hold {self.num_samples} "
                                f"windows of --block-size {self.block_size} + 1, fewer than one step takes "
                                f"({self.num_workers} workers x --batch-size {self.batch_size} = {per_step}); "
                                f"use a smaller --block-size or --batch-size, or fewer workers")
        shape = (self.batch_size, self.block_size)
        self._x = np.empty(shape, np.int64) if "images" in arrays else None
        self._y = np.empty(shape, np.int64) if "labels" in arrays else None

    def next_batch(self):
        """(x int64 (B, T), y int64 (B, T)): windows' tokens and the tokens
        after them; both reused by the next call; either None where the
        reader does not give it."""
        self._next()
        _windows(self.tokens, self.last_ids, self.block_size, self._x, self._y)
        return self._x, self._y


def eval_windows(count, block_size, eval_tokens=None):
    """The windows an evaluation scores, of the `count` consecutive windows
    of `block_size` tokens: all of them, or, where they hold more than
    `eval_tokens` tokens (--eval-tokens N), N // T of them (at least one),
    evenly spaced over the split: window floor(i * count / k) for i < k.
    A pure function of (count, T, N): no seed, no rank, so every evaluation
    of a run (periodic, --keep-best, final) and `hpctrain evaluate` score the
    same windows on any number of ranks. Evenly spaced, not drawn at random:
    a held-out tail is a stretch of one text (the end of the last plays), and
    a systematic sample covers it from beginning to end, where a random one
    of a few hundred windows may cluster."""
    if eval_tokens is None or count * block_size <= eval_tokens:
        return np.arange(count)
    k = max(1, int(eval_tokens) // block_size)
    return np.arange(k, dtype=np.int64) * count // k   # k < count: distinct, increasing


def load_test_windows(data_dir, block_size, part=0, parts=1, split="test", eval_tokens=None):
    """Contiguous part `part` of `parts` of the held-out split's consecutive
    non-overlapping windows: (x int64 (n, T), y int64 (n, T)), window k
    being tokens kT .. kT+T. Together the parts cover every window once; a
    part is empty when parts exceeds them. eval_tokens: only the sample
    `eval_windows` takes, cut into parts the same way."""
    if not (isinstance(parts, (int, np.integer)) and parts >= 1 and 0 <= part < parts):
        raise HpctrainError(f"load_test_windows: part must be in 0..parts-1 with parts >= 1, "
                            f"got part={part!r}, parts={parts!r}")
    if not (isinstance(block_size, (int, np.integer)) and block_size >= 1):
        raise HpctrainError(f"--block-size must be a positive integer, got {block_size!r}")
    tokens = read_tokens(data_dir, split)
    count = (len(tokens) - 1) // block_size
    if count == 0:
        raise HpctrainError(f"{data_dir}: the {split} split's {len(tokens)} tokens hold no window of "
                            f"--block-size {block_size} + 1; prepare with a larger --val-fraction")
    windows = eval_windows(count, block_size, eval_tokens)
    lo, hi = chunk_parts(len(windows), parts)[part]
    x = np.empty((hi - lo, block_size), np.int64)
    y = np.empty_like(x)
    _windows(tokens, windows[lo:hi] * block_size, block_size, x, y)
    return x, y
