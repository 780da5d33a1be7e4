"""IDX files (LeCun's MNIST format), raw or gzip-compressed, into uint8 arrays.

The format: a 4-byte magic (0, 0, type code, number of dimensions), one
big-endian uint32 per dimension, then the data, row-major. Only unsigned
bytes (type 0x08) occur in MNIST and Fashion-MNIST, so only they are read.
Every way a file can be wrong is one HpctrainError line, never a traceback.

    python -c "from hpctrain.data import read_idx; print(read_idx('data/mnist-5k/labels-idx1-ubyte.gz').shape)"

No MPI here (house rule).
"""

import gzip
import io
import math
import os
import stat
import zlib
from pathlib import Path

import numpy as np

from hpctrain.base.errors import HpctrainError

from .file_errors import file_errors

# IDX type codes; only unsigned bytes occur in MNIST and Fashion-MNIST.
_IDX_UBYTE = 0x08
_IDX_MAGIC = {"images": 0x00000803, "labels": 0x00000801}
_GZIP_MAGIC = b"\x1f\x8b"
_MAX_IDX_BYTES = 1 << 36
# MNIST's labels have 1 dimension and its images 3; a 4th allows channels.
_MAX_IDX_DIMS = 4
# Deflate's best case is about 1032:1 (258-byte matches coded in 2 bits);
# gzip's own header only lowers it. More is a lie, not compression.
_MAX_DEFLATE_RATIO = 1032
_READ_BLOCK = 1 << 20


def read_idx(path, kind=None):
    """Read an IDX file (gzip-compressed or raw) into a uint8 array.

    kind="images" or "labels" also demands that magic (0x803 or 0x801), so a
    swapped pair of files is caught here rather than as a shape error later.
    The header is checked against what the file can hold before anything is
    allocated, so a damaged or lying header is one line, not gigabytes.
    """
    path = Path(path)
    with file_errors(path, "an IDX file"):
        with open(path, "rb") as raw:
            st = os.fstat(raw.fileno())
            # Only a regular file's length is known up front (not a pipe's).
            length = st.st_size if stat.S_ISREG(st.st_mode) else None
            head = _read_exact(raw, 2)
            compressed = head == _GZIP_MAGIC
            if length is not None:
                raw.seek(0)
            else:   # a FIFO cannot seek back: the two bytes go in front again
                raw = io.BufferedReader(_Prefixed(head, raw))
            if not compressed:
                return _parse_idx(raw, path, kind, length=length)
            try:
                with gzip.GzipFile(fileobj=raw, mode="rb") as f:
                    return _parse_idx(f, path, kind, gzip_length=length)
            except (OSError, EOFError, zlib.error) as e:
                # A cut-off download ends the deflate stream early (EOFError);
                # flipped bytes fail the CRC or the inflater (OSError, zlib.error).
                raise HpctrainError(f"{path}: corrupt gzip data ({e})") from None


class _Prefixed(io.RawIOBase):
    """A stream that cannot seek (a FIFO), with the bytes already read from it
    put back in front."""

    def __init__(self, head, f):
        self._head, self._f = bytes(head), f

    def readable(self):
        return True

    def readinto(self, b):
        if self._head:
            n = min(len(b), len(self._head))
            b[:n], self._head = self._head[:n], self._head[n:]
            return n
        return self._f.readinto(b)


def _read_header(f, path, kind):
    """(shape, header length in bytes), the header checked on its own terms."""
    head = _read_exact(f, 4)
    magic = int.from_bytes(head.ljust(4, b"\0"), "big")
    if kind is not None:
        expected = _IDX_MAGIC[kind]
        if len(head) < 4 or magic != expected:
            what = "image" if kind == "images" else "label"
            raise HpctrainError(f"{path}: not an IDX {what} file "
                                f"(magic 0x{magic:08x}, expected 0x{expected:08x})")
    if len(head) < 4 or head[0] != 0 or head[1] != 0 or head[3] == 0:
        raise HpctrainError(f"{path}: not an IDX file (magic 0x{magic:08x}, "
                            f"expected 0x00000803 for images or 0x00000801 for labels)")
    if head[2] != _IDX_UBYTE:
        raise HpctrainError(f"{path}: unsupported IDX data type 0x{head[2]:02x} "
                            f"(only 0x08, unsigned byte, is supported)")
    ndim = head[3]
    if ndim > _MAX_IDX_DIMS:
        raise HpctrainError(f"{path}: corrupt IDX header ({ndim} dimensions, hpctrain reads "
                            f"at most {_MAX_IDX_DIMS})")
    dims_raw = _read_exact(f, 4 * ndim)
    if len(dims_raw) < 4 * ndim:
        raise HpctrainError(f"{path}: truncated IDX header ({4 + len(dims_raw)} bytes, "
                            f"expected {4 + 4 * ndim})")
    shape = tuple(int.from_bytes(dims_raw[4 * i:4 * i + 4], "big") for i in range(ndim))
    dims = "x".join(map(str, shape))
    if 0 in shape:
        raise HpctrainError(f"{path}: corrupt IDX header (claims {dims} elements; "
                            f"no dimension may be 0)")
    if math.prod(shape) > _MAX_IDX_BYTES:
        # A damaged header must not turn into a multi-terabyte allocation.
        raise HpctrainError(f"{path}: corrupt IDX header (claims {dims} elements)")
    return shape, 4 + 4 * ndim


def _parse_idx(f, path, kind, length=None, gzip_length=None):
    """The array of an IDX stream. length: the raw file's length, if known;
    gzip_length: the compressed file's length, if known."""
    shape, header = _read_header(f, path, kind)
    need = math.prod(shape)
    dims = "x".join(map(str, shape))
    if length is not None:
        # Raw: the data's length is known, so check it before allocating.
        _check_length(path, dims, need, length - header)
        out = np.empty(shape, dtype=np.uint8)
        got = _readinto_full(f, memoryview(out).cast("B"))
        _check_length(path, dims, need, got)   # the file may shrink under us
        return out
    if gzip_length is not None and need > gzip_length * _MAX_DEFLATE_RATIO:
        raise HpctrainError(f"{path}: corrupt IDX header (claims {dims} = {need} data bytes; "
                            f"{gzip_length} bytes of gzip hold at most "
                            f"{gzip_length * _MAX_DEFLATE_RATIO})")
    # Compressed (or a pipe): the length shows only as the data arrives, so
    # the buffer grows with what was actually read, never to what the header says.
    data = bytearray()
    while len(data) < need:
        block = f.read(min(_READ_BLOCK, need - len(data)))
        if not block:
            break
        data += block
    _check_length(path, dims, need, len(data))
    if f.read(1):
        _check_length(path, dims, need, need + 1)
    return np.frombuffer(data, dtype=np.uint8).reshape(shape)


def _check_length(path, dims, need, got):
    if got < need:
        raise HpctrainError(f"{path}: truncated (header says {dims} = {need} data "
                            f"bytes, file has {got})")
    if got > need:
        raise HpctrainError(f"{path}: more data than its header ({dims}) "
                            f"says; not a valid IDX file")


def _read_exact(f, n):
    buf = bytearray(n)
    return bytes(buf[:_readinto_full(f, memoryview(buf))])


def _readinto_full(f, view):
    # GzipFile and raw files may both return short reads before the end.
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got
