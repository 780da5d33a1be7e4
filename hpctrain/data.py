"""MNIST-style data for hpctrain: IDX reader, HDF5 shard writer, per-worker shard reader.

Turn IDX files into class-balanced HDF5 shards once, then let each worker read
only its own shards (or its own slice of one shard) while training:

    python -m hpctrain.data prepare --source data/mnist-5k --out data/mnist --shards 8
    python -m hpctrain.data fetch --dataset mnist --out data/raw/mnist
    python -m hpctrain.data prepare --source data/raw/mnist --out data/mnist --force

In code: `ShardReader(dir, worker, num_workers, batch_size, seed).next_batch()`
for training batches, `load_test(dir, part, parts)` for a rank's share of the
test set. No MPI here (house rule): callers pass worker numbers, not ranks.
"""

import argparse
import gzip
import hashlib
import http.client
import json
import os
import re
import secrets
import shutil
import socket
import sys
import tempfile
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import h5py
import numpy as np

from hpctrain.errors import HpctrainError

FORMAT = "hpctrain-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"

# IDX type codes; only unsigned bytes occur in MNIST and Fashion-MNIST.
_IDX_UBYTE = 0x08
_IDX_MAGIC = {"images": 0x00000803, "labels": 0x00000801}
_GZIP_MAGIC = b"\x1f\x8b"
_MAX_IDX_BYTES = 1 << 36

# Rows per HDF5 chunk: ~800 KB of 28x28 images, under HDF5's 1 MiB default
# chunk cache, and small enough that a worker's hyperslab reads little extra.
_CHUNK_ROWS = 1024

STANDARD_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}

MIRRORS = {
    "mnist": "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "fashion-mnist": "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
}

# Published MD5s (torchvision's tables; Fashion-MNIST's also in Zalando's README).
# The one place checksums live, so a test can swap in its own.
MD5 = {
    "mnist": {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    },
    "fashion-mnist": {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    },
}

_PREPARE_HINT = "python -m hpctrain.data prepare --source data/mnist-5k --out DIR"


# ---------------------------------------------------------------------------
# Paths

def repo_root():
    return Path(__file__).resolve().parent.parent


def default_data_dir():
    """Where training looks for shards unless told otherwise: <repo>/data/mnist."""
    return repo_root() / "data" / "mnist"


def bundled_sample_dir():
    """The real 5,000-image MNIST sample shipped with the repository."""
    return repo_root() / "data" / "mnist-5k"


def is_prepared(data_dir):
    return (Path(data_dir) / MANIFEST).is_file()


def shard_name(split, index, count):
    return f"{split}-{index:05d}-of-{count:05d}.h5"


# ---------------------------------------------------------------------------
# IDX files

def read_idx(path, kind=None):
    """Read an IDX file (gzip-compressed or raw) into a uint8 array.

    kind="images" or "labels" also demands that magic (0x803 or 0x801), so a
    swapped pair of files is caught here rather than as a shape error later.
    """
    path = Path(path)
    try:
        with open(path, "rb") as raw:
            compressed = raw.read(2) == _GZIP_MAGIC
            raw.seek(0)
            if not compressed:
                return _parse_idx(raw, path, kind)
            try:
                with gzip.GzipFile(fileobj=raw, mode="rb") as f:
                    return _parse_idx(f, path, kind)
            except (OSError, EOFError, zlib.error) as e:
                # A cut-off download ends the deflate stream early (EOFError);
                # flipped bytes fail the CRC or the inflater (OSError, zlib.error).
                raise HpctrainError(f"{path}: corrupt gzip data ({e})") from None
    except FileNotFoundError:
        raise HpctrainError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise HpctrainError(f"{path}: is a directory, expected an IDX file") from None
    except PermissionError as e:
        raise HpctrainError(f"{path}: cannot read ({e.strerror})") from None


