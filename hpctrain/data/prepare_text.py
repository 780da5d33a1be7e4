"""A text corpus -> token shards + manifest.json, atomically, streamed and
(under mpirun) in parallel (`prepare --text`).

    python -m hpctrain.data prepare --source data/shakespeare/input.txt --out data/shakespeare-chars --text chars
    python -m hpctrain.data prepare --source corpus/ --out data/corpus-bpe --text bpe:4096 --val-fraction 0.05
    python -m hpctrain.data prepare --source corpus/ --out data/corpus-gpt2 --text tokenizer:gpt2/tokenizer.json
    mpirun -n 4 python -m hpctrain.data prepare --source owt/ --out data/owt --text tokenizer:gpt2/ \\
        --text-field text --eot

or in code `prepare_text(source, out, text="chars")`, which returns the
manifest. The source (text.py: text, JSON Lines, Parquet, compressed, or a
folder of them) is cut into units of work, a pure function of its files;
rank r encodes units r, r + W, ... block by block (never the whole corpus
in memory) into temporary id files, the ranks meet to learn every unit's
token count, each writes the shards of its own units, they meet again to
learn the shards' sizes and hashes, and rank 0 writes the manifest and
renames the folder into place. The token stream, the shards and the
manifest are the same on any number of ranks. The vocabulary comes first:
chars from every character (a pass over the corpus, the ranks' characters
met), bytes as they are, bpe:N trained by rank 0 on the corpus's first
--tokenizer-sample-mb, or a given tokenizer.json (tokenizer:PATH, kept as
bpe:N's is). With --eot each document (a file, a JSON Lines record, a
Parquet row) ends with the tokenizer's end-of-text token (GPT-2's
<|endoftext|>; bpe:N reserves it), so a window may cross documents the way
GPT-2 trained; chars and bytes have none and refuse --eot.

The last round(F * n) tokens (F: --val-fraction, default 0.1), with --eot
moved to a document's start (whole documents held out), are the
held-out split, listed as both "test" and "val", so validation and the
final test read text training never saw; a unit's tokens before that point
are a training shard, those after it a test shard (one unit: the
train-00000-of-00001.h5 and test-00000-of-00001.h5 of before). Each shard
holds one dataset, `tokens`, uint8 when the vocabulary has at most 256
tokens, else uint16, stored contiguous and uncompressed, so that the
readers read windows at their offset in the file (tokens.py). The manifest
says `"kind": "tokens"` and records the vocabulary, the token counts, the
source files (sha256 of each, or of each piece of a file cut into units)
and every shard's sha256. Everything is written to a temporary sibling of
--out and renamed into place: --out is complete or untouched. No MPI here
(house rule): the command passes rank, size and `meet`, the ranks'
elementwise maximum of an array, each wait bounded (data/__main__.py).
"""

import hashlib
import shutil
import time
from pathlib import Path
from typing import Callable, NamedTuple

import h5py
import numpy as np

from hpctrain.base.errors import HpctrainError

from .manifest import FORMAT, FORMAT_VERSION, _sha256, shard_name, token_dtype
from .prepare import _check_not_input, _check_out, _install, _make_tmp, _resolve_out, _tmp_name
from .stopping import stops_cleanly, sweep_stale_tmps
from .text import piece_digest, plan_units, read_piece, source_files, unit_bytes_of
from .vocab import EOT, TOKENIZER, Bpe, Chars, end_of_text, load_tokenizer, parse_text, train_vocabulary

_PATH_BYTES = 4096        # the temporary folder's path, met as bytes (no pickle on the wire)
_COPY_TOKENS = 4 << 20    # ids copied from a unit's id file into its shards at a time


class _Job(NamedTuple):
    files: list
    units: list
    field: str
    bad: Callable
    rank: int
    size: int
    meet: Callable


def _together(job, step):
    """step() on every rank; where it raised an HpctrainError (or OSError) on any, every
    rank stops: the lowest such rank with its line, the others quietly
    (exit 2, report=False), so the job says one thing once."""
    error, result = None, None
    try:
        result = step()
    except HpctrainError as e:
        error = e
    except OSError as e:   # a full disk on one rank: the others must not wait for it
        error = HpctrainError(f"{e.filename or 'prepare'}: cannot write ({e.strerror or e})")
    failed = np.zeros(job.size, np.int8)
    failed[job.rank] = error is not None
    failed = job.meet(failed)
    if failed.any():
        first = int(np.flatnonzero(failed)[0])
        if first == job.rank:
            raise error
        raise HpctrainError(f"rank {first} stopped the prepare", report=False)
    return result


