"""Blends: training on several prepared text sets at once, each drawn with a
weight (issue 57 §5, Megatron's blended dataset), the same windows on any
number of workers and exact on resume.

    sets = parse_blend("data/web:0.7,data/books:0.3")     # [(Path, weight)], None for a plain directory
    reader = BlendReader(sets, worker, num_workers, batch_size, seed, block_size=64)
    x, y = reader.next_batch()                            # as TokenReader's
    print(describe_blend(sets, 64))                       # the mix, for a start line

The blend is a stream of samples j = 0, 1, 2, ...: sample j is drawn from
set schedule[j % PERIOD], where the schedule gives each set its weight's
share of a period of PERIOD samples (largest remainders), placed by
Megatron's rule (each slot to the set whose count lags its share the most),
so any stretch of samples holds each set's share to within a few samples.
A set's k-th sample (k: the samples of that set before j, computed from the
period, not counted) is window perm[k mod n] of its epoch k // n, perm a
permutation of its n windows from (seed, set, epoch), computed per window
(reader.permuted, never held): each set's windows
once per its own epoch, a small set repeated more often than a large one,
as its weight says. A step takes samples W*B at a time, worker w the w-th
B of them, so sample j's window is a pure function of (sets, seed, j): the
same on any number of workers, and a position (0, j) resumes anywhere.
The sets must hold one vocabulary (vocab.same: the same tokenizer, not
just the same size). No MPI here (house rule).
"""

import math
from pathlib import Path

import numpy as np

from hpctrain.base.errors import HpctrainError

from .manifest import load_manifest
from .reader import ARRAYS, permuted
from .tokens import TokenShards
from .vocab import describe, load_vocabulary, same

PERIOD = 10_000   # samples over which the schedule gives every set its share (weights to 1/PERIOD)


def parse_blend(spec):
    """[(Path, weight)] of `DIR_A:0.7,DIR_B:0.3`, weights normalised to sum
    to 1; None where spec names one directory (no weight given)."""
    spec = str(spec)
    parts = spec.split(",")
    weighted = [p.rpartition(":") for p in parts]
    if len(parts) == 1 and not _is_weight(weighted[0][2]):
        return None
    sets = []
    for part, (path, colon, weight) in zip(parts, weighted):
        if not (colon and path and _is_weight(weight)):
            raise HpctrainError(f"--data {spec}: a blend is DIR:WEIGHT,DIR:WEIGHT,... (a positive weight each), "
                                f"got {part!r}")
        sets.append((Path(path), float(weight)))
    total = sum(w for _, w in sets)
    if len({p.resolve() for p, _ in sets}) < len(sets):
        raise HpctrainError(f"--data {spec}: a directory given twice; give it once with the sum of its weights")
    return [(p, w / total) for p, w in sets]


def _is_weight(text):
    try:
        value = float(text)
    except ValueError:
        return False
    return math.isfinite(value) and value > 0


def schedule(weights, period=PERIOD):
    """(sets, nth): int arrays over one period's slots: the set of each
    slot, and how many earlier slots of the period went to that set; and
    the quotas, each set's slots per period (largest remainders of
    weight x period, each at least 1)."""
    share = np.asarray(weights, np.float64) * period
    quotas = np.floor(share).astype(np.int64)
    for i in np.argsort(-(share - quotas), kind="stable")[:period - int(quotas.sum())]:
        quotas[i] += 1
    if (quotas == 0).any():
        raise HpctrainError(f"a blend's weight below 1/{period} draws nothing; give each set more weight")
    sets, nth = np.empty(period, np.int64), np.empty(period, np.int64)
    counts = [0] * len(quotas)
    for s in range(period):   # Megatron's rule: the set furthest behind its share (the first, on a tie)
        lag = [q * (s + 1) / period - c for q, c in zip(quotas.tolist(), counts)]
        i = lag.index(max(lag))
        sets[s], nth[s] = i, counts[i]
        counts[i] += 1
    return sets, nth, quotas


def check_blend(sets, block_size):
    """[(manifest, vocabulary)] of the sets once each is prepared text with
    at least one window of block_size + 1 tokens, all of one vocabulary."""
    found = []
    for path, _ in sets:
        manifest = load_manifest(path)
        if manifest.get("kind") != "tokens":
            raise HpctrainError(f"{path}: holds images, not text; a blend's sets are prepared text (prepare --text)")
        vocab = load_vocabulary(path, manifest)
        if found and not same(found[0][1], vocab):
            raise HpctrainError(f"{path}: its vocabulary, {describe(vocab)}, is not {sets[0][0]}'s, "
                                f"{describe(found[0][1])}: a blend's sets must be encoded with one tokenizer")
        if int(manifest["train"]["num_tokens"]) <= block_size:
            raise HpctrainError(f"{path}: {manifest['train']['num_tokens']} training tokens hold no window of "
                                f"--block-size {block_size} + 1")
        found.append((manifest, vocab))
    return found


