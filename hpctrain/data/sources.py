"""Finding and reading a prepare source: which layout a directory holds
(the IDX quartet of MNIST and its kin, EMNIST's, CIFAR-10's batches, one
IDX images/labels pair) and its files, an IDX pair read and checked, and
what users bring (an .npz, HDF5 or CSV file, two .npy files, a folder of
class folders of images) loaded through arrays.py and images.py. prepare.py
splits, deals and writes what these return. No MPI here (house rule).

    .venv/bin/python -m pytest -q tests/test_data.py tests/test_datasets.py tests/test_user_data.py
"""
import re

from hpctrain.base.errors import HpctrainError

from . import arrays
from . import images as images_mod
from .idx import read_idx

# MNIST's names, and EMNIST's (emnist-balanced-train-images-idx3-ubyte.gz, ...).
_STANDARD_RE = re.compile(
    r"^((?:emnist-[a-z]+-)?)(train|t10k|test)-(images|labels)[-.](idx[13])-ubyte(\.gz)?$")
_CIFAR_TRAIN_RE = re.compile(r"^data_batch_(\d+)\.bin$")
_CIFAR_TEST = "test_batch.bin"
_CIFAR_DIR = "cifar-10-batches-bin"   # what the CIFAR-10 archive unpacks to


def _find_source_files(source):
    if not source.exists():
        raise HpctrainError(f"{source}: no such directory")
    if not source.is_dir():
        raise HpctrainError(f"{source}: not a directory (expected a directory of IDX files)")
    # Prefer foo.gz over foo when both exist: .gz is what fetch verified.
    by_stem = {}
    for p in sorted(source.iterdir()):
        if p.is_file():
            stem = p.name[:-3] if p.name.endswith(".gz") else p.name
            if stem not in by_stem or p.name.endswith(".gz"):
                by_stem[stem] = p
    files = sorted(by_stem.values())

    groups = {}   # prefix ("" or "emnist-SPLIT-") -> the quartet's files found
    for p in files:
        m = _STANDARD_RE.match(p.name)
        if m and (m.group(3) == "images") == (m.group(4) == "idx3"):
            split = "train" if m.group(2) == "train" else "test"
            groups.setdefault(m.group(1), {})[f"{split}_{m.group(3)}"] = p
    complete = {k: v for k, v in groups.items() if len(v) == 4}
    if len(complete) > 1:
        names = ", ".join(f"{k or ''}train-..." for k in sorted(complete))
        raise HpctrainError(f"{source}: holds more than one dataset ({names}); put one "
                            f"dataset's files in a directory of its own")
    if complete:
        return "standard", next(iter(complete.values()))

    cifar = _find_cifar(source, files)
    if cifar:
        return "cifar-10", cifar

    images = [p for p in files if "images" in p.name and "idx3" in p.name]
    labels = [p for p in files if "labels" in p.name and "idx1" in p.name]
    if len(images) == 1 and len(labels) == 1:
        return "single", {"images": images[0], "labels": labels[0]}
    found = ", ".join(p.name for p in images + labels) or "none"
    raise HpctrainError(
        f"{source}: expected train-/t10k-images-idx3-ubyte[.gz] + -labels-idx1-ubyte[.gz], "
        f"CIFAR-10's data_batch_N.bin + {_CIFAR_TEST}, or exactly one *images*idx3* and one "
        f"*labels*idx1* file (found: {found})")


def _find_cifar(source, files):
    """{"train_1": data_batch_1.bin, ..., "test": test_batch.bin} in source
    (or in the cifar-10-batches-bin directory the archive unpacks to), or None."""
    inner = source / _CIFAR_DIR
    if not any(p.name == _CIFAR_TEST for p in files) and inner.is_dir():
        files = sorted(p for p in inner.iterdir() if p.is_file())
    train = {int(m.group(1)): p for p in files if (m := _CIFAR_TRAIN_RE.match(p.name))}
    test = [p for p in files if p.name == _CIFAR_TEST]
    if not test and not train:
        return None
    if not test or not train:
        raise HpctrainError(f"{source}: CIFAR-10 needs data_batch_N.bin and {_CIFAR_TEST} "
                            f"(found {', '.join(p.name for p in [*train.values(), *test])})")
    return {**{f"train_{n}": train[n] for n in sorted(train)}, "test": test[0]}


def _read_pair(images_path, labels_path):
    images = read_idx(images_path, "images")
    labels = read_idx(labels_path, "labels")
    if images.ndim != 3:
        raise HpctrainError(f"{images_path}: expected 3 dimensions (N, rows, cols), "
                            f"got shape {images.shape}")
    if labels.ndim != 1:
        raise HpctrainError(f"{labels_path}: expected 1 dimension (N,), got shape {labels.shape}")
    if len(images) != len(labels):
        raise HpctrainError(f"{images_path}: {len(images)} images but {labels_path.name} "
                            f"has {len(labels)} labels")
    return images, labels


_ARRAY_FILES = {".npz": "npz", ".h5": "hdf5", ".hdf5": "hdf5", ".hdf": "hdf5", ".csv": "csv"}


def _load_user_source(source, images, labels, image_size, grayscale, warn=images_mod.stderr_warning):
    """The arrays of a source that is not IDX or CIFAR-10 (arrays.Loaded), or
    None for those (the directory's files say which). warn: where a line
    about images too large for comfort goes."""
    if source is None:
        if labels is None:
            raise HpctrainError("--images A.npy needs --labels B.npy (or give --source FILE)")
        return arrays.load_npy(images, labels, image_size)
    kind = _ARRAY_FILES.get(source.suffix.lower())
    if source.is_file() or (kind and not source.is_dir()):
        if kind is None:
            raise HpctrainError(f"{source}: a file, expected a directory (IDX files, CIFAR-10 batches or class "
                                f"folders of images) or an .npz, .h5 or .csv file")
        if grayscale:
            raise HpctrainError(f"--grayscale converts image folders; {source} holds arrays (give them 2-D images)")
        if kind == "npz":
            return arrays.load_npz(source, images, labels, image_size)
        if kind == "hdf5":
            return arrays.load_hdf5(source, images, labels, image_size)
        if images is not None or labels is not None:
            raise HpctrainError(f"--images/--labels name arrays in an .npz or HDF5 file; {source} is a CSV file "
                                f"(label first, then pixels)")
        return arrays.load_csv(source, image_size)
    if images is not None or labels is not None:
        raise HpctrainError(f"--images/--labels name arrays in an .npz or HDF5 --source, or two .npy files "
                            f"without --source; {source} is a directory")
    if not source.is_dir():
        return None   # _find_source_files says what is wrong with it
    if is_image_folder(source):
        return images_mod.load_folder(source, image_size, grayscale, warn)
    if image_size is not None or grayscale:
        raise HpctrainError(f"--image-size and --grayscale are for image folders (and --image-size for flat "
                            f"rows); {source} holds IDX or CIFAR-10 files, taken as they are")
    return None


def is_image_folder(source):
    """Whether source is read as a folder of class folders of images."""
    return source.is_dir() and not _looks_like_idx_or_cifar(source) and images_mod.has_class_folders(source)


def _looks_like_idx_or_cifar(source):
    """Whether a directory holds the files _find_source_files looks for."""
    try:
        names = [p.name for p in source.iterdir()]
    except OSError:
        return False
    return any("idx1" in n or "idx3" in n or _CIFAR_TRAIN_RE.match(n) or n in (_CIFAR_TEST, _CIFAR_DIR)
               for n in names)