def _documents(job, k, want_str, digests=None):
    """(block, doc_end) of unit k's pieces in order; digests: each piece's sha256 appended."""
    for piece in job.units[k]:
        f = job.files[piece.file]
        digest = hashlib.sha256()
        yield from read_piece(f, piece, want_str, job.field, job.bad, digest)
        if digests is not None:
            digests.append(piece_digest(f, piece, digest))


# ---------------------------------------------------------------------------
# The vocabulary

def _characters(job):
    """Chars: every character of this rank's units, met over the ranks, as the vocabulary."""
    seen = np.zeros(0x110000, np.uint8)
    for k in range(job.rank, len(job.units), job.size):
        for block, _ in _documents(job, k, True):
            seen[np.frombuffer(block.encode("utf-32-le", "surrogatepass"), np.uint32)] = 1
    return seen


def _sample(job, limit):
    """bpe:N's training text: the corpus's first `limit` characters or more
    (whole blocks), in unit order (the whole corpus where it is smaller)."""
    parts, held = [], 0
    for k in range(len(job.units)):
        for block, _ in _documents(job, k, True):
            parts.append(block)
            held += len(block)
            if held >= limit:
                return "".join(parts)
    return "".join(parts)


def _vocabulary(job, kind, size, given, eot, tmp, sample_mb):
    if kind == "bytes":
        return train_vocabulary(kind, size, b"")
    if kind == "chars":
        seen = job.meet(_together(job, lambda: _characters(job)))
        return Chars.train("".join(map(chr, np.flatnonzero(seen).tolist())))
    if kind == "tokenizer":
        return given

    def train():   # rank 0 trains and saves; the others read its file
        if job.rank == 0:
            train_vocabulary(kind, size, _sample(job, int(sample_mb * 1e6)), eot).save(tmp / TOKENIZER)
    _together(job, train)
    return Bpe.load(tmp / TOKENIZER)


# ---------------------------------------------------------------------------
# Encoding (each rank its units) and writing shards

def _encode_unit(job, k, vocab, dtype, eot_id, path, digests):
    """Unit k's ids into the file at path, block by block (a record's ids
    gathered with the next ones' and written a few MB at a time: a write per
    record cost more than its encoding); their count."""
    n, pending, held = 0, [], 0
    eot = None if eot_id is None else np.array([eot_id], dtype)
    with open(path, "wb") as out:
        for block, doc_end in _documents(job, k, vocab.kind != "bytes", digests):
            if len(block):
                ids = np.frombuffer(block, np.uint8) if vocab.kind == "bytes" else vocab.encode(block)
                if vocab.kind != "bytes" and ids.max() >= vocab.vocab_size:   # a tokenizer whose ids skip some
                    raise HpctrainError(f"--text {vocab.kind}: id {ids.max()} for a vocabulary of "
                                        f"{vocab.vocab_size} tokens; its ids must be 0..{vocab.vocab_size - 1}")
                pending.append(ids.astype(dtype, copy=False))
                held += len(ids)
            if doc_end and eot is not None:
                pending.append(eot)
                held += 1
            if held >= _COPY_TOKENS:
                out.write(np.concatenate(pending).tobytes())
                n, pending, held = n + held, [], 0
        if pending:
            out.write(np.concatenate(pending).tobytes())
    return n + held


def _encode(job, vocab, dtype, eot_id, tmp, progress):
    """(token counts of every unit, sha256 of every piece): this rank's
    units encoded into tmp/.unit-K.ids, then met over the ranks."""
    pieces = [i for i, unit in enumerate(job.units) for _ in unit]
    counts, digests = np.zeros(len(job.units), np.int64), np.zeros((len(pieces), 32), np.uint8)
    mine = range(job.rank, len(job.units), job.size)
    total = sum(unit_bytes_of(job.files, job.units[k]) for k in mine)
    done, start = 0, time.monotonic()
    shown = start
    for k in mine:
        found = []
        counts[k] = _encode_unit(job, k, vocab, dtype, eot_id, tmp / f".unit-{k:05d}.ids", found)
        first = pieces.index(k)
        digests[first:first + len(found)] = np.frombuffer(b"".join(found), np.uint8).reshape(-1, 32)
        done += unit_bytes_of(job.files, job.units[k])
        now = time.monotonic()
        if progress and job.rank == 0 and now - shown >= 1:
            shown, rate = now, done / max(now - start, 1e-9)
            progress(f"prepare: rank 0 encoded {done / 1e6:.1f} of its {total / 1e6:.1f} MB "
                     f"({rate / 1e6:.0f} MB/s, ETA {(total - done) / max(rate, 1e-9):.0f} s); "
                     f"{len(job.units)} units over {job.size} rank{'s' * (job.size > 1)}")
    return counts, digests