def _parse_idx(f, path, kind):
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
    dims_raw = _read_exact(f, 4 * ndim)
    if len(dims_raw) < 4 * ndim:
        raise HpctrainError(f"{path}: truncated IDX header ({4 + len(dims_raw)} bytes, "
                            f"expected {4 + 4 * ndim})")
    shape = tuple(int.from_bytes(dims_raw[4 * i:4 * i + 4], "big") for i in range(ndim))
    if np.prod(shape, dtype=np.float64) > _MAX_IDX_BYTES:
        # A damaged header must not turn into a multi-terabyte allocation.
        raise HpctrainError(f"{path}: corrupt IDX header (claims {'x'.join(map(str, shape))} "
                            f"elements)")
    out = np.empty(shape, dtype=np.uint8)
    got = _readinto_full(f, memoryview(out).cast("B"))
    if got < out.nbytes:
        dims = "x".join(map(str, shape))
        raise HpctrainError(f"{path}: truncated (header says {dims} = {out.nbytes} data "
                            f"bytes, file has {got})")
    if f.read(1):
        raise HpctrainError(f"{path}: more data than its header ({'x'.join(map(str, shape))}) "
                            f"says; not a valid IDX file")
    return out


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


# ---------------------------------------------------------------------------
# prepare: IDX -> class-balanced HDF5 shards + manifest

_STANDARD_RE = re.compile(r"^(train|t10k)-(images|labels)[-.](idx[13])-ubyte(\.gz)?$")


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

    standard = {}
    for p in files:
        m = _STANDARD_RE.match(p.name)
        if m and (m.group(2) == "images") == (m.group(3) == "idx3"):
            split = "train" if m.group(1) == "train" else "test"
            standard[f"{split}_{m.group(2)}"] = p
    if len(standard) == 4:
        return "standard", standard

    images = [p for p in files if "images" in p.name and "idx3" in p.name]
    labels = [p for p in files if "labels" in p.name and "idx1" in p.name]
    if len(images) == 1 and len(labels) == 1:
        return "single", {"images": images[0], "labels": labels[0]}
    found = ", ".join(p.name for p in images + labels) or "none"
    raise HpctrainError(
        f"{source}: expected train-/t10k-images-idx3-ubyte[.gz] + -labels-idx1-ubyte[.gz] "
        f"or exactly one *images*idx3* and one *labels*idx1* file (found: {found})")


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


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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


def _write_shard(path, images, labels, split, index, count):
    rows = max(1, min(len(images), _CHUNK_ROWS))
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


