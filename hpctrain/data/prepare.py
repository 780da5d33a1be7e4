"""IDX, CIFAR-10, image folders, NumPy, HDF5 or CSV -> class-balanced HDF5 shards + manifest.json, atomically.

    python -m hpctrain.data prepare --source data/mnist-5k --out data/mnist --shards 8

or in code `prepare(source, out, shards=8)`, which returns the manifest. The
source is the standard train-/t10k- IDX quartet (MNIST, Fashion-MNIST,
KMNIST; EMNIST's emnist-SPLIT-train-/test- quartet too) or CIFAR-10's binary
batches (data_batch_1..5.bin + test_batch.bin); their split is kept. Or it is
one IDX images/labels pair, split here, stratified by class. Or it is what
users bring: a folder of class folders of images (images.py: an optional
test/ beside train/ is kept), an .npz (x/y, or Keras' x_train/y_train/
x_test/y_test, kept), two .npy files, an HDF5 file with two named datasets,
or a CSV of label + pixels (arrays.py); those without a test set are split
here as the single pair is, and their manifests add `preprocess` (how the
pixels were made), image folders' `class_names`; so do the datasets fetch
knows (known.py: MNIST, Fashion-MNIST, KMNIST, EMNIST, CIFAR-10). `--no-flip` adds
`"no_flip": true` (training then refuses --augment flip). The manifest
records the image shape (rows, cols[, channels]) and the class count (the
largest label + 1), from which training builds its model. Every shard gets every
class (the stratified deal), and everything is written to a temporary sibling
of --out and renamed into place, so --out is either complete or untouched;
a stop signal removes the temporary folder (exit 75, Ctrl-C 130), and the
folders of killed prepares are swept when their process is gone.
--val-fraction F holds out a validation part (val-00000-of-00001.h5, the
manifest's "val"): of each class, the last round(F * its count) training
images in the deterministic order above; training shards exclude them. F 0
(the default) writes exactly what it did before the option existed.
Finding and reading the source is sources.py's; this module splits, deals,
writes and installs. No MPI here (house rule).
"""

import json
import os
import secrets
import shutil
import sys
from pathlib import Path

import h5py
import numpy as np

from hpctrain.base.errors import HpctrainError
from hpctrain.base.overwrites import Input, Output, check_not_inputs

from . import arrays, known
from .cifar import read_batches
from .manifest import FORMAT, FORMAT_VERSION, MANIFEST, _sha256, bundled_sample_dir, is_prepared, shard_name
from .sources import _find_source_files, _load_user_source, _read_pair, is_image_folder
from .stopping import signals_held, stops_cleanly, sweep_stale_tmps

# Rows per HDF5 chunk: ~800 KB of 28x28 images, under HDF5's 1 MiB default
# chunk cache, and small enough that a worker's hyperslab reads little extra.
# Larger images get fewer rows, so a chunk stays under the cache (CIFAR-10: 341).
_CHUNK_ROWS = 1024
_CHUNK_BYTES = 1 << 20


# ---------------------------------------------------------------------------
# Splitting the source and dealing it over the shards

def _load_split(layout, paths, shards, test_fraction, seed, val_fraction=0.0):
    """((train_x, train_y, train_parts), (test_x, test_y, test_parts)): the
    arrays of each split and, per shard, the positions into them it gets."""
    if layout == "standard":
        train = _read_pair(paths["train_images"], paths["train_labels"])
        test = _read_pair(paths["test_images"], paths["test_labels"])
        return _split(train, test, shards, test_fraction, seed, val_fraction, paths["test_images"])
    if layout == "cifar-10":
        train = read_batches([p for role, p in paths.items() if role != "test"])
        return _split(train, read_batches([paths["test"]]), shards, test_fraction, seed, val_fraction, paths["test"])
    return _split(_read_pair(paths["images"], paths["labels"]), None, shards, test_fraction, seed, val_fraction)