def _boundaries(job, counts, units, eot_id, dtype, tmp, lo, hi, first):
    """Document starts b (an EOT's position + 1), lo <= b < hi, in this
    rank's units among `units` (ascending), read in steps: the first such
    where first (no further unit read), else all of them."""
    starts = np.concatenate([[0], np.cumsum(counts)])
    found = []
    for k in units:
        if k % job.size != job.rank:
            continue
        with open(tmp / f".unit-{k:05d}.ids", "rb") as f:
            at = int(starts[k])
            while True:
                step = np.fromfile(f, dtype, count=_COPY_TOKENS)
                if not len(step):
                    break
                b = np.flatnonzero(step == eot_id) + at + 1
                found.extend(b[(b >= lo) & (b < hi)].tolist())
                if first and found:
                    return found[:1]
                at += len(step)
    return found


def _document_cut(job, counts, cut, eot_id, dtype, tmp):
    """The held-out split's start moved to a document's (--eot): the first
    at or past the token cut, or, where the last document holds the cut,
    the last before it; the token cut where there is no document boundary
    (one document). The same on any number of ranks: the ranks' candidates
    met (each split keeps 2 tokens at least)."""
    n = int(counts.sum())
    at = int(np.searchsorted(np.cumsum(counts), cut, side="right"))   # the unit holding token `cut`
    after = _boundaries(job, counts, range(at, len(counts)), eot_id, dtype, tmp, cut, n - 1, True)
    found = job.meet(np.array([-min(after, default=n)], np.int64))   # the ranks' least, as a maximum
    if -found[0] < n:
        return int(-found[0])
    before = _boundaries(job, counts, range(0, min(at + 1, len(counts))), eot_id, dtype, tmp, 2, cut, False)
    found = job.meet(np.array([max(before, default=0)], np.int64))
    return int(found[0]) or cut


def _parts(counts, cut):
    """{split: [(unit, lo, hi)]}: each unit's tokens before the cut (train)
    and after it (test), the empty ones left out, in unit order."""
    starts = np.concatenate([[0], np.cumsum(counts)])
    parts = {"train": [], "test": []}
    for k, n in enumerate(counts.tolist()):
        lo, hi = int(starts[k]), int(starts[k]) + n
        if lo < cut:
            parts["train"].append((k, 0, min(hi, cut) - lo))
        if hi > cut:
            parts["test"].append((k, max(lo, cut) - lo, n))
    return parts


def _write_shard(path, ids_path, lo, hi, dtype, split, index, count):
    # Contiguous and uncompressed: the readers read a batch's windows at their
    # offset in the file (tokens.py). Copied in steps: a unit's ids need not fit in memory.
    with h5py.File(path, "w") as f:
        tokens = f.create_dataset("tokens", shape=(hi - lo,), dtype=dtype)
        with open(ids_path, "rb") as ids:
            ids.seek(lo * dtype.itemsize)
            for at in range(lo, hi, _COPY_TOKENS):
                step = np.fromfile(ids, dtype, count=min(_COPY_TOKENS, hi - at))
                tokens[at - lo:at - lo + len(step)] = step
        f.attrs["split"] = split
        f.attrs["shard"] = index
        f.attrs["num_shards"] = count


def _write_shards(job, parts, dtype, tmp):
    """This rank's units' shards written (their id files then removed); the
    sizes and sha256 of every shard, train's then test's, met over the ranks."""
    listed = [(split, i, len(parts[split]), k, lo, hi)
              for split in ("train", "test") for i, (k, lo, hi) in enumerate(parts[split])]
    sizes, digests = np.zeros(len(listed), np.int64), np.zeros((len(listed), 32), np.uint8)
    for j, (split, i, count, k, lo, hi) in enumerate(listed):
        if k % job.size == job.rank:
            path = tmp / shard_name(split, i, count)
            _write_shard(path, tmp / f".unit-{k:05d}.ids", lo, hi, dtype, split, i, count)
            sizes[j] = path.stat().st_size
            digests[j] = np.frombuffer(bytes.fromhex(_sha256(path)), np.uint8)
    for k in range(job.rank, len(job.units), job.size):
        (tmp / f".unit-{k:05d}.ids").unlink()
    return listed, sizes, digests


# ---------------------------------------------------------------------------
# The manifest

