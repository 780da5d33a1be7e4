"""What a checkpoint file may hold before its datasets are read: the rules
that keep a file with a valid header but crafted contents (or another
tool's) from making checkpoints/reader.read allocate more than the file's own size,
read other files, or hand resume counts it cannot compute with.

A file that breaks them is Refused (resume stops with one line: it is never
skipped for an older one); one that is merely damaged is Corrupt (skipped).
Used by checkpoints/reader.read, and for a --save file's tensors by trained.py
(hard_linked, stored_inside); tested in tests/test_checkpoint.py and
tests/test_predict.py:

    .venv/bin/python -m pytest -q tests/test_checkpoint.py -k crafted
"""
import numpy as np

from ..base.precision import FLOATS, file_dtype


class Corrupt(Exception):
    """A checkpoint file that cannot be trusted: skip it for the previous one."""


class Refused(Corrupt):
    """A file with a valid header holding what save() never writes (crafted,
    or another tool's): resuming stops with one line instead of skipping it."""


# The largest step, optimizer step, epoch, position or sample count a
# checkpoint may hold: far above any run, far below int64's overflow.
MAX_COUNT = 2 ** 53


def stored_dataset(f, key, file_size):
    """f[key], unread, once it is stored as save() stores it: hard links all
    the way (a soft or external link would lead elsewhere), a dataset of
    a precision's float (params, optimizer state: hpctrain/base/precision.py's
    FLOATS, a dtype this code does not run is refused, never converted) or
    int64 (data_positions), of 1 or 2
    dimensions, its bytes contiguous inside this file: no chunks (a small
    file could then claim any size: unwritten chunks read as zeros), filters,
    virtual sources or external storage (which reads whatever file it names)."""
    obj = hard_linked(f, key)
    want = [np.dtype("<i8")] if key == "data_positions" else [file_dtype(d) for d in FLOATS]
    if obj.dtype not in want or obj.ndim != (2 if key == "data_positions" else 1):
        raise Corrupt(f"dataset {key} is {obj.dtype} {obj.shape}, expected {' or '.join(w.name for w in want)} with "
                       f"{2 if key == 'data_positions' else 1} dimension(s)")
    return stored_inside(obj, key, file_size)


def hard_linked(f, key):
    """The dataset f[key], unread, reached through hard links only: Refused
    for a soft or external link on the way (it would lead to another place
    or file), Corrupt where there is no dataset. Also the rule for the
    tensors of a --save file (trained.py)."""
    import h5py
    parts = key.split("/")
    for i in range(1, len(parts) + 1):
        name = "/".join(parts[:i])
        link = f.get(name, getlink=True)
        if link is None:
            raise Corrupt(f"missing dataset {key}")
        if not isinstance(link, h5py.HardLink):
            kind = {"SoftLink": "a soft link", "ExternalLink": "an external link"}.get(type(link).__name__, "a link")
            raise Refused(f"{name} is {kind}, not a dataset stored in the file")
    obj = f[key]
    if not isinstance(obj, h5py.Dataset):
        raise Corrupt(f"missing dataset {key}")
    return obj


def stored_inside(obj, key, file_size):
    """obj (the dataset `key`), once its bytes lie contiguous inside a file
    of file_size bytes: Refused for chunks, filters, virtual or external
    storage, or more bytes than the file holds."""
    import h5py
    plist = obj.id.get_create_plist()
    if plist.get_layout() != h5py.h5d.CONTIGUOUS or plist.get_external_count():
        raise Refused(f"dataset {key} is not stored contiguously in the file (chunked, virtual or "
                       f"external storage)")
    offset = obj.id.get_offset()
    if offset is None or obj.id.get_storage_size() != obj.nbytes or offset + obj.nbytes > file_size:
        raise Refused(f"dataset {key} claims {obj.nbytes} bytes that the file ({file_size} bytes) does not hold")
    return obj


def plain(value):
    """An attribute as h5py reads it -> the Python value it was written as."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) and value.shape == ():
        return value.item()
    return value


def check_attr_types(attrs):
    """Every attribute a plain int, finite float or str, as save() writes them."""
    for key, value in attrs.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise Refused(f"attribute {key} is a {type(value).__name__}, not an int, float or str")
        if isinstance(value, float) and not np.isfinite(value):
            raise Refused(f"attribute {key} is {value}")


def check_ranges(attrs, positions):
    """The counts a resume computes with, in range: step, optimizer step,
    samples, workers, each worker's (epoch, position), --keep-best's best."""
    def within(what, value, lo, hi=MAX_COUNT):
        if not lo <= value <= hi:
            raise Refused(f"{what} {value} is out of range ({lo}..{hi})")
    within("step", attrs["step"], 0)
    within("optimizer_t", attrs["optimizer_t"], 0)
    if positions.shape[0] < 1:
        raise Refused("data_positions has no rows")
    within("a data position's epoch", int(positions[:, 0].min()), 0)
    within("a data position's epoch", int(positions[:, 0].max()), 0)
    within("a data position", int(positions[:, 1].min()), 0)
    within("a data position", int(positions[:, 1].max()), 0)
    counts = {"num_workers": (positions.shape[0], positions.shape[0]), "samples": (0, MAX_COUNT),
              "best_val_step": (-1, attrs["step"])}
    for key, (lo, hi) in counts.items():
        if key in attrs:
            if not isinstance(attrs[key], int):
                raise Refused(f"attribute {key} is not an integer")
            within(key, attrs[key], lo, hi)
    if "best_val_accuracy" in attrs:
        within("best_val_accuracy", attrs["best_val_accuracy"], -1, 1)
    if "best_val_loss" in attrs:
        within("best_val_loss", attrs["best_val_loss"], -1)
