"""Reading prepared text (`prepare --text`) in place: a worker's training
windows and a rank's part of the held-out windows, read from the shards as
they are needed, never the whole corpus.

    reader = TokenReader("data/shakespeare-chars", worker, num_workers, batch_size, seed, block_size=64)
    x, y = reader.next_batch()          # int64 (B, T) token ids, int64 (B, T) the next tokens
    x, y = load_test_windows("data/shakespeare-chars", 64, part, parts)
    x, y = load_test_windows("data/shakespeare-chars", 64, eval_tokens=8192)   # 128 windows, evenly spaced

A training sample is a window of T+1 tokens of the training split starting
at any offset (x its first T, y its last T); an epoch is one permutation of
every window offset, a pure function of (seed, epoch), dealt over the
workers step by step as reader.py deals images (`deal`): any number of
workers sees the same windows, and the W batches of a step, in worker
order, are the one batch of W*B a single worker would take. The
permutation is never held: a batch's entries of it are computed when the
batch is taken (reader.permuted, a Feistel bijection over the window
offsets), so a reader's memory does not grow with the corpus.
The held-out split is read as consecutive non-overlapping windows (every
token predicted once), cut into contiguous parts like load_test's; with
`eval_tokens` N (--eval-tokens) only an evenly spaced sample of them
(`eval_windows`), the same sample on any number of parts, and only the
sample's windows are read.

A split's shards (`TokenShards`) are opened and checked against the manifest
at the start without reading their tokens: each file's size, its HDF5
header, a 1-D `tokens` dataset of the listed length and dtype. An
uncompressed contiguous dataset (what prepare writes) is read at its offset
in the file (pread, into the batch: not memory-mapped, so that resident
memory does not grow with the pages a long run touches); a chunked or
compressed one is read through h5py's slicing. The ids are checked where they are read: one at or above the
vocabulary is one line naming the shard and the offset. Hashes are not
computed at the start (their cost grows with the corpus): `hpctrain data
verify DIR` recomputes them (verify.py). No MPI here (house rule): callers
pass worker numbers, not ranks.

    python -c "from hpctrain.data.tokens import TokenReader as R; print(R('data/shakespeare-chars', 0, 1, 12, 0, 64).num_samples)"
"""

import bisect
import itertools
import os
from pathlib import Path

import h5py
import numpy as np

from hpctrain.base.chunks import chunk_parts
from hpctrain.base.errors import HpctrainError

from .manifest import MANIFEST, load_manifest
from .reader import ARRAYS, Dealt, _describe, _open_h5, _unreadable, permuted

# h5py's chunk cache per shard read through it (chunked or compressed
# shards, written before prepare wrote them contiguous): a gzip chunk of 1M
# tokens is decompressed once for the windows in it, not once per window.
_CHUNK_CACHE_BYTES = 16 << 20


def _token_manifest(data_dir):
    manifest = load_manifest(data_dir)
    if manifest.get("kind") != "tokens":
        raise HpctrainError(f"{data_dir}: holds images, not text; prepare text with: "
                            f"hpctrain data prepare --source FILE.txt --out DIR --text chars")
    return manifest


class _InFile:
    """A contiguous, uncompressed dataset's n tokens, read with pread(2) at
    their offset in the shard's file straight into the caller's array. Not
    memory-mapped: a map's touched pages count in the process's resident
    memory (peak_rss_mb) and would grow toward the corpus's size over a
    long run; a read leaves nothing behind but the batch it filled."""

    def __init__(self, path, offset, n, dtype):
        self.offset, self.n, self.itemsize = offset, n, dtype.itemsize
        self.fd = os.open(path, os.O_RDONLY)

    def __len__(self):
        return self.n

    def read_into(self, lo, out):
        want = out.nbytes
        if os.preadv(self.fd, [out], self.offset + lo * self.itemsize) != want:
            raise OSError(f"a short read at token {lo}: the file was cut")

    def __del__(self):
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)


class _InHDF5:
    """A chunked or compressed dataset (or an empty one), read through h5py's
    slicing; the file stays open while this lives."""

    def __init__(self, tokens):
        self.tokens = tokens

    def __len__(self):
        return len(self.tokens)

    def read_into(self, lo, out):
        self.tokens.read_direct(out, np.s_[lo:lo + len(out)])