def prepare(source, out, shards=8, test_fraction=0.1, seed=0, force=False, log=print):
    """Write class-balanced HDF5 shards and manifest.json from IDX files; return the manifest.

    source holds the standard train-/t10k- files (their split is kept,
    test_fraction is ignored) or one images/labels pair, which is split here,
    stratified by class. Everything is written to a temporary sibling of out
    and renamed into place, so out is either complete or untouched.
    """
    log = log or (lambda *a: None)
    source, out = Path(source), Path(out)
    if out.is_symlink():
        # Keep a data/mnist -> /scratch/... link pointing at the new shards.
        out = out.resolve()
    if not isinstance(shards, (int, np.integer)) or shards < 1:
        raise HpctrainError(f"--shards must be a positive integer, got {shards!r}")
    if not 0 <= test_fraction < 1:
        raise HpctrainError(f"--test-fraction must be in [0, 1), got {test_fraction}")
    _check_not_input(source, out)
    _check_out(out, force)

    layout, paths = _find_source_files(source)
    if layout == "standard":
        train_x, train_y = _read_pair(paths["train_images"], paths["train_labels"])
        test_x, test_y = _read_pair(paths["test_images"], paths["test_labels"])
        if train_x.shape[1:] != test_x.shape[1:]:
            raise HpctrainError(f"{paths['test_images']}: images are {test_x.shape[1:]}, "
                                f"training images are {train_x.shape[1:]}")
        rng = np.random.default_rng(seed)
        train_parts = _stratified_deal(train_y, np.arange(len(train_y)), shards, rng)
        test_parts = [np.arange(len(test_y))]
    else:
        images, labels = _read_pair(paths["images"], paths["labels"])
        rng = np.random.default_rng(seed)
        train_idx, test_idx = [], []
        for c in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == c))
            k = int(np.floor(len(idx) * test_fraction + 0.5))
            test_idx.append(idx[:k])
            train_idx.append(idx[k:])
        train_idx, test_idx = np.concatenate(train_idx), np.concatenate(test_idx)
        train_x, train_y, test_x, test_y = images, labels, images, labels
        train_parts = _stratified_deal(labels, train_idx, shards, rng)
        test_parts = [rng.permutation(test_idx)]

    n_train = sum(len(p) for p in train_parts)
    if n_train < shards:
        raise HpctrainError(f"{source}: {n_train} training samples, fewer than "
                            f"--shards {shards}; use fewer shards")
    num_classes = int(max(train_y.max(initial=0), test_y.max(initial=0))) + 1

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # Not mkdtemp: its mode 0700 would survive the rename and hide the
        # shards from other users; mkdir honours the umask.
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
    except OSError as e:
        raise HpctrainError(f"{out}: cannot create output directory ({e})") from None
    try:
        entries = {"train": [], "test": []}
        for split, x, y, parts in (("train", train_x, train_y, train_parts),
                                   ("test", test_x, test_y, test_parts)):
            for i, part in enumerate(parts):
                path = tmp / shard_name(split, i, len(parts))
                _write_shard(path, x[part], y[part], split, i, len(parts))
                entries[split].append(_shard_entry(path, y[part], num_classes))

        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "source": {
                "dir": str(source),
                "layout": layout,
                "files": [{"role": role, "name": p.name, "bytes": p.stat().st_size,
                           "sha256": _sha256(p)} for role, p in paths.items()],
            },
            "seed": int(seed),
            "test_fraction": float(test_fraction) if layout == "single" else None,
            "image_shape": [int(d) for d in train_x.shape[1:]],
            "dtype": "uint8",
            "num_classes": num_classes,
        }
        for split, parts in (("train", train_parts), ("test", test_parts)):
            y = train_y if split == "train" else test_y
            all_idx = np.concatenate(parts) if parts else np.empty(0, np.intp)
            manifest[split] = {
                "num_samples": int(len(all_idx)),
                "per_class": _per_class(y[all_idx], num_classes),
                "shards": entries[split],
            }
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
        _install(tmp, out, force)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise HpctrainError(f"{out}: cannot write shards ({e})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    sizes = [e["num_samples"] for e in entries["train"]]
    log(f"prepared {out}: {n_train} training samples in {shards} shards "
        f"({min(sizes)}-{max(sizes)} each), {manifest['test']['num_samples']} test samples, "
        f"{num_classes} classes, from {layout} layout in {source}")
    return manifest


def _check_not_input(source, out):
    """--out must not be, or contain, --source: installing the shards replaces
    out as a whole, and with --force that would delete the IDX files."""
    src, dst = source.resolve(), out.resolve()
    if dst == src or dst in src.parents:
        raise HpctrainError(f"--out {out} {'is' if dst == src else 'contains'} --source {source}: "
                            f"preparing would replace the input files; write the shards elsewhere")


def _check_out(out, force):
    if out.exists() and not out.is_dir():
        raise HpctrainError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise HpctrainError(f"{out}: already exists (use --force to overwrite)")


def _install(tmp, out, force):
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


# ---------------------------------------------------------------------------
# fetch: download the standard gz files and verify their published MD5

def fetch(dataset, out, mirror=None, log=print, timeout=60):
    """Download dataset's four .gz files into out, verified against MD5; return their paths.

    A file already present with the right checksum is kept. Each download goes
    to a temporary name and is renamed only after its checksum matches, so out
    never holds a partial or wrong file under a real name.
    """
    log = log or (lambda *a: None)
    if dataset not in MD5:
        raise HpctrainError(f"unknown dataset {dataset!r} (choose from {', '.join(MD5)})")
    base = (mirror or MIRRORS[dataset]).rstrip("/") + "/"
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HpctrainError(f"{out}: cannot create directory ({e.strerror})") from None

    paths = []
    for name, expected in MD5[dataset].items():
        dest = out / name
        paths.append(dest)
        if dest.is_file():
            if _md5(dest) == expected:
                log(f"{dest}: present, checksum ok")
                continue
            log(f"{dest}: checksum mismatch, downloading again")
        url = base + name
        log(f"downloading {url}")
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.part-", dir=out)
        try:
            with os.fdopen(fd, "wb") as f:
                got = _download(url, f, timeout)
            if got != expected:
                raise HpctrainError(f"{url}: checksum mismatch (md5 {got}, expected "
                                    f"{expected}); download discarded")
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return paths


def _download(url, f, timeout):
    h = hashlib.md5(usedforsecurity=False)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            for block in iter(lambda: r.read(1 << 20), b""):
                h.update(block)
                f.write(block)
    except urllib.error.HTTPError as e:
        raise HpctrainError(f"{url}: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, (socket.timeout, TimeoutError)):
            raise _timeout(url, timeout) from None
        raise HpctrainError(f"{url}: cannot download ({e.reason}); "
                            f"offline? use --mirror URL") from None
    except (socket.timeout, TimeoutError):
        raise _timeout(url, timeout) from None
    except (OSError, http.client.HTTPException) as e:
        raise HpctrainError(f"{url}: download failed ({e})") from None
    return h.hexdigest()


def _timeout(url, timeout):
    return HpctrainError(f"{url}: no response within {timeout:g} s "
                         f"(network down or blocked? try --mirror URL)")


def _md5(path):
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------
# Reading shards

def load_manifest(data_dir):
    """The manifest of a prepared directory, with a clear error if there is none."""
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST
    if not data_dir.is_dir():
        raise HpctrainError(f"{data_dir}: no such directory; prepare shards first: "
                            f"{_PREPARE_HINT}")
    if not path.is_file():
        raise HpctrainError(f"{path}: missing, {data_dir} is not a prepared shard directory; "
                            f"prepare it: {_PREPARE_HINT}")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise HpctrainError(f"{path}: unreadable ({e}); prepare again with --force") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise HpctrainError(f"{path}: not an hpctrain shard manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise HpctrainError(f"{path}: manifest version {manifest.get('version')}, this "
                            f"hpctrain reads version {FORMAT_VERSION}; prepare again with --force")
    problem = _manifest_problem(manifest)
    if problem:
        raise HpctrainError(f"{path}: bad manifest: {problem}; prepare again with --force")
    return manifest


def _is_count(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _manifest_problem(manifest):
    """What is wrong with a manifest's structure (None if nothing): the keys
    and types the readers use, and shard names confined to the data
    directory. The manifest is input like any other file: a name such as
    ../../etc/passwd or /scratch/other/train.h5 must never be opened."""
    shape = manifest.get("image_shape")
    if not (isinstance(shape, list) and shape and all(_is_count(d) and d > 0 for d in shape)):
        return f"image_shape must be a list of positive integers, got {shape!r}"
    classes = manifest.get("num_classes")
    if not (_is_count(classes) and classes > 0):
        return f"num_classes must be a positive integer, got {classes!r}"
    for split in ("train", "test"):
        part = manifest.get(split)
        if not isinstance(part, dict) or not isinstance(part.get("shards"), list):
            return f"'{split}' must hold a list of shards"
        if split == "train" and not part["shards"]:
            return "no training shards"
        for entry in part["shards"]:
            if not isinstance(entry, dict):
                return f"a {split} shard entry is {type(entry).__name__}, not an object"
            name = entry.get("file")
            if not isinstance(name, str) or not name or name in (".", "..") or "/" in name \
                    or "\\" in name or "\0" in name:
                return f"shard file {name!r} is not a plain file name in the data directory"
            if not _is_count(entry.get("num_samples")):
                return f"{name}: num_samples must be a non-negative integer"
            if not isinstance(entry.get("sha256"), str):
                return f"{name}: sha256 missing"
        total = sum(e["num_samples"] for e in part["shards"])
        if part.get("num_samples") != total:
            return f"{split} num_samples {part.get('num_samples')!r}, its shards hold {total}"
    return None


def _open_h5(path):
    # Many ranks open the same shard; HDF5's file locks fail on some parallel
    # filesystems and buy nothing for read-only access.
    try:
        return h5py.File(path, "r", locking=False)
    except (TypeError, ValueError):  # h5py < 3.5, or HDF5 too old for the option
        return h5py.File(path, "r")


def _read_shard(data_dir, entry, image_shape, start=0, stop=None):
    """Rows [start, stop) of one shard, after checking it against the manifest."""
    path = Path(data_dir) / entry["file"]
    if not path.is_file():
        raise HpctrainError(f"{path}: missing shard (listed in {MANIFEST}); prepare again "
                            f"with --force")
    got = _sha256(path)
    if got != entry["sha256"]:
        raise HpctrainError(f"{path}: corrupt shard (sha256 {got[:12]}..., manifest says "
                            f"{entry['sha256'][:12]}...); prepare again with --force")
    n = entry["num_samples"]
    stop = n if stop is None else stop
    try:
        with _open_h5(path) as f:
            images, labels = f.get("images"), f.get("labels")
            ok = (isinstance(images, h5py.Dataset) and isinstance(labels, h5py.Dataset)
                  and images.shape == (n, *image_shape) and labels.shape == (n,)
                  and images.dtype == np.uint8 and labels.dtype == np.uint8)
            if not ok:
                raise HpctrainError(
                    f"{path}: bad shard: expected uint8 images {(n, *image_shape)} and "
                    f"labels {(n,)}, found {_describe(images)} and {_describe(labels)}")
            return images[start:stop], labels[start:stop]
    except OSError as e:
        raise HpctrainError(f"{path}: unreadable HDF5 shard ({e}); prepare again "
                            f"with --force") from None


def _describe(obj):
    if isinstance(obj, h5py.Dataset):
        return f"{obj.dtype} {obj.shape}"
    return "nothing" if obj is None else type(obj).__name__


def _bounds(n, parts):
    """Near-equal contiguous split of range(n): part i is [b[i], b[i+1])."""
    return [(i * n) // parts for i in range(parts + 1)]


def _to_float(images, out=None):
    # Divide in float32 (not multiply by 1/255) so training batches and the
    # test set see bit-identical pixel values.
    return np.divide(images, 255, out=out, dtype=np.float32)


class ShardReader:
    """Training batches for one worker, from its own shards only.

    With S shards and W <= S workers, worker w loads shards w, w+W, w+2W, ...
    With W > S, the workers sharing shard w % S each load a near-equal,
    contiguous slice of it. Either way the workers' parts are disjoint and
    together cover the training set. The part is held in memory as uint8.

    next_batch() returns arrays that the next call overwrites: copy them if
    they must outlive the step. position/seek make the batch sequence resumable.
    """

    def __init__(self, data_dir, worker, num_workers, batch_size, seed):
        if not (isinstance(num_workers, (int, np.integer)) and num_workers >= 1):
            raise HpctrainError(f"num_workers must be a positive integer, got {num_workers!r}")
        if not (isinstance(worker, (int, np.integer)) and 0 <= worker < num_workers):
            raise HpctrainError(f"worker must be in 0..{num_workers - 1}, got {worker!r}")
        if not (isinstance(batch_size, (int, np.integer)) and batch_size >= 1):
            raise HpctrainError(f"--batch-size must be a positive integer, got {batch_size!r}")
        self.data_dir = Path(data_dir)
        self.worker, self.num_workers = int(worker), int(num_workers)
        self.batch_size, self.seed = int(batch_size), int(seed)

        manifest = load_manifest(self.data_dir)
        shape = tuple(manifest["image_shape"])
        self.num_features = int(np.prod(shape))
        self.num_classes = int(manifest["num_classes"])
        shards = manifest["train"]["shards"]
        total = manifest["train"]["num_samples"]
        if self.num_workers > total:
            raise HpctrainError(f"{self.data_dir}: more workers ({self.num_workers}) than "
                                f"training samples ({total})")

        S, W, w = len(shards), self.num_workers, self.worker
        if W <= S:
            reads = [(shards[s], 0, shards[s]["num_samples"]) for s in range(w, S, W)]
        else:
            sharing = len(range(w % S, W, S))
            b = _bounds(shards[w % S]["num_samples"], sharing)
            j = w // S
            reads = [(shards[w % S], b[j], b[j + 1])]
        # Read each part straight into its place: peak memory is the worker's
        # data plus one part, not twice the data.
        count = sum(stop - start for _, start, stop in reads)
        self.images = np.empty((count, self.num_features), np.uint8)
        self.labels = np.empty(count, np.int64)
        at = 0
        for entry, start, stop in reads:
            x, y = _read_shard(self.data_dir, entry, shape, start, stop)
            self.images[at: at + len(x)] = x.reshape(len(x), -1)
            self.labels[at: at + len(y)] = y
            at += len(x)
            del x, y
        self.files = [entry["file"] for entry, _, _ in reads]
        self.num_samples = len(self.labels)
        if self.num_samples == 0:
            entry = reads[0][0]
            raise HpctrainError(
                f"{self.data_dir}: worker {w} of {W} gets no training samples "
                f"({entry['file']} has {entry['num_samples']} samples for "
                f"{len(range(w % S, W, S))} workers); use fewer workers or more shards")

        self._epoch, self._offset = 0, 0
        self._perm_epoch, self._perm = None, None
        self._ubuf = np.empty((self.batch_size, self.num_features), np.uint8)
        self._x = np.empty((self.batch_size, self.num_features), np.float32)
        self._y = np.empty(self.batch_size, np.int64)

    @property
    def position(self):
        """(epoch, offset) of the next batch; pass it to seek() to resume there."""
        return self._epoch, self._offset

    def seek(self, epoch, offset):
        n, B = self.num_samples, self.batch_size
        if epoch < 0 or offset < 0 or (offset > 0 and offset + B > n) or offset % B:
            raise HpctrainError(f"{self.data_dir}: cannot seek worker {self.worker} to "
                                f"epoch {epoch}, offset {offset} ({n} samples, batch {B})")
        self._epoch, self._offset = int(epoch), int(offset)

    def _permutation(self):
        if self._perm_epoch != self._epoch:
            rng = np.random.default_rng([self.seed, self._epoch, self.worker])
            self._perm, self._perm_epoch = rng.permutation(self.num_samples), self._epoch
        return self._perm

    def next_batch(self):
        """(x float32 (B, features) in [0, 1], y int64 (B,)); both reused by the next call."""
        n, B = self.num_samples, self.batch_size
        perm = self._permutation()
        if n >= B:
            idx = perm[self._offset:self._offset + B]
        else:
            # A part smaller than one batch still yields full batches, one epoch each.
            idx = np.resize(perm, B)
        self._offset += B
        if self._offset + B > n:
            # Drop the remainder rather than pad, so every batch is B distinct samples.
            self._epoch, self._offset = self._epoch + 1, 0
        np.take(self.images, idx, axis=0, out=self._ubuf, mode="clip")
        _to_float(self._ubuf, out=self._x)
        np.take(self.labels, idx, out=self._y, mode="clip")
        return self._x, self._y


def load_test(data_dir, part=0, parts=1, raw=False):
    """Contiguous part `part` of `parts` of the test set: (x float32 (n, features), y int64 (n,)).
    With raw=True, x stays uint8 pixels (a quarter of the memory; scale by 1/255 per batch).

    Parts are near-equal and together cover the test set once, so ranks can
    evaluate it together; a part is empty when parts exceeds the test set.
    """
    if not (isinstance(parts, (int, np.integer)) and parts >= 1 and 0 <= part < parts):
        raise HpctrainError(f"load_test: part must be in 0..parts-1 with parts >= 1, "
                            f"got part={part!r}, parts={parts!r}")
    manifest = load_manifest(data_dir)
    shape = tuple(manifest["image_shape"])
    features = int(np.prod(shape))
    b = _bounds(manifest["test"]["num_samples"], parts)
    lo, hi = b[part], b[part + 1]
    xs, ys = [np.empty((0, features), np.uint8 if raw else np.float32)], [np.empty(0, np.int64)]
    at = 0
    for entry in manifest["test"]["shards"]:
        n = entry["num_samples"]
        start, stop = max(lo - at, 0), min(hi - at, n)
        if start < stop:
            x, y = _read_shard(data_dir, entry, shape, start, stop)
            x = x.reshape(len(x), -1)
            xs.append(x if raw else _to_float(x))
            ys.append(y.astype(np.int64))
        at += n
    return np.concatenate(xs), np.concatenate(ys)


# ---------------------------------------------------------------------------
# Command line

def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m hpctrain.data",
        description="Prepare HDF5 training shards from IDX files, or download MNIST/Fashion-MNIST.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    pp = sub.add_parser("prepare", help="IDX files -> class-balanced HDF5 shards + manifest.json",
                        description="Write train-0000i-of-0000S.h5, test-00000-of-00001.h5 and "
                                    "manifest.json into --out, atomically.")
    pp.add_argument("--source", metavar="DIR", default=str(bundled_sample_dir()),
                    help="directory with train-/t10k-*-idx?-ubyte[.gz] files, or one "
                         "*images*idx3* + *labels*idx1* pair (default: the bundled 5k sample)")
    pp.add_argument("--out", metavar="DIR", default=str(default_data_dir()),
                    help="output directory (default: data/mnist in the repository)")
    pp.add_argument("--shards", type=int, default=8,
                    help="number of training shards; at least the number of workers reads "
                         "whole shards (default: %(default)s)")
    pp.add_argument("--test-fraction", type=float, default=0.1,
                    help="test share when splitting a single images/labels pair, stratified by "
                         "class; ignored for train/t10k sources (default: %(default)s)")
    pp.add_argument("--seed", type=int, default=0,
                    help="seed of the split and the shuffles (default: %(default)s)")
    pp.add_argument("--force", action="store_true",
                    help="replace --out if it already holds files")

    pf = sub.add_parser("fetch", help="download MNIST or Fashion-MNIST and verify MD5 checksums",
                        description="Download the four standard .gz files into --out; files "
                                    "already there with the right checksum are kept.")
    pf.add_argument("--dataset", choices=sorted(MD5), default="mnist",
                    help="which dataset (default: %(default)s)")
    pf.add_argument("--out", metavar="DIR", required=True,
                    help="directory for the .gz files (then: prepare --source DIR)")
    pf.add_argument("--mirror", metavar="URL", default=None,
                    help="base URL holding the four files (default: the dataset's public mirror)")
    pf.add_argument("--timeout", type=float, default=60.0,
                    help="seconds to wait for the network before giving up (default: %(default)s)")
    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            prepare(args.source, args.out, shards=args.shards, test_fraction=args.test_fraction,
                    seed=args.seed, force=args.force)
        elif args.command == "fetch":
            fetch(args.dataset, args.out, mirror=args.mirror, timeout=args.timeout)
        else:
            parser.print_help(sys.stderr)
            return 2
    except HpctrainError as e:
        print(f"hpctrain: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