def _split(train, test, shards, test_fraction, seed, val_fraction=0.0, test_name=None):
    """The splits of (images, labels) arrays: test given, it is kept (train is
    dealt to the shards); None, test_fraction of each class of train is split
    off as the test set, stratified."""
    if test is not None:
        train_x, train_y = train
        test_x, test_y = test
        if train_x.shape[1:] != test_x.shape[1:]:
            raise HpctrainError(f"{test_name}: images are {test_x.shape[1:]}, training images are "
                                f"{train_x.shape[1:]}")
        rng = np.random.default_rng(seed)
        train_idx, val = _val_split((train_x, train_y), np.arange(len(train_y)), val_fraction)
        train_parts = _stratified_deal(train_y, train_idx, shards, rng)
        test_parts = [np.arange(len(test_y))]
        return (train_x, train_y, train_parts), (test_x, test_y, test_parts), val

    images, labels = train
    rng = np.random.default_rng(seed)
    train_idx, test_idx = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = int(np.floor(len(idx) * test_fraction + 0.5))
        test_idx.append(idx[:k])
        train_idx.append(idx[k:])
    train_idx = np.concatenate(train_idx) if train_idx else np.empty(0, np.intp)
    test_idx = np.concatenate(test_idx) if test_idx else np.empty(0, np.intp)
    train_idx, val = _val_split((images, labels), train_idx, val_fraction)
    # All splits index the same arrays; the parts keep them apart.
    train_parts = _stratified_deal(labels, train_idx, shards, rng)
    test_parts = [rng.permutation(test_idx)]
    return (images, labels, train_parts), (images, labels, test_parts), val


def _val_split(arrays, index, val_fraction):
    """(train positions, val split or None): --val-fraction 0 holds out nothing."""
    if not val_fraction:
        return index, None
    return _hold_out_val((*arrays, [index]), val_fraction)


def _hold_out_val(train, val_fraction):
    """(train positions, val split): the last round(F * n_c) of each class c of train's
    positions, in their order, held out as a validation part. Per class, so
    a label-sorted source still gives the val part every class; no random
    draw, so the training deal's generator sees exactly what it did before."""
    x, y, parts = train
    index = np.concatenate(parts)
    keep = np.ones(len(index), bool)
    for c in np.unique(y[index]):
        at = np.flatnonzero(y[index] == c)
        k = int(np.floor(len(at) * val_fraction + 0.5))
        keep[at[len(at) - k:]] = False
    return index[keep], (x, y, [index[~keep]])


def _check_fits(splits, num_classes, source):
    """The arrays fit the manifest they will be written with: uint8 images
    of one 2-D or 3-D shape (rows, cols[, channels]) in both splits, uint8
    labels below num_classes. The readers trust the manifest for all of it.
    source: the source files' names for the message (or their {role: path})."""
    shape = splits["train"][0].shape[1:]
    if not isinstance(source, str):
        source = ", ".join(p.name for p in source.values())
    for split, (x, y, _) in splits.items():
        if x.dtype != np.uint8 or not 2 <= x.ndim - 1 <= 3 or 0 in x.shape[1:]:
            raise HpctrainError(f"{source}: {split} images must be uint8 of 2 or 3 "
                                f"dimensions each, got {x.dtype} {x.shape}")
        if x.shape[1:] != shape:
            raise HpctrainError(f"{source}: {split} images are {x.shape[1:]}, training "
                                f"images are {shape}")
        if y.dtype != np.uint8 or y.ndim != 1 or (len(y) and int(y.max()) >= num_classes):
            raise HpctrainError(f"{source}: {split} labels must be uint8 below {num_classes}, "
                                f"got {y.dtype} {y.shape}")


def _check_classes(source, train_labels, test_labels, num_classes, warn):
    """Classes are 0..largest label: one class is nothing to learn (an error);
    a class with no sample below the largest is far more often a corrupt label
    than a real class (a warning: the model gets an output for each)."""
    arrays = [train_labels] if test_labels is train_labels else [train_labels, test_labels]
    counts = sum(np.bincount(y, minlength=num_classes) for y in arrays)
    present = np.flatnonzero(counts)
    if len(present) < 2:
        raise HpctrainError(f"{source}: every label is {present[0] if len(present) else '(none)'}: "
                            f"one class is nothing to classify (a wrong or damaged source?)")
    empty = np.flatnonzero(counts == 0)
    if len(empty):
        top = num_classes - 1
        warn(f"{source}: labels run to {top}, but class{'es' if len(empty) > 1 else ''} "
             f"{_ranges(empty)} ha{'ve' if len(empty) > 1 else 's'} no sample and class {top} "
             f"has {counts[top]}: a corrupt label? the model gets {num_classes} outputs")


