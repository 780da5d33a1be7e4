"""The sources of `prepare --text`, read as a stream of documents, never
whole: text files, JSON Lines, Parquet, gzip/xz/zstd-compressed text or
JSON Lines, or a folder of them; cut into units of about --shard-mb that
are the work one rank does and the input of one shard (prepare_text.py).

    from hpctrain.data.text import source_files, plan_units, read_unit
    files = source_files("corpus/")                # [SourceFile], in path order
    units = plan_units(files, 64 << 20)            # [[Piece]]: the same on any number of ranks
    for block, doc_end in read_unit(files, units[0], want_str=True, field="text", bad=print):
        ...                                        # str (or bytes) blocks; doc_end after a document's last

A folder's files are those named *.txt, *.jsonl, *.parquet, the first two
also with .gz, .xz or .zst after (its subfolders' too), in the order of
their paths relative to it; a --source file is read by its name the same
way, plain text when the name says nothing else. A text file is one
document; a JSON Lines record (its --text-field string) and a Parquet row
(its column's) are one each. A plain file larger than a unit is cut
into pieces at line ends; small files are packed into one unit. Text is
read BLOCK bytes at a time, cut after its last line end (or, in a line
longer than a block, at a character's start), so what is encoded at once
depends on the file alone, never on the ranks; a file under BLOCK is
encoded whole, as it was before the corpus was streamed.

A NUL byte (binary, not text), bytes that are not UTF-8 (where the
vocabulary needs characters: chars, bpe) name the file and the offset; a
bad record (not JSON, no such field, not a string, not UTF-8) names the
file and its line (a Parquet file: its row) and goes to `bad`, which
raises it or counts it (--skip-bad-records). Each is one HpctrainError
line. No MPI here (house rule).
"""

import gzip
import hashlib
import json
import lzma
import os
from pathlib import Path
from typing import NamedTuple, Optional

from hpctrain.base.errors import HpctrainError

BLOCK = 4 << 20        # bytes of text read, checked and encoded at a time
COMPRESSION = {".gz": "gzip", ".xz": "xz", ".zst": "zstd"}
FORMATS = {".txt": "text", ".jsonl": "jsonl", ".parquet": "parquet"}


class SourceFile(NamedTuple):
    path: Path
    name: str                    # relative to a folder --source (the manifest's)
    format: str                  # text, jsonl, parquet
    compression: Optional[str]   # gzip, xz, zstd or None
    bytes: int


class Piece(NamedTuple):
    file: int                    # index into the source files
    start: int
    stop: Optional[int]          # None: to the end (a compressed or Parquet file, read whole)


def _format(name):
    """(format, compression) by a file's name; None where a folder's scan skips it."""
    name = name.lower()
    compression = None
    for ext, kind in COMPRESSION.items():
        if name.endswith(ext):
            compression, name = kind, name[:-len(ext)]
    fmt = FORMATS.get(os.path.splitext(name)[1])
    if fmt == "parquet" and compression:
        return None   # Parquet compresses inside
    return (fmt, compression) if fmt else None


def source_files(source):
    """[SourceFile] of a --source: itself (by its name, plain text unless
    it says otherwise), or a folder's readable files in path order."""
    source = Path(source)
    if not source.exists():
        raise HpctrainError(f"{source}: no such file or directory")
    if source.is_file():
        fmt, compression = _format(source.name) or ("text", COMPRESSION.get(source.suffix.lower()))
        return [SourceFile(source, source.name, fmt, compression, source.stat().st_size)]
    if not source.is_dir():
        raise HpctrainError(f"{source}: not a regular file or a directory")
    found = sorted((p for p in source.rglob("*") if p.is_file() and _format(p.name)),
                   key=lambda p: p.relative_to(source).parts)
    if not found:
        raise HpctrainError(f"{source}: a directory without .txt, .jsonl or .parquet files (gzip, xz or zstd "
                            f"compressed too); give a text file or a folder of them")
    return [SourceFile(p, p.relative_to(source).as_posix(), *_format(p.name), p.stat().st_size) for p in found]


