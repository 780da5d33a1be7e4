"""A --checkpoint-dir and its checkpoints' common ground: listing them
(`list_checkpoints`: folders of named tensors, `DIR/ckpt-00000123/`, which
checkpoints/named.py writes, and the old flat files, `DIR/ckpt-00000123.h5`,
which hpctrain no longer writes but still resumes from), keeping the newest
K of both (`_prune`, after each write), and the 512-byte header stamp that
a folder's index and a flat file both begin with (`stamp`, `check_stamp`).

The old flat file (read back by checkpoints/read_back.py; an hpctrain
before issue 55 wrote it, the chief alone):

    user block (512 B)     "hpctrain-checkpoint 2 sha256 <hex>\n": a hash of
                           every byte after it, checked before HDF5 parses the file
    params                 P (n,)          all parameters, the model's flat buffer
    optimizer/<name>       P (n,)          each optimizer state array (Adam: m, v)
    model_state            P (m,)          the model's non-trainable state (batch-norm running
                                           statistics), only when m > 0
    data_positions         int64 (W, 2)    each worker's reader position: epoch, samples of its permutation taken
    compression/<name>     P               --compression powersgd's state, only when it has some
                                           (checkpoints/powersgd_state.py)
    attrs                  format, format_version, step, optimizer_t, optimizer_state,
                           the settings that must match on resume (run/identity.same_on_resume),
                           run information (world_size, num_ps, steps, lr, ...),
                           sha256 (`_checksum`): over every dataset and every other attribute

P is the parameter dtype of the run that wrote it (little-endian float32);
resume refuses one that is not the run's.

No MPI here: the loops gather and broadcast (checkpoints/resume.py);
hpctrain/checkpoint.py is the command that lists and checks them.

    python -m hpctrain.checkpoint DIR      # lists DIR's checkpoints and checks each
"""
import errno
import hashlib
import os
import re
import shutil

import numpy as np

from .trust import Corrupt
from ..base.errors import HpctrainError
from ..base.files import temp_name_next_to

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
    """A checkpoint folder's name (checkpoints/named.py)."""
    return f"ckpt-{int(step):08d}"


# ---------------------------------------------------------------------------
# the header stamp: an old flat file's and a checkpoint folder's index

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