def _ranges(numbers):
    """[3, 4, 5, 9] -> '3-5, 9'."""
    runs = []
    for n in map(int, numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def _stratified_deal(labels, index, shards, rng):
    """Deal `index` (positions into labels) to shards, class by class, round-robin.

    The deal continues where the previous class stopped, so shard sizes differ
    by at most one overall and each class's count differs by at most one across
    shards: a label-sorted source still gives every shard every class.
    """
    members = [[] for _ in range(shards)]
    start = 0
    for c in np.unique(labels[index]):
        idx = rng.permutation(index[labels[index] == c])
        slot = (start + np.arange(len(idx))) % shards
        for s in range(shards):
            members[s].append(idx[slot == s])
        start = (start + len(idx)) % shards
    return [rng.permutation(np.concatenate(m)) if m else np.empty(0, np.intp) for m in members]


# ---------------------------------------------------------------------------
# Writing shards and the manifest

def _write_shard(path, images, labels, split, index, count):
    row_bytes = max(1, images[0].nbytes if len(images) else 1)
    rows = max(1, min(len(images), _CHUNK_ROWS, _CHUNK_BYTES // row_bytes))
    # HDF5 refuses a chunk larger than a fixed-size dataset, even an empty one.
    chunks = (rows,) + images.shape[1:] if len(images) else True
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=images, chunks=chunks,
                         compression="gzip", compression_opts=4)
        f.create_dataset("labels", data=labels, dtype=np.uint8)
        f.attrs["split"] = split
        f.attrs["shard"] = index
        f.attrs["num_shards"] = count


def _shard_entry(path, labels, num_classes):
    return {
        "file": path.name,
        "num_samples": int(len(labels)),
        "per_class": _per_class(labels, num_classes),
        "bytes": path.stat().st_size,
        "sha256": _sha256(path),
    }


def _per_class(labels, num_classes):
    counts = np.bincount(labels, minlength=num_classes)
    return {str(c): int(n) for c, n in enumerate(counts)}


def _write_shards(tmp, splits, num_classes):
    """Write every shard of every split into tmp; return their manifest entries."""
    entries = {}
    for split, (x, y, parts) in splits.items():
        entries[split] = []
        for i, part in enumerate(parts):
            path = tmp / shard_name(split, i, len(parts))
            _write_shard(path, x[part], y[part], split, i, len(parts))
            entries[split].append(_shard_entry(path, y[part], num_classes))
    return entries


def _source_files(paths):
    """The manifest's record of IDX or CIFAR-10 source files."""
    return [{"role": role, "name": p.name, "bytes": p.stat().st_size, "sha256": _sha256(p)}
            for role, p in paths.items()]


def _build_manifest(source, layout, files, seed, test_fraction, splits, entries, num_classes,
                    val_fraction=0.0, split_here=None, extra=None):
    """split_here: whether the test set was split off here (default: the
    single-pair IDX layout). extra: keys only some sources have (class_names,
    preprocess, no_flip): absent otherwise, so manifests of IDX and CIFAR-10
    sources stay as they were."""
    split_here = layout == "single" if split_here is None else split_here
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "source": {
            "dir": str(source),
            "layout": layout,
            "files": files,
        },
        "seed": int(seed),
        "test_fraction": float(test_fraction) if split_here else None,
        "image_shape": [int(d) for d in splits["train"][0].shape[1:]],
        "dtype": "uint8",
        "num_classes": num_classes,
    }
    manifest.update(extra or {})
    if "val" in splits:   # absent without a val part: manifests stay as they were
        manifest["val_fraction"] = float(val_fraction)
    for split, (_, y, parts) in splits.items():
        all_idx = np.concatenate(parts) if parts else np.empty(0, np.intp)
        manifest[split] = {
            "num_samples": int(len(all_idx)),
            "per_class": _per_class(y[all_idx], num_classes),
            "shards": entries[split],
        }
    return manifest


# ---------------------------------------------------------------------------
# prepare

@stops_cleanly
def prepare(source, out, shards=8, test_fraction=0.1, seed=0, force=False, log=print, val_fraction=0.0,
            warn=None, images=None, labels=None, image_size=None, grayscale=False, no_flip=False):
    """Write class-balanced HDF5 shards and manifest.json; return the manifest.

    source holds the standard train-/t10k- files or CIFAR-10's batches (their
    split is kept, test_fraction is ignored) or one images/labels pair, which is split here,
    stratified by class. Or source is a folder of class folders of images
    (images.py; a test/ folder beside train/ is kept as the test set), an
    .npz, HDF5 or CSV file (arrays.py; images/labels name the arrays in an
    .npz or HDF5 file); or source is None and images/labels are two .npy
    files. Sources without a test set of their own are split as the single
    pair is. image_size (H, W): image folders are resized to it, flat rows
    shaped by it; grayscale: image folders in grayscale. no_flip: the
    manifest says that flipping changes these images' classes (digits,
    letters): training refuses --augment flip on them.
    val_fraction > 0 holds out that share of each
    training class as a "val" part (_hold_out_val). warn: where a line about
    doubtful labels goes (default: stderr, `hpctrain: warning: ...`). Everything is written
    to a temporary sibling of out
    and renamed into place, so out is either complete or untouched.
    """
    log = log or (lambda *a: None)
    warn = warn or (lambda line: print(f"hpctrain: warning: {line}", file=sys.stderr, flush=True))
    if source is None and images is None:
        source = bundled_sample_dir()
    source, out = (Path(source) if source is not None else None), _resolve_out(out)
    if not isinstance(shards, (int, np.integer)) or shards < 1:
        raise HpctrainError(f"--shards must be a positive integer, got {shards!r}")
    if not 0 <= test_fraction < 1:
        raise HpctrainError(f"--test-fraction must be in [0, 1), got {test_fraction}")
    if not 0 <= val_fraction < 1:
        raise HpctrainError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if image_size is not None:
        image_size = arrays.parse_size(image_size)
    inputs = [(source, "--source")] if source is not None else [(Path(images), "--images"),
                                                                (Path(labels or images), "--labels")]
    for path, flag in inputs:
        _check_not_input(path, out, flag)
    _check_out(out, force)

    loaded = _load_user_source(source, images, labels, image_size, grayscale, warn)
    extra = {"no_flip": True} if no_flip else {}
    if loaded is None:
        layout, paths = _find_source_files(source)
        train, test, val = _load_split(layout, paths, shards, test_fraction, seed, val_fraction)
        files, split_here, names = _source_files(paths), None, ", ".join(p.name for p in paths.values())
    else:
        layout, files, split_here = loaded.layout, loaded.files, loaded.test is None
        train, test, val = _split(loaded.train, loaded.test, shards, test_fraction, seed, val_fraction,
                                  f"{source} (test)")
        names = str(source) if source is not None else f"{images}, {labels}"
        extra.update(preprocess=loaded.preprocess)
        if loaded.class_names is not None:
            extra.update(class_names=loaded.class_names)
        source = source if source is not None else Path(images).parent
    splits = {"train": train, "test": test}
    if val is not None:
        if not len(val[2][0]):
            raise HpctrainError(f"--val-fraction {val_fraction:g} holds out no training image "
                                f"(it rounds to 0 in every class); use a larger fraction")
        splits["val"] = val
    n_train = sum(len(p) for p in train[2])
    if n_train < shards:
        raise HpctrainError(f"{source}: {n_train} training samples, fewer than "
                            f"--shards {shards}; use fewer shards")
    num_classes = int(max(train[1].max(initial=0), test[1].max(initial=0))) + 1
    if loaded is not None and loaded.class_names is not None:
        num_classes = len(loaded.class_names)   # a class may be missing from a split, never from the names
    if loaded is None:
        known_names = known.class_names(layout, paths, num_classes)   # MNIST, Fashion-MNIST, ...: their names
        if known_names is not None:
            extra.update(class_names=known_names)
    _check_fits(splits, num_classes, names)
    _check_classes(source, train[1], test[1], num_classes, warn)

    sweep_stale_tmps(out, log)
    tmp = _tmp_name(out)   # (stopping.py's pattern knows its names)
    try:
        _make_tmp(tmp, out)   # in the try: a stop right after the mkdir removes it too
        entries = _write_shards(tmp, splits, num_classes)
        manifest = _build_manifest(source, layout, files, seed, test_fraction, splits, entries,
                                   num_classes, val_fraction, split_here, extra)
        _install(tmp, manifest, out, force)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise HpctrainError(f"{out}: cannot write shards ({e})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    sizes = [e["num_samples"] for e in entries["train"]]
    held = f"{manifest['val']['num_samples']} validation samples, " if "val" in manifest else ""
    log(f"prepared {out}: {n_train} training samples in {shards} shards "
        f"({min(sizes)}-{max(sizes)} each), {held}{manifest['test']['num_samples']} test samples, "
        f"{num_classes} classes, from {layout} layout in {source}")
    return manifest


# ---------------------------------------------------------------------------
# The output directory: checked first, replaced last

def _resolve_out(out):
    """--out as a Path; a link's target, to keep a data/mnist -> /scratch/...
    link pointing at the new shards."""
    out = Path(out)
    return out.resolve() if out.is_symlink() else out


def _check_not_input(source, out, flag="--source", images=True):
    """--out must not be, or contain, --source: installing the shards replaces
    out as a whole, and with --force that would delete the IDX files. Nor may
    it lie inside an image folder: its shards' folder would be taken as a
    class by every later prepare of that folder (images=False: a text
    folder, whose later prepares read its .txt files only, none of the
    shards'; it was refused as "the image folder", issue 54, 10)."""
    # The one check of outputs against inputs (hpctrain/base/overwrites.py): out
    # is replaced whole, so the source must be neither it nor inside it.
    check_not_inputs([Output(str(out), "--out", folder=True)],
                     [Input(str(source), f"the {flag} {'folder' if source.is_dir() else 'file'}", inside=False)])
    src, dst = source.resolve(), out.resolve()
    if images and src in dst.parents and is_image_folder(source):
        raise HpctrainError(f"--out {out} is inside the image folder --source {source}: the shards' folder would "
                            f"be taken as a class the next time; write them elsewhere")


def _check_out(out, force):
    """out: absent, an empty folder, or (with --force) a prepared dataset.
    --force replaces nothing else: a mistyped --out must not delete a
    folder of the user's own files."""
    if out.exists() and not out.is_dir():
        raise HpctrainError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise HpctrainError(f"{out}: already exists (use --force to overwrite)")
        if not is_prepared(out):
            raise HpctrainError(f"{out}: holds files but no {MANIFEST}, so it is not a prepared dataset; --force "
                                f"replaces only a prepared dataset or an empty folder: choose another --out")


def _tmp_name(out):
    """A temporary sibling of out, this process's own: .NAME.tmp-PID-RANDOM."""
    return out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def _make_tmp(tmp, out):
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # Not mkdtemp: its mode 0700 would survive the rename and hide the
        # shards from other users; mkdir honours the umask.
        tmp.mkdir()
    except OSError as e:
        raise HpctrainError(f"{out}: cannot create output directory ({e})") from None


def _install(tmp, manifest, out, force):
    """The manifest written into tmp, then tmp put in out's place (an old
    out moved aside first and removed after), signals held over the swap."""
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    with signals_held():
        _check_out(out, force)
        old = None
        if out.is_dir():
            if any(out.iterdir()):
                old = out.parent / f".{out.name}.old-{os.getpid()}"
                shutil.rmtree(old, ignore_errors=True)
                os.rename(out, old)
            else:
                out.rmdir()
        try:
            os.rename(tmp, out)
        except OSError:
            if old is not None:
                os.rename(old, out)
            elif out.is_dir() and any(out.iterdir()):
                # Another process prepared out between our check and this rename.
                raise HpctrainError(f"{out}: already exists (use --force to overwrite)") from None
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