def _line_ends(path, size, unit_bytes):
    """Cut points of a plain file: after the first line end at or past each
    multiple of unit_bytes (none found: the file's end)."""
    cuts = [0]
    with open(path, "rb") as f:
        at = unit_bytes
        while at < size:
            f.seek(at)
            while True:
                chunk = f.read(1 << 16)
                if not chunk:
                    return cuts + [size]
                nl = chunk.find(b"\n")
                if nl >= 0:
                    break
                at += len(chunk)
            cut = at + nl + 1
            if cut < size:
                cuts.append(cut)
            at = max(cut, cuts[-1] + unit_bytes)
    return cuts + [size]


def plan_units(files, unit_bytes):
    """The units of work, [[Piece]], a pure function of the files: a plain
    file over unit_bytes cut at line ends, each piece a unit; smaller files
    (a compressed or Parquet one whole) packed in order until a unit holds
    unit_bytes."""
    units, current, held = [], [], 0
    for i, f in enumerate(files):
        if f.compression is None and f.format != "parquet" and f.bytes > unit_bytes:
            if current:
                units.append(current)
                current, held = [], 0
            cuts = _line_ends(f.path, f.bytes, unit_bytes)
            units.extend([Piece(i, a, b)] for a, b in zip(cuts, cuts[1:]))
            continue
        plain = f.compression is None and f.format != "parquet"
        current.append(Piece(i, 0, f.bytes if plain else None))
        held += f.bytes
        if held >= unit_bytes:
            units.append(current)
            current, held = [], 0
    if current:
        units.append(current)
    return units


def unit_bytes_of(files, unit):
    """The bytes of input a unit reads from disk (a progress line's measure)."""
    return sum(files[p.file].bytes if p.stop is None else p.stop - p.start for p in unit)


# ---------------------------------------------------------------------------
# Reading

def _zstd_reader(raw):
    try:
        import zstandard
    except ImportError:
        raise HpctrainError(f"{raw.name}: zstd-compressed; reading it needs the zstandard package "
                            f"(pip install zstandard)") from None
    import io
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))


def _open(f):
    try:
        if f.compression == "gzip":
            return gzip.open(f.path, "rb")
        if f.compression == "xz":
            return lzma.open(f.path, "rb")
        if f.compression == "zstd":
            return _zstd_reader(open(f.path, "rb"))
        return open(f.path, "rb")
    except OSError as e:
        raise HpctrainError(f"{f.path}: cannot read ({e.strerror or e})") from None


def _blocks(f, piece, digest):
    """(offset, bytes) blocks of a piece of a text or JSON Lines file, each
    ending at a line end, or, where a line is longer than BLOCK, at the
    start of a UTF-8 character (a JSON Lines record is never cut: it waits
    for its line's end); digest: the piece's bytes hashed as they are read
    (a plain file's; a compressed one is hashed whole on disk)."""
    stream = _open(f)
    carry, at = b"", piece.start
    try:
        with stream:
            if piece.start:
                stream.seek(piece.start)
            left = None if piece.stop is None else piece.stop - piece.start
            while True:
                want = BLOCK if left is None else min(BLOCK, left)
                data = stream.read(want) if want else b""
                if left is not None:
                    left -= len(data)
                if f.compression is None:
                    digest.update(data)
                block = carry + data
                if not data:
                    if block:
                        yield at, block
                    return
                nl = block.rfind(b"\n") + 1
                if not nl and f.format == "text":   # a line longer than a block: cut before its last character
                    nl = len(block)
                    while nl > 0 and block[nl - 1] & 0xC0 == 0x80:
                        nl -= 1
                    nl = (nl - 1 if nl > 0 and block[nl - 1] >= 0xC0 else nl) or len(block)
                if nl:
                    yield at, block[:nl]
                    at += nl
                carry = block[nl:]
    except (OSError, EOFError, lzma.LZMAError) as e:
        raise HpctrainError(f"{f.path}: cannot read ({f.compression or 'file'}: {e})") from None


