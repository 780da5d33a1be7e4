"""safetensors files, read and written here: an 8-byte little-endian header
length, a JSON header (per tensor `dtype`, `shape`, `data_offsets` into the
data that follows; `__metadata__`: strings), then the raw little-endian
arrays. No pickle: what every framework reads and writes.

- `SafeTensors(path)`: the file memory-mapped, its header checked; `read(name,
  box)` one tensor or one box of it (a ZeRO-3 shard's, a tensor-parallel
  rank's columns) as float32, touching only the pages that box lies on;
- `write(path, tensors, metadata, dtype)`: float32, or float16 / bfloat16
  for smaller files, written whole or not at all (base/files.write_atomically).

The format is written here directly rather than through the `safetensors`
package: its NumPy API has no bfloat16 (NumPy has none; ml_dtypes adds it),
and reading one box of a tensor is one slice of a memory map here, with no
dependency beyond NumPy (ml_dtypes only for a bf16 file).

    python -c "from hpctrain.interop.safetensors import SafeTensors; print(SafeTensors('model.safetensors').names)"
    python -m pytest -q tests/test_safetensors.py
"""
import json
import math
import mmap
import os
import struct

import numpy as np

from ..base.errors import HpctrainError
from ..base.files import one_line, write_atomically
from ..state.parts import box_slices

# safetensors' dtype names -> NumPy's (BF16 through ml_dtypes: _bfloat16)
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": None}
# --dtype's names -> the file's
WRITTEN = {"fp32": "F32", "fp16": "F16", "bf16": "BF16"}
# A header larger than this is not one a model's tensors need (safetensors' own bound).
MAX_HEADER = 100 << 20


def _bfloat16(what):
    try:
        import ml_dtypes
    except ImportError:
        raise HpctrainError(f"{what}: bfloat16 tensors need ml_dtypes: pip install ml_dtypes") from None
    return np.dtype(ml_dtypes.bfloat16)


def numpy_dtype(name, what):
    """The NumPy dtype of a safetensors dtype name; one line for one hpctrain does not read."""
    if name not in DTYPES:
        raise HpctrainError(f"{what}: holds {name} tensors; hpctrain reads floating-point tensors only "
                            f"({', '.join(DTYPES)})")
    return _bfloat16(what) if name == "BF16" else np.dtype(DTYPES[name]).newbyteorder("<")


class SafeTensors:
    """One safetensors file, memory-mapped; `names`, `shape(name)`, `read(name,
    box)`, `metadata` (the header's strings). A file that is not one is one
    line naming it (HpctrainError), never a traceback."""

    def __init__(self, path):
        self.path = str(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                if len(head) < 8:
                    raise self._bad("shorter than a header")
                (n,) = struct.unpack("<Q", head)
                if n > MAX_HEADER or 8 + n > size:
                    raise self._bad(f"a header of {n:,} bytes in a file of {size:,}")
                try:
                    header = json.loads(f.read(n).decode("utf-8"))
                except (ValueError, UnicodeDecodeError, RecursionError):
                    raise self._bad("its header is not JSON") from None
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise HpctrainError(f"{self.path}: cannot read it ({one_line(e)})") from None
        if not isinstance(header, dict):
            raise self._bad("its header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise self._bad("its __metadata__ is not a map of strings")
        self.metadata, self._start, self._entries = meta, 8 + n, {}
        for name, entry in header.items():
            self._entries[name] = self._checked(name, entry, size - 8 - n)
        self.names = list(self._entries)

    def _bad(self, why):
        return HpctrainError(f"{self.path}: not a safetensors file ({why})")

    def _checked(self, name, entry, data_bytes):
        """(dtype name, shape, begin, end) of a header entry, once its bytes are its shape's and inside the file."""
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ok = isinstance(dtype, str) and all(isinstance(d, int) and d >= 0 for d in shape) and \
                isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_bytes
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise self._bad(f"tensor {name!r} has a damaged entry")
        item = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}.get(dtype)
        if item is not None and end - begin != item * math.prod(shape):
            raise self._bad(f"tensor {name!r}: {end - begin:,} bytes for shape {tuple(shape)} of {dtype}")
        return dtype, tuple(shape), begin, end

    def shape(self, name):
        return self._entries[name][1]

    def dtype(self, name):
        return self._entries[name][0]

    def read(self, name, box=None):
        """Tensor `name`, or its box ((start, stop) per dimension), as a new float32 array."""
        dtype, shape, begin, end = self._entries[name]
        kind = numpy_dtype(dtype, f"{self.path}: {name}")
        whole = np.frombuffer(self._map, kind, math.prod(shape), self._start + begin).reshape(shape)
        part = whole if box is None else whole[box_slices(box)]
        return part.astype(np.float32)

    def close(self):
        self._map.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def write(path, tensors, metadata=None, dtype="fp32"):
    """A safetensors file at path, written whole or not at all: tensors
    [(name, array)] in that order, cast to `dtype` (fp32, fp16, bf16),
    metadata {str: str} as the header's __metadata__. Raises OSError."""
    name = WRITTEN[dtype]
    kind = _bfloat16(f"--dtype {dtype}") if name == "BF16" else np.dtype(DTYPES[name]).newbyteorder("<")
    header, at, arrays = {}, 0, []
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for tensor, values in tensors:
        values = np.ascontiguousarray(np.asarray(values).astype(kind))
        header[tensor] = {"dtype": name, "shape": list(values.shape), "data_offsets": [at, at + values.nbytes]}
        arrays.append(values)
        at += values.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)   # the data 8-byte aligned, as the reference writer pads it

    def fill(f):
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for values in arrays:
            f.write(memoryview(values.view(np.uint8).reshape(-1)))
    write_atomically(str(path), fill, binary=True)