def _file_records(job, digests):
    """The manifest's record of each source file: name, bytes, sha256 (of
    each piece, "parts", where the file was cut into units)."""
    pieces = [p for unit in job.units for p in unit]
    records = [{"name": f.name, "bytes": f.bytes} for f in job.files]
    for p, d in zip(pieces, digests):
        whole = p.stop is None or (p.start == 0 and p.stop == job.files[p.file].bytes)
        if whole:
            records[p.file]["sha256"] = bytes(d).hex()
        else:
            records[p.file].setdefault("parts", []).append({"start": p.start, "stop": p.stop,
                                                             "sha256": bytes(d).hex()})
    return records


def _build_manifest(source, records, vocab, dtype, val_fraction, entries, extra):
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "kind": "tokens",
        "source": {"dir": str(source), "layout": "text", "files": records},
        "text": vocab.kind,
        "vocab_size": int(vocab.vocab_size),
        "dtype": dtype,
        "val_fraction": float(val_fraction),
        **vocab.manifest_entry(),
        **extra,
    }
    if "tokenizer" in entries:
        manifest["tokenizer"] = entries["tokenizer"]
    manifest["train"] = entries["train"]
    manifest["test"] = entries["test"]
    manifest["val"] = entries["test"]   # one held-out tail: --eval-every and --keep-best read it too
    return manifest


def _entries(listed, sizes, digests, counts):
    entries = {"train": {"num_tokens": 0, "shards": []}, "test": {"num_tokens": 0, "shards": []}}
    for (split, i, count, k, lo, hi), size, digest in zip(listed, sizes.tolist(), digests):
        entries[split]["shards"].append({"file": shard_name(split, i, count), "num_tokens": hi - lo,
                                         "bytes": size, "sha256": bytes(digest).hex()})
        entries[split]["num_tokens"] += hi - lo
    return entries


# ---------------------------------------------------------------------------
# prepare --text

def _check_held_out(n, val_fraction, source):
    """The held-out count: round(F * n); each split needs 2 tokens at least
    (one window of one token and its next)."""
    held = int(np.floor(n * val_fraction + 0.5))
    if n - held < 2 or held < 2:
        raise HpctrainError(f"{source}: {n} tokens, too few to hold out --val-fraction {val_fraction:g} "
                            f"({n - held} to train on, {held} held out; each needs 2 at least)")
    return held


def _bad_records(skip):
    """--skip-bad-records: a bad record counted (skipped[0]); else its line raised."""
    skipped = [0]

    def bad(line):
        if not skip:
            raise HpctrainError(f"{line}; --skip-bad-records skips such records")
        skipped[0] += 1
    return bad, skipped


def _check(source, out, text, val_fraction, force, eot, tokenizer_sample_mb, shard_mb):
    """(kind, spec, given tokenizer, source files, source, out) once the flags, the source and --out
    are checked; nothing read but a given tokenizer and the files' names and sizes."""
    kind, spec = parse_text(text)
    given = load_tokenizer(spec) if kind == "tokenizer" else None   # checked before the corpus is read
    if not 0 < val_fraction < 1:
        raise HpctrainError(f"--val-fraction must be in (0, 1) for text (the held-out tail), got {val_fraction}")
    if eot and kind in ("chars", "bytes"):
        raise HpctrainError(f"--eot: --text {kind} has no end-of-text token (every id is a "
                            f"{'character' if kind == 'chars' else 'byte'}); use bpe:N or a tokenizer with {EOT}")
    for flag, value in (("--tokenizer-sample-mb", tokenizer_sample_mb), ("--shard-mb", shard_mb)):
        if not value > 0:
            raise HpctrainError(f"{flag} must be positive, got {value:g}")
    source, out = Path(source), _resolve_out(out)
    _check_not_input(source, out, images=False)
    _check_out(out, force)
    files = source_files(source)
    if not sum(f.bytes for f in files):
        raise HpctrainError(f"{source}: empty, no text to learn from")
    if eot and kind == "tokenizer" and end_of_text(given) is None:
        raise HpctrainError(f"--eot: the tokenizer {spec} has no end-of-text token {EOT}")
    return kind, spec, given, files, source, out