def _text(f, piece, want_str, digest):
    for at, block in _blocks(f, piece, digest):
        nul = block.find(b"\0")
        if nul >= 0:
            raise HpctrainError(f"{f.path}: a binary file (a NUL byte at offset {at + nul}), not text")
        if not want_str:
            yield block, False
            continue
        try:
            yield block.decode("utf-8"), False
        except UnicodeDecodeError as e:
            raise HpctrainError(f"{f.path}: not UTF-8 text (byte 0x{block[e.start]:02x} at offset "
                                f"{at + e.start}); --text bytes takes any bytes") from None
    if piece.stop is None or piece.stop == f.bytes:   # a file is one document: ends at its last piece's end
        yield ("" if want_str else b""), True


def _lines_before(f, offset):
    """The line number a plain file's byte offset starts (read only where a
    bad record in a later piece is named)."""
    lines, done = 1, 0
    with open(f.path, "rb") as stream:
        while done < offset:
            chunk = stream.read(min(1 << 20, offset - done))
            lines += chunk.count(b"\n")
            done += len(chunk)
    return lines


def _record(value, field, where, bad):
    """A record's document (str), or None where it is bad (bad() raised or counted it)."""
    try:
        record = json.loads(value.decode("utf-8"))   # decoded here: json's own guess of the encoding costs more
    except UnicodeDecodeError:
        return bad(f"{where}: not UTF-8")
    except ValueError as e:
        return bad(f"{where}: not JSON ({getattr(e, 'msg', e)})")
    if not isinstance(record, dict) or field not in record:
        return bad(f"{where}: no \"{field}\" field (--text-field)")
    return _string(record[field], field, where, bad)


def _string(value, field, where, bad):
    if not isinstance(value, str):
        return bad(f"{where}: \"{field}\" is {'null' if value is None else type(value).__name__}, not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return bad(f"{where}: \"{field}\" is not valid Unicode (a lone surrogate)")
    return value


def _jsonl(f, piece, want_str, field, bad, digest):
    first = None
    for at, block in _blocks(f, piece, digest):
        if first is None:
            first = 1 if piece.start == 0 else _lines_before(f, piece.start)
        for n, line in enumerate(block.splitlines(), first):
            if line.strip():
                doc = _record(line, field, f"{f.path}, line {n}", bad)
                if doc is not None:
                    yield (doc if want_str else doc.encode("utf-8")), True
        first += block.count(b"\n")


def _parquet(f, want_str, field, bad):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise HpctrainError(f"{f.path}: a Parquet file; reading it needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.ParquetFile(f.path)
        if field not in table.schema_arrow.names:
            raise HpctrainError(f"{f.path}: no column \"{field}\" (--text-field); its columns: "
                                f"{', '.join(table.schema_arrow.names)}")
        row = 0
        for batch in table.iter_batches(columns=[field], batch_size=1024):
            for value in batch.column(0).to_pylist():
                row += 1
                doc = _string(value, field, f"{f.path}, row {row}", bad)
                if doc is not None:
                    yield (doc if want_str else doc.encode("utf-8")), True
    except HpctrainError:
        raise
    except Exception as e:   # pyarrow's errors for a damaged file are plain exceptions (ArrowInvalid, OSError)
        raise HpctrainError(f"{f.path}: not a readable Parquet file ({e})") from None


def read_piece(f, piece, want_str, field, bad, digest):
    """(block, doc_end) of one piece: str where want_str, else bytes;
    doc_end True after the last block of a document."""
    if f.format == "text":
        return _text(f, piece, want_str, digest)
    if f.format == "jsonl":
        return _jsonl(f, piece, want_str, field, bad, digest)
    return _parquet(f, want_str, field, bad)


def piece_digest(f, piece, digest):
    """The sha256 a piece records in the manifest: of the bytes read (a
    plain file's piece), or of the whole file on disk (compressed, Parquet)."""
    if f.compression is None and f.format != "parquet":
        return digest.digest()
    h = hashlib.sha256()
    with open(f.path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            h.update(block)
    return h.digest()
