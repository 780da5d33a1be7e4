"""A text source for `prepare --text`: one file, or the .txt files of a
folder, read as bytes and checked before anything is written.

    from hpctrain.data.text import read_corpus
    data, files = read_corpus("data/shakespeare/input.txt")

A folder's .txt files (its subfolders' too) are joined in the order of
their paths relative to it, byte for byte, with nothing between them. A
file with a NUL byte is binary, not text; an empty corpus has nothing to
learn; `decode_utf8` refuses bytes that are not UTF-8, naming the file and
the offset. Each is one HpctrainError line. No MPI here (house rule).
"""

from pathlib import Path

from hpctrain.base.errors import HpctrainError

from .manifest import _sha256


def _text_files(source):
    """The files a --source names: itself, or a folder's .txt files in path order."""
    if not source.exists():
        raise HpctrainError(f"{source}: no such file or directory")
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise HpctrainError(f"{source}: not a regular file or a directory")
    files = sorted((p for p in source.rglob("*.txt") if p.is_file()),
                   key=lambda p: p.relative_to(source).parts)
    if not files:
        raise HpctrainError(f"{source}: a directory without .txt files; give a text file or a folder of them")
    return files


def _read(path):
    try:
        return path.read_bytes()
    except OSError as e:
        raise HpctrainError(f"{path}: cannot read ({e.strerror or e})") from None


def read_corpus(source):
    """(bytes, files): the corpus of a --source and the manifest's record of
    its files (name relative to a folder source, bytes, sha256)."""
    source = Path(source)
    files = _text_files(source)
    parts, records = [], []
    for path in files:
        data = _read(path)
        nul = data.find(b"\0")
        if nul >= 0:
            raise HpctrainError(f"{path}: a binary file (a NUL byte at offset {nul}), not text")
        parts.append(data)
        name = path.name if path == source else path.relative_to(source).as_posix()
        records.append({"name": name, "bytes": len(data), "sha256": _sha256(path)})
    corpus = b"".join(parts)
    if not corpus:
        raise HpctrainError(f"{source}: empty, no text to learn from")
    return corpus, records


def decode_utf8(corpus, source, files):
    """The corpus as a str; bytes that are not UTF-8 are one line naming
    the file (of `files`, in order) and the offset in it."""
    try:
        return corpus.decode("utf-8")
    except UnicodeDecodeError as e:
        at, name = e.start, Path(source)
        for record in files:
            if at < record["bytes"]:
                name = name / record["name"] if name.is_dir() else name
                break
            at -= record["bytes"]
        raise HpctrainError(f"{name}: not UTF-8 text (byte 0x{corpus[e.start]:02x} at offset {at}); "
                            f"--text bytes takes any bytes") from None