@stops_cleanly
def prepare_text(source, out, text="chars", val_fraction=0.1, force=False, log=print, *, text_field="text",
                 eot=False, skip_bad_records=False, tokenizer_sample_mb=256, shard_mb=64, rank=0, size=1,
                 meet=None, progress=None):
    """Encode the corpus at source with --text `text` (chars, bytes, bpe:N,
    tokenizer:PATH) and write its token shards, manifest.json and (bpe,
    tokenizer) tokenizer.json into out; return the manifest (rank 0; the
    others None). text_field: the JSON Lines and Parquet field holding a
    document; eot: an end-of-text token after each document;
    skip_bad_records: a bad record counted, not an error; shard_mb: the
    input (MB) of one unit of work and shard (text.plan_units). Under mpirun the
    command passes rank, size and meet (the ranks' elementwise maximum of an
    array); progress: where rank 0's progress line goes (None: nowhere).
    What is wrong is one HpctrainError line: a binary file, an empty corpus,
    bytes that are not UTF-8 (chars and bpe), a bad record, a vocabulary past
    uint16; nothing is left behind."""
    log = log or (lambda *a: None)
    meet = meet or (lambda a: a)
    try:   # every rank checks the same things: rank 0 says what is wrong, once
        kind, spec, given, files, source, out = _check(source, out, text, val_fraction, force, eot,
                                                       tokenizer_sample_mb, shard_mb)
    except HpctrainError as e:
        raise HpctrainError(str(e), exit_code=e.exit_code, report=rank == 0) from None
    bad, skipped = _bad_records(skip_bad_records)
    job = _Job(files, plan_units(files, max(1, int(shard_mb * 1e6))), text_field, bad, rank, size, meet)

    if rank == 0:
        sweep_stale_tmps(out, log)
    tmp = _tmp_name(out) if rank == 0 else None
    try:
        if rank == 0:   # in the try: a stop right after the mkdir removes it too
            _together(job, lambda: _make_tmp(tmp, out))
        else:
            _together(job, lambda: None)
        name = np.zeros(_PATH_BYTES, np.uint8)
        if rank == 0:
            name[:len(str(tmp).encode())] = np.frombuffer(str(tmp).encode(), np.uint8)
        tmp = Path(bytes(meet(name)).rstrip(b"\0").decode())

        vocab = _vocabulary(job, kind, spec, given, eot, tmp, tokenizer_sample_mb)
        dtype = token_dtype(vocab.vocab_size)
        eot_id = end_of_text(vocab) if eot else None   # bpe:N reserves it; a given tokenizer was checked
        skipped[0] = 0   # counted in the encoding pass alone (chars and bpe:N read records before it too)
        counts, digests = _together(job, lambda: _encode(job, vocab, dtype, eot_id, tmp, progress))
        counts, digests, skips = meet(counts), meet(digests), np.zeros(size, np.int64)
        skips[rank] = skipped[0]
        skips = meet(skips)
        n = int(counts.sum())
        if n == 0:
            raise HpctrainError(f"{source}: empty, no text to learn from", report=rank == 0)
        held = _together(job, lambda: _check_held_out(n, val_fraction, source))
        if eot_id is not None:   # whole documents held out
            held = n - _together(job, lambda: _document_cut(job, counts, n - held, eot_id, np.dtype(dtype), tmp))
        parts = _parts(counts, n - held)
        listed, sizes, shard_digests = _together(job, lambda: _write_shards(job, parts, np.dtype(dtype), tmp))
        sizes, shard_digests = meet(sizes), meet(shard_digests)
        if rank != 0:
            _together(job, lambda: None)   # rank 0's install: every rank ends as it does
            return None
        entries = _entries(listed, sizes, shard_digests, counts)
        if vocab.kind == "bpe":
            if given is not None:
                vocab.save(tmp / TOKENIZER)
            entries["tokenizer"] = {"file": TOKENIZER, "sha256": _sha256(tmp / TOKENIZER)}
            if given is not None:   # where the tokenizer came from (its copy is the file beside the shards)
                entries["tokenizer"]["from"] = str(Path(spec).resolve())
        extra = {}
        if any(f.format != "text" for f in files):
            extra["text_field"] = text_field
        if eot_id is not None:
            extra["eot"] = int(eot_id)
        if skips.sum():
            extra["skipped_records"] = int(skips.sum())
        manifest = _build_manifest(source, _file_records(job, digests), vocab, dtype, val_fraction, entries, extra)
        _together(job, lambda: _install(tmp, manifest, out, force))
    except OSError as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise HpctrainError(f"{out}: cannot write shards ({e})") from None
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    train = entries["train"]["num_tokens"]
    tokens = f"{vocab.vocab_size} token{'s' * (vocab.vocab_size != 1)}"   # "1 tokens" of a one-letter text
    skipped_line = f"; skipped {int(skips.sum())} bad records (--skip-bad-records)" if skips.sum() else ""
    log(f"prepared {out}: {train} training tokens, {held} held out (the last {val_fraction:g}), "
        f"{tokens} of --text {text} ({dtype}), from {sum(f.bytes for f in files)} bytes in {source}"
        f"{skipped_line}")
    return manifest
