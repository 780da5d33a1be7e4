"""Atomic HDF5 checkpoints, their format and their writing: what a pre-empted
job needs to continue exactly where it stopped.

Two formats share a --checkpoint-dir: folders of named tensors written by
their owners, `DIR/ckpt-00000123/` (checkpoints/named.py), and this
module's flat files. Listing both (`list_checkpoints`) and keeping the
newest K of both (the prune after each write) are this module's.

One file per checkpoint, `DIR/ckpt-00000123.h5` (the global step, 8 digits),
written by the chief only. It holds everything a bit-exact resume needs:

    user block (512 B)     "hpctrain-checkpoint 2 sha256 <hex>\n": a hash of
                           every byte after it, checked before HDF5 parses the file
    params                 P (n,)          all parameters, the model's flat buffer
    optimizer/<name>       P (n,)          each optimizer state array (Adam: m, v)
    model_state            P (m,)          the model's non-trainable state (batch-norm running
                                           statistics; the chief's), only when m > 0
    data_positions         int64 (W, 2)    each worker's reader position: epoch, samples of its permutation taken
    compression/<name>     P               --compression powersgd's state, only when it has some
                                           (checkpoints/powersgd_state.py: each worker's error feedback,
                                           W x n; the Qs); older files have none and load as before
    attrs                  format, format_version, step, optimizer_t, optimizer_state,
                           the settings that must match on resume (run/identity.same_on_resume),
                           run information (world_size, num_ps, steps, lr, ...),
                           sha256: over every dataset and every other attribute

P is the run's parameter dtype (hpctrain/base/precision.py, the plan's
`precision.params`: little-endian float32 today); the reader takes the
file's and resume refuses one that is not the run's.

No random-number state is stored because there is none to store: each reader's
shuffle is a pure function of (seed, epoch), and a dropout mask of (seed,
epoch, sample id).

Writing: a hidden temporary name in the same directory, flushed and fsync'd,
renamed into place, then the directory fsync'd; so a crash leaves either the
complete new file or none, never a half-written `ckpt-*.h5`. The newest K
files up to the one just written are kept (by the step in their names; a
name above it is never pruned: it may lie), older ones removed. Temporary
files that killed writers left are swept at the next start
(outputs.sweep_stale_temporaries); one job per checkpoint directory.

Reading a file back, checking it and choosing the newest valid one is
checkpoints/read_back.py's.

No MPI here: the loops gather and broadcast (checkpoints/resume.py), this
module writes (and lists a directory's files); hpctrain/checkpoint.py is the
command that lists and checks them.

    python -m hpctrain.checkpoint DIR      # lists DIR's checkpoints and checks each
"""
import errno
import hashlib
import os
import re
import shutil
from dataclasses import dataclass

import numpy as np

from .trust import Corrupt
from ..base.errors import HpctrainError
from ..base.files import create_new, remove_temp, temp_name_next_to
from ..base.precision import FLOAT32, file_dtype

FORMAT = "hpctrain-checkpoint"
# 2: data_positions are (epoch, position in the epoch's permutation of the
# whole training set), which any number of workers can go on from; version 1
# held offsets into each worker's own part.
FORMAT_VERSION = 2
# The file starts with an HDF5 user block (bytes HDF5 itself skips) holding a
# one-line header: "hpctrain-checkpoint 2 sha256 <hex>\n", zero-padded, the hash
# over "hpctrain-checkpoint 2\n" and every byte after the user block. It is
# checked before HDF5 parses the file: the HDF5 library can crash (not raise)
# on damaged metadata.
USERBLOCK = 512
# A file is hashed this many bytes at a time (a lazy read holds no more of it).
BLOCK_BYTES = 1 << 22
_NAME_RE = re.compile(r"^ckpt-(\d{8,})\.h5$")
# A checkpoint of named tensors (checkpoints/named.py) is a folder: ckpt-00000123/
_FOLDER_RE = re.compile(r"^ckpt-(\d{8,})$")
# Either: the names no other output may take in a --checkpoint-dir (run/outputs.py)
ANY_NAME_RE = re.compile(r"^ckpt-(\d{8,})(?:\.h5)?$")


def checkpoint_name(step):
    return f"ckpt-{int(step):08d}.h5"


@dataclass
class Pieces:
    """A flat dataset of the run's parameter dtype handed to save() in pieces, in order: a
    pipeline's chief writes each stage's slice as it arrives, holding one at
    a time. pieces: an iterable of 1-D arrays whose sizes add up to size."""
    size: int
    pieces: object


# ---------------------------------------------------------------------------
# writing

