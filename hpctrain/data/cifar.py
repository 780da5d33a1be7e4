"""CIFAR-10's binary batches (data_batch_1..5.bin, test_batch.bin) into uint8 arrays.

The format (cs.toronto.edu/~kriz/cifar.html, "binary version"): records of
3073 bytes, no header: 1 label byte (0..9), then 3072 pixel bytes, the red,
green and blue planes of a 32x32 image one after the other (channel-major),
each plane row-major. Images come out as (N, 32, 32, 3), rows, columns,
channels, the layout prepare's manifests record; the model sees 3072 values
either way. Every way a file can be wrong is one HpctrainError line.

    python -c "from hpctrain.data.cifar import read_cifar10; print(read_cifar10('test_batch.bin')[0].shape)"

No MPI here (house rule).
"""

import os
import stat
from pathlib import Path

import numpy as np

from hpctrain.base.errors import HpctrainError

from .file_errors import file_errors

SIDE, CHANNELS = 32, 3
PIXELS = SIDE * SIDE * CHANNELS
CLASSES = 10
RECORD = 1 + PIXELS
# A real batch is 10,000 records (30,730,000 bytes); a file many times that
# is not a batch, and must not become an allocation of that size.
_MAX_RECORDS = 1_000_000


def read_cifar10(path):
    """(images uint8 (N, 32, 32, 3), labels uint8 (N,)) of one binary batch."""
    path = Path(path)
    with file_errors(path, "a CIFAR-10 batch"):
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise HpctrainError(f"{path}: not a regular file")
            size = st.st_size
            if size == 0 or size % RECORD:
                raise HpctrainError(f"{path}: {size} bytes, not a whole number of CIFAR-10 "
                                    f"records ({RECORD} bytes each: 1 label + {PIXELS} pixels)")
            if size // RECORD > _MAX_RECORDS:
                raise HpctrainError(f"{path}: {size // RECORD} records, more than "
                                    f"{_MAX_RECORDS}; not a CIFAR-10 batch")
            raw = np.empty(size, np.uint8)
            got = f.readinto(memoryview(raw))
    if got != size:   # the file shrank under us
        raise HpctrainError(f"{path}: truncated ({got} of {size} bytes read)")
    records = raw.reshape(-1, RECORD)
    labels = records[:, 0].copy()
    bad = np.flatnonzero(labels >= CLASSES)
    if len(bad):
        raise HpctrainError(f"{path}: label {int(labels[bad[0]])} in record {int(bad[0])}; "
                            f"CIFAR-10's labels are 0..{CLASSES - 1}")
    # (N, C, H, W) as stored -> (N, H, W, C), contiguous for HDF5's chunks.
    images = np.ascontiguousarray(records[:, 1:].reshape(-1, CHANNELS, SIDE, SIDE)
                                  .transpose(0, 2, 3, 1))
    return images, labels


def read_batches(paths):
    """The batches at paths, concatenated in order."""
    parts = [read_cifar10(p) for p in paths]
    return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])