def _open_shard(data_dir, entry, dtype):
    """(path, reader) of one token shard once its size and header match the
    manifest: _InFile where the dataset is stored contiguous and
    uncompressed (prepare's), else _InHDF5. No token is read here."""
    path = Path(data_dir) / entry["file"]
    if not path.is_file():
        raise HpctrainError(f"{path}: missing shard (listed in {MANIFEST}); prepare again with --force")
    size = path.stat().st_size
    if "bytes" in entry and size != entry["bytes"]:
        raise HpctrainError(f"{path}: corrupt shard ({size} bytes, manifest says {entry['bytes']}); "
                            f"prepare again with --force")
    n = entry["num_tokens"]
    try:
        f = _open_h5(path, rdcc_nbytes=_CHUNK_CACHE_BYTES)
        tokens = f.get("tokens")
        if not (isinstance(tokens, h5py.Dataset) and tokens.shape == (n,) and tokens.dtype == dtype):
            found = _describe(tokens)
            f.close()
            raise HpctrainError(f"{path}: bad shard: expected {dtype} tokens ({n},), found {found}")
        at = tokens.id.get_offset() if tokens.chunks is None and not tokens.compression else None
        if at is None:
            return path, _InHDF5(tokens)
        f.close()
    except OSError as e:
        raise _unreadable(path, e) from None
    if at + n * dtype.itemsize > size:
        raise HpctrainError(f"{path}: corrupt shard (its tokens end past the file's {size} bytes); "
                            f"prepare again with --force")
    return path, _InFile(path, at, n, dtype)


class TokenShards:
    """A split's token stream, its shards in order, read in place: opened and
    checked at construction (`_open_shard`: sizes and headers, no tokens
    read), then `read(start, stop)` and `windows(offsets, length, out)` read
    only what they are asked, each id checked below vocab_size."""

    def __init__(self, data_dir, split="train", manifest=None):
        manifest = _token_manifest(data_dir) if manifest is None else manifest
        if split not in manifest:
            raise HpctrainError(f"{data_dir}: no {split} split")
        self.dtype, self.vocab_size = np.dtype(manifest["dtype"]), int(manifest["vocab_size"])
        self._shards = [_open_shard(data_dir, e, self.dtype) for e in manifest[split]["shards"]]
        # Python ints, found by bisect: a batch is a dozen windows, NumPy's per-call cost would dominate.
        self._starts = [0, *itertools.accumulate(int(e["num_tokens"]) for e in manifest[split]["shards"])]
        self.num_tokens = self._starts[-1]

    def _read_into(self, start, out):
        """out[:] = tokens start .. start + len(out), across shards where the range does."""
        done, n = 0, len(out)
        i = bisect.bisect_right(self._starts, start) - 1
        while done < n:
            path, ids = self._shards[i]
            lo = start + done - self._starts[i]
            m = min(len(ids) - lo, n - done)
            try:
                ids.read_into(lo, out if m == n else out[done:done + m])
            except OSError as e:
                raise _unreadable(path, e) from None
            done += m
            i += 1

    def _check(self, rows, starts):
        """Every id of rows (k, L), row r being tokens starts[r] .. starts[r] + L,
        below vocab_size: an id past the vocabulary would index past the
        embedding (or its negative twin, silently, through NumPy)."""
        bad = np.flatnonzero(rows.reshape(-1) >= self.vocab_size)
        if len(bad):
            r, c = divmod(int(bad[0]), rows.shape[1])
            at = int(starts[r]) + c
            i = bisect.bisect_right(self._starts, at) - 1
            raise HpctrainError(f"{self._shards[i][0]}: token {int(rows[r, c])} at {at - self._starts[i]} "
                                f"is not below the manifest's vocab_size {self.vocab_size}; "
                                f"prepare again with --force")

    def read(self, start=0, stop=None):
        """Tokens start .. stop of the split (a new array), checked."""
        stop = self.num_tokens if stop is None else stop
        if not 0 <= start <= stop <= self.num_tokens:
            raise HpctrainError(f"tokens {start}..{stop} of a split of {self.num_tokens}")
        out = np.empty(stop - start, self.dtype)
        self._read_into(start, out)
        self._check(out.reshape(1, -1), [start])
        return out

    def windows(self, offsets, length, out=None):
        """(k, length) tokens: row r the `length` tokens from offsets[r], checked."""
        out = np.empty((len(offsets), length), self.dtype) if out is None else out
        for row, at in zip(out, np.asarray(offsets).tolist()):
            self._read_into(at, row)
        self._check(out, offsets)
        return out


def read_tokens(data_dir, split="train", manifest=None):
    """The whole token stream of a split (its shards in order), checked:
    the readers never call it (they read windows in place); tools and tests do."""
    return TokenShards(data_dir, split, manifest).read()