def save(directory, step, params, optimizer_state, optimizer_t, data_positions, settings, keep=3,
         info=None, model_state=None, compression_state=None, dtype=FLOAT32.params):
    """Write DIR/ckpt-<step>.h5 atomically; keep the newest `keep`; return its path.

    params and each optimizer state array: 1-D host arrays, written as `dtype`
    (the run's precision.params, run/plan.py); data_positions:
    (workers, 2) int64 (epoch, offset); model_state: 1-D, `dtype`, or None (none);
    settings: the values that must match on resume (run/identity.same_on_resume); info:
    more attributes recorded for people (world size, lr, ...), checked by no one;
    compression_state: {name: 1-D, `dtype`} or None (checkpoints/powersgd_state.py).
    """
    import h5py
    params = params if isinstance(params, Pieces) else _flat(params, "params", dtype)
    state = {name: a if isinstance(a, Pieces) else _flat(a, f"optimizer state {name}", dtype)
             for name, a in optimizer_state.items()}
    positions = np.ascontiguousarray(data_positions, dtype="<i8")
    if positions.ndim != 2 or positions.shape[1] != 2:
        raise ValueError(f"data_positions must be (workers, 2), got {positions.shape}")
    if isinstance(model_state, Pieces):
        model_state = model_state if model_state.size else None
    else:
        model_state = _flat(model_state, "model state", dtype) if model_state is not None and len(model_state) else None
    compressed = {name: _flat(a, f"compression state {name}", dtype) for name, a in (compression_state or {}).items()}
    attrs = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": int(step),
             "optimizer_t": int(optimizer_t), "optimizer_state": ",".join(state),
             "model_state": 0 if model_state is None else int(model_state.size)}
    if compressed:   # absent otherwise: the attributes of a run without it stay as they were
        attrs["compression_state"] = ",".join(compressed)
    for key, value in {**(info or {}), **settings}.items():
        if key not in attrs:
            attrs[key] = _attr_value(key, value)
    datasets = {"params": params, "data_positions": positions,
                **{f"optimizer/{name}": a for name, a in state.items()},
                **{f"compression/{name}": a for name, a in compressed.items()}}
    if model_state is not None:
        datasets["model_state"] = model_state

    directory = os.fspath(directory)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise HpctrainError(f"--checkpoint-dir {directory}: cannot create ({e.strerror})") from None
    name = checkpoint_name(step)
    path = os.path.join(directory, name)
    # Exclusive, unpredictable, with this pid (files.temp_name_next_to):
    # removed below on every way out, or at the next start if killed.
    tmp = temp_name_next_to(path)
    try:
        os.close(create_new(tmp))
        # No HDF5 file lock: it fails on some parallel filesystems, and the
        # temporary name is this process's alone.
        with h5py.File(tmp, "w", userblock_size=USERBLOCK, locking=False) as f:
            content = hashlib.sha256()   # _checksum's, as the datasets are written
            for key in sorted(datasets):
                _write_dataset(f, key, datasets[key], content, dtype)
            attrs["sha256"] = _checksum({}, attrs, content)
            for key, value in attrs.items():
                f.attrs[key] = value
        # h5py has flushed and closed the file: hash it, write the header and
        # make every byte durable before the rename shows it under the real name.
        stamp(tmp, durable=True)
        os.replace(tmp, path)
        _fsync_dir(directory)
    except OSError as e:
        raise HpctrainError(f"{path}: cannot write checkpoint ({e.strerror or e})") from None
    finally:
        remove_temp(tmp)
    _prune(directory, keep, mine=path)
    return path


def _write_dataset(f, key, value, content, dtype):
    """One dataset into the open file, its name, type, shape and bytes into
    the content hash (_checksum's order: datasets by name, each in order)."""
    if not isinstance(value, Pieces):
        a = np.ascontiguousarray(value)
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        f.create_dataset(key, data=a)
        content.update(f"dataset {key} {a.dtype.str} {a.shape}\n".encode())
        content.update(memoryview(a).cast("B"))
        return
    on_disk = file_dtype(dtype)
    dataset = f.create_dataset(key, shape=(value.size,), dtype=on_disk)
    content.update(f"dataset {key} {on_disk.str} {(value.size,)}\n".encode())
    at = 0
    for piece in value.pieces:
        piece = _flat(piece, key, dtype)
        if at + piece.size > value.size:
            raise ValueError(f"{key}: the pieces hold more than its {value.size} values")
        dataset[at:at + piece.size] = piece
        content.update(memoryview(piece).cast("B"))
        at += piece.size
    if at != value.size:
        raise ValueError(f"{key}: the pieces hold {at} of its {value.size} values")


def _hasher(version, kind=FORMAT):
    return hashlib.sha256(f"{kind} {version}\n".encode())


def _header(version, digest, kind=FORMAT):
    return f"{kind} {version} sha256 {digest}\n".encode().ljust(USERBLOCK, b"\0")