def describe_blend(sets, block_size):
    """The mix in a line: each set's share and its training windows."""
    found = check_blend(sets, block_size)
    return ", ".join(f"{path} {weight:.1%} ({int(m['train']['num_tokens']) - block_size} windows)"
                     for (path, weight), (m, _) in zip(sets, found))


class BlendReader:
    """Training windows for one of W workers from a blend of text sets: the
    samples j of the blend's stream (module docstring), W*B a step, worker w
    the w-th B. position is (0, j), the samples taken by all workers; seek
    takes it from a run of any W. next_batch() returns arrays that the next
    call overwrites, as TokenReader's."""

    unit = "windows"

    def __init__(self, sets, worker, num_workers, batch_size, seed, block_size, arrays=ARRAYS):
        if not (isinstance(num_workers, (int, np.integer)) and num_workers >= 1
                and isinstance(worker, (int, np.integer)) and 0 <= worker < num_workers):
            raise HpctrainError(f"worker must be in 0..num_workers - 1, got {worker!r} of {num_workers!r}")
        if not (isinstance(batch_size, (int, np.integer)) and batch_size >= 1):
            raise HpctrainError(f"--batch-size must be a positive integer, got {batch_size!r}")
        if not (isinstance(block_size, (int, np.integer)) and block_size >= 1):
            raise HpctrainError(f"--block-size must be a positive integer, got {block_size!r}")
        self.sets = list(sets)
        self.worker, self.num_workers = int(worker), int(num_workers)
        self.batch_size, self.seed, self.block_size = int(batch_size), int(seed), int(block_size)
        found = check_blend(self.sets, self.block_size)
        self.data_dir = self.sets[0][0]
        self.vocab_size = int(found[0][0]["vocab_size"])
        self.shards = [TokenShards(path, "train", m) for (path, _), (m, _) in zip(self.sets, found)]
        self.windows = [s.num_tokens - self.block_size for s in self.shards]
        self.num_samples = sum(self.windows)
        self._slots, self._nth, self._quotas = schedule([w for _, w in self.sets])
        self._pos = 0
        self._ids = np.empty(0, np.int64)
        self._rows = np.empty((self.batch_size, self.block_size + 1), self.shards[0].dtype)
        shape = (self.batch_size, self.block_size)
        self._x = np.empty(shape, np.int64) if "images" in arrays else None
        self._y = np.empty(shape, np.int64) if "labels" in arrays else None

    @property
    def position(self):
        return 0, self._pos

    def seek(self, epoch, pos):
        if epoch != 0 or pos < 0:
            raise HpctrainError(f"a blend resumes from (0, samples taken), got epoch {epoch}, position {pos}")
        self._pos = int(pos)

    @property
    def last_ids(self):
        """The blend's sample numbers j of the last batch (unique over the run)."""
        return self._ids

    @property
    def last_draw(self):
        return 0, self._ids

    def locate(self, samples):
        """(set, window offset) of each of the blend's samples j."""
        samples = np.asarray(samples, np.int64)
        slot = samples % PERIOD
        sets = self._slots[slot]
        k = samples // PERIOD * self._quotas[sets] + self._nth[slot]   # the set's own sample number
        offsets = np.empty_like(samples)
        for i in np.unique(sets).tolist():
            mine = sets == i
            epoch, at = np.divmod(k[mine], self.windows[i])
            for e in np.unique(epoch).tolist():   # a batch may cross the set's epochs
                offsets[np.flatnonzero(mine)[epoch == e]] = permuted(self.windows[i], (self.seed, i, e),
                                                                     at[epoch == e])
        return sets, offsets

    def next_batch(self):
        W, B = self.num_workers, self.batch_size
        self._ids = np.arange(self._pos + self.worker * B, self._pos + (self.worker + 1) * B, dtype=np.int64)
        self._pos += W * B
        sets, offsets = self.locate(self._ids)
        for i in np.unique(sets).tolist():
            mine = np.flatnonzero(sets == i)
            self._rows[mine] = self.shards[i].windows(offsets[mine], self.block_size + 1)
        if self._x is not None:
            self._x[...] = self._rows[:, :-1]
        if self._y is not None:
            self._y[...] = self._rows[:, 1:]
        return self._x, self._y