class TokenReader(Dealt):
    """Training windows for one of W workers: ShardReader's dealing (reader.py
    `deal`) over the window offsets 0 .. n - T - 1 of the n training tokens,
    so position, seek and resuming on another number of workers mean what
    they mean for images. Only a batch's windows are read, from the shards
    in place (`TokenShards`). `arrays` names what next_batch gives, a part of
    reader.ARRAYS: "images" the inputs x, "labels" the targets y (a
    pipeline's first and last stage); what it does not give is None.
    next_batch() returns arrays that the next call overwrites: copy them if
    they must outlive the step."""

    unit = "windows"

    def __init__(self, data_dir, worker, num_workers, batch_size, seed, block_size, arrays=ARRAYS):
        super().__init__(data_dir, worker, num_workers, batch_size, seed)
        if not (isinstance(block_size, (int, np.integer)) and block_size >= 1):
            raise HpctrainError(f"--block-size must be a positive integer, got {block_size!r}")
        self.block_size = int(block_size)
        manifest = _token_manifest(self.data_dir)
        self.vocab_size = int(manifest["vocab_size"])
        self.shards = TokenShards(self.data_dir, "train", manifest)
        n = self.shards.num_tokens
        self.num_samples = max(0, n - self.block_size)   # window offsets: the training set
        per_step = self.num_workers * self.batch_size
        if self.num_samples < per_step:
            raise HpctrainError(f"{self.data_dir}: {n} training tokens hold {self.num_samples} "
                                f"windows of --block-size {self.block_size} + 1, fewer than one step takes "
                                f"({self.num_workers} workers x --batch-size {self.batch_size} = {per_step}); "
                                f"use a smaller --block-size or --batch-size, or fewer workers")
        shape = (self.batch_size, self.block_size)
        self._rows = np.empty((self.batch_size, self.block_size + 1), self.shards.dtype)
        self._x = np.empty(shape, np.int64) if "images" in arrays else None
        self._y = np.empty(shape, np.int64) if "labels" in arrays else None

    def _deal(self):
        """The epoch's steps from the current position; no ids held: a
        batch's are computed when it is taken (next_batch: `permuted`)."""
        per_step = self.num_workers * self.batch_size
        while (self.num_samples - self._start) // per_step == 0:   # nothing left to deal: the next epoch
            self._epoch, self._start = self._epoch + 1, 0
        self._steps, self._taken = (self.num_samples - self._start) // per_step, 0

    @property
    def last_ids(self):
        return self._ids

    def next_batch(self):
        """(x int64 (B, T), y int64 (B, T)): windows' tokens and the tokens
        after them; both reused by the next call; either None where the
        reader does not give it."""
        t, B = self._next(), self.batch_size
        at = self._start + (t * self.num_workers + self.worker) * B   # this worker's B of the step's W x B
        self._ids = permuted(self.num_samples, (self.seed, self._epoch), np.arange(at, at + B))
        rows = self.shards.windows(self._ids, self.block_size + 1, self._rows)
        if self._x is not None:
            self._x[...] = rows[:, :-1]
        if self._y is not None:
            self._y[...] = rows[:, 1:]
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
    `eval_windows` takes, cut into parts the same way. Only the part's
    windows are read (in place: TokenShards)."""
    if not (isinstance(parts, (int, np.integer)) and parts >= 1 and 0 <= part < parts):
        raise HpctrainError(f"load_test_windows: part must be in 0..parts-1 with parts >= 1, "
                            f"got part={part!r}, parts={parts!r}")
    if not (isinstance(block_size, (int, np.integer)) and block_size >= 1):
        raise HpctrainError(f"--block-size must be a positive integer, got {block_size!r}")
    shards = TokenShards(data_dir, split)
    count = (shards.num_tokens - 1) // block_size
    if count == 0:
        raise HpctrainError(f"{data_dir}: the {split} split's {shards.num_tokens} tokens hold no window of "
                            f"--block-size {block_size} + 1; prepare with a larger --val-fraction")
    windows = eval_windows(count, block_size, eval_tokens)
    lo, hi = chunk_parts(len(windows), parts)[part]
    if len(windows) == count:   # every window: one read of the part's stretch
        stretch = shards.read(lo * block_size, hi * block_size + 1)
        x = stretch[:-1].reshape(hi - lo, block_size).astype(np.int64)
        y = stretch[1:].reshape(hi - lo, block_size).astype(np.int64)
        return x, y
    rows = shards.windows(windows[lo:hi] * block_size, block_size + 1)
    return rows[:, :-1].astype(np.int64), rows[:, 1:].astype(np.int64)