def stamp(path, durable=False, kind=FORMAT, version=FORMAT_VERSION):
    """Write the header of a checkpoint file whose HDF5 part is complete
    (kind, version: a checkpoint folder's index is stamped too, checkpoints/named.py)."""
    with open(path, "r+b") as f:
        f.seek(USERBLOCK)
        h = _hasher(version, kind)
        for block in iter(lambda: f.read(BLOCK_BYTES), b""):
            h.update(block)
        f.seek(0)
        f.write(_header(version, h.hexdigest(), kind))
        f.flush()
        if durable:
            os.fsync(f.fileno())


def check_stamp(path, kind=FORMAT, version=FORMAT_VERSION, what="checkpoint format"):
    """A stamped file's bytes against its header, read a block at a time,
    before HDF5 parses them: its size, or trust.Corrupt; HpctrainError for
    another version of `kind` (`what` in the line)."""
    try:
        with open(path, "rb") as f:
            head = f.read(USERBLOCK)
            if len(head) < USERBLOCK:
                raise Corrupt(f"truncated ({len(head)} bytes)")
            fields = head.split(b"\n", 1)[0].split(b" ")
            if len(fields) != 4 or fields[0] != kind.encode() or fields[2] != b"sha256":
                raise Corrupt("no hpctrain checkpoint header")
            have = fields[1].decode(errors="replace")
            h = _hasher(have, kind)
            size = USERBLOCK
            for block in iter(lambda: f.read(BLOCK_BYTES), b""):
                h.update(block)
                size += len(block)
    except OSError as e:
        raise Corrupt(f"cannot read: {e.strerror}") from None
    if head != _header(have, h.hexdigest(), kind):
        raise Corrupt("checksum mismatch")
    if have != str(version):
        raise HpctrainError(f"{path}: {what} version {have}, this hpctrain reads "
                            f"version {version}; start fresh with another --checkpoint-dir")
    return size


def _flat(array, what, dtype):
    a = np.ascontiguousarray(array, dtype=file_dtype(dtype))
    if a.ndim != 1:
        raise ValueError(f"{what} must be a flat 1-D array, got shape {a.shape}")
    return a


def _attr_value(key, value):
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    raise TypeError(f"checkpoint attribute {key}: int, float or str expected, got {type(value).__name__}")


def _fsync_dir(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        # Some filesystems cannot fsync a directory; the rename is then as
        # durable as that filesystem makes it.
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def list_checkpoints(directory):
    """[(step, path)] of DIR's checkpoints, newest first: flat files
    (`ckpt-*.h5`, this module's) and folders of named tensors (`ckpt-*/`,
    checkpoints/named.py)."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    except OSError as e:
        raise HpctrainError(f"--checkpoint-dir {directory}: cannot list ({e.strerror})") from None
    found = []
    for entry in entries:
        m = _NAME_RE.match(entry.name) or (_FOLDER_RE.match(entry.name) if _is_folder(entry) else None)
        if m:
            found.append((int(m.group(1)), os.path.join(directory, entry.name)))
    return sorted(found, reverse=True)


def _is_folder(entry):
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _prune(directory, keep, mine):
    """Keep the newest `keep` checkpoints up to `mine` (the one just written),
    by the step in their names; remove the older ones, files and folders. A
    checkpoint named above `mine` is never removed here: it is either newer
    than this run's step or one whose name lies about its step (a renamed
    copy, which resume reports and skips); counted among the `keep`, a lying
    name would prune the real newest checkpoints, the one just written included."""
    base = os.path.basename(mine)
    mine_step = int((_NAME_RE.match(base) or _FOLDER_RE.match(base)).group(1))
    older = [path for step, path in list_checkpoints(directory) if step <= mine_step and path != mine]
    for path in older[max(keep - 1, 0):]:
        if os.path.isdir(path) and not os.path.islink(path):
            _remove_folder(path)
        else:
            _unlink_quietly(path)


def _remove_folder(path):
    """A checkpoint folder removed: renamed aside first (a hidden name the
    next start sweeps), so a crash half-way never leaves a partial `ckpt-*/`."""
    aside = temp_name_next_to(path)
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def _unlink_quietly(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------------------
# checksum

def _checksum(datasets, attrs, h=None):
    """sha256 over every dataset (name, dtype, shape, bytes) and every attribute
    but the checksum itself, in name order: any changed bit is caught. h: a
    hash the datasets are already in (written, or read, a piece at a time)."""
    h = hashlib.sha256() if h is None else h
    for key in sorted(datasets):
        a = np.ascontiguousarray(datasets[key])
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        h.update(f"dataset {key} {a.dtype.str} {a.shape}\n".encode())
        h.update(memoryview(a).cast("B"))
    for key in sorted(attrs):
        if key != "sha256":
            value = attrs[key]
            h.update(f"attr {key} {type(value).__name__} {value!r}\n".encode())
    return h.hexdigest()
