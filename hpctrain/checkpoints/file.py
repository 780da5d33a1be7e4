"""Atomic HDF5 checkpoints and resume: what a pre-empted job needs to continue
exactly where it stopped.

One file per checkpoint, `DIR/ckpt-00000123.h5` (the global step, 8 digits),
written by the chief only. It holds everything a bit-exact resume needs:

    user block (512 B)     "hpctrain-checkpoint 2 sha256 <hex>\n": a hash of
                           every byte after it, checked before HDF5 parses the file
    params                 float32 (n,)    all parameters, the model's flat buffer
    optimizer/<name>       float32 (n,)    each optimizer state array (Adam: m, v)
    model_state            float32 (m,)    the model's non-trainable state (batch-norm running
                                           statistics; the chief's), only when m > 0
    data_positions         int64 (W, 2)    each worker's reader position: epoch, samples of its permutation taken
    compression/<name>     float32         --compression powersgd's state, only when it has some
                                           (checkpoints/compression.py: each worker's error feedback,
                                           W x n; the Qs); older files have none and load as before
    attrs                  format, format_version, step, optimizer_t, optimizer_state,
                           the settings that must match on resume (settings.SAME_ON_RESUME),
                           run information (world_size, num_ps, steps, lr, ...),
                           sha256: over every dataset and every other attribute

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

Reading: newest first; a file that is unreadable, truncated, incomplete,
fails a checksum or holds another step than its name says (a renamed copy)
is reported through `warn` and skipped for the previous one. A valid
checkpoint of a different job (another model, mode, optimizer, worker count,
batch size or seed) is an error naming the setting, never silently skipped.
A file with a valid header that save() could not have written is refused
with one line (never read, never skipped): a dataset that is not a hard
link, not stored contiguously inside the file (chunked, compressed, virtual,
external storage, which would read any file named), or larger than the
file; an attribute that is not a plain int, float or str; a step, optimizer
step, data position or sample count out of range. So a crafted file can
neither make the reader allocate more than its own size nor read elsewhere
(those rules: checkpoints/trust.py). Only h5py reads; nothing is unpickled.

No MPI here: the loops gather and broadcast (checkpoints/resume.py), this
module reads and writes; hpctrain/checkpoint.py is the command that lists
and checks a directory's files.

    python -m hpctrain.checkpoint DIR      # lists DIR's checkpoints and checks each
"""
import errno
import hashlib
import io
import os
import re
import sys
from dataclasses import dataclass, field

import numpy as np

from .trust import Corrupt as _Corrupt
from .trust import Refused as _Refused
from .trust import check_attr_types, check_ranges, stored_dataset
from ..errors import HpctrainError
from ..run.outputs import temp_next_to
from ..run.identity import RESUME_DEFAULTS

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
_NAME_RE = re.compile(r"^ckpt-(\d{8,})\.h5$")


def _describe(key, value):
    """A setting as the user knows it: "--hidden 64", "1000 parameters"."""
    if key == "num_params":
        return f"{value} parameters"
    if key == "accumulate_steps":   # --accumulate-steps K or a pipeline's --micro-batches M: batches a step
        return f"{value} batch{'es' if str(value) != '1' else ''} per step and worker (--accumulate-steps, or a " \
               f"pipeline's --micro-batches)"
    return f"--{key.replace('_', '-')} {value}"


def checkpoint_name(step):
    return f"ckpt-{int(step):08d}.h5"


@dataclass
class Checkpoint:
    """One checkpoint read back and verified; arrays are NumPy, on the host
    (read lazily: params and the optimizer state are `OnDisk`, read a slice
    at a time; close() when done)."""
    path: str
    step: int
    optimizer_t: int
    params: object
    optimizer_state: dict
    data_positions: np.ndarray
    attrs: dict = field(default_factory=dict)
    model_state: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    source: object = None   # the open file of a lazy read
    compression_state: dict = field(default_factory=dict)   # name -> flat float32 (compression/<name>)

    @property
    def name(self):
        return os.path.basename(self.path)

    def close(self):
        if self.source is not None:
            self.source.close()
            self.source = None


class OnDisk:
    """A flat float32 dataset of a verified checkpoint, left in the file:
    `read(lo, hi)` its slice (a pipeline's resume hands each stage its part,
    and no rank holds the whole)."""

    def __init__(self, dataset):
        self._dataset = dataset
        self.size, self.shape, self.dtype = int(dataset.size), tuple(dataset.shape), np.dtype(np.float32)

    def read(self, lo, hi):
        return np.asarray(self._dataset[lo:hi], dtype=np.float32)


@dataclass
class Pieces:
    """A flat float32 dataset handed to save() in pieces, in order: a
    pipeline's chief writes each stage's slice as it arrives, holding one at
    a time. pieces: an iterable of 1-D arrays whose sizes add up to size."""
    size: int
    pieces: object


# ---------------------------------------------------------------------------
# writing

def save(directory, step, params, optimizer_state, optimizer_t, data_positions, settings, keep=3,
         info=None, model_state=None, compression_state=None):
    """Write DIR/ckpt-<step>.h5 atomically; keep the newest `keep`; return its path.

    params and each optimizer state array: 1-D float32 (host arrays); data_positions:
    (workers, 2) int64 (epoch, offset); model_state: 1-D float32 or None (none);
    settings: the values that must match on resume (settings.same_on_resume); info:
    more attributes recorded for people (world size, lr, ...), checked by no one;
    compression_state: {name: 1-D float32} or None (checkpoints/compression.py).
    """
    import h5py
    params = params if isinstance(params, Pieces) else _flat32(params, "params")
    state = {name: a if isinstance(a, Pieces) else _flat32(a, f"optimizer state {name}")
             for name, a in optimizer_state.items()}
    positions = np.ascontiguousarray(data_positions, dtype="<i8")
    if positions.ndim != 2 or positions.shape[1] != 2:
        raise ValueError(f"data_positions must be (workers, 2), got {positions.shape}")
    if isinstance(model_state, Pieces):
        model_state = model_state if model_state.size else None
    else:
        model_state = _flat32(model_state, "model state") if model_state is not None and len(model_state) else None
    compressed = {name: _flat32(a, f"compression state {name}") for name, a in (compression_state or {}).items()}
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
    tmp = None
    try:
        # Exclusive, unpredictable, with this pid (outputs.temp_next_to):
        # removed below on every way out, or at the next start if killed.
        fd, tmp = temp_next_to(path)
        os.close(fd)
        # No HDF5 file lock: it fails on some parallel filesystems, and the
        # temporary name is this process's alone.
        with h5py.File(tmp, "w", userblock_size=USERBLOCK, locking=False) as f:
            content = hashlib.sha256()   # _checksum's, as the datasets are written
            for key in sorted(datasets):
                _write_dataset(f, key, datasets[key], content)
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
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)
    _prune(directory, keep, mine=path)
    return path


def _write_dataset(f, key, value, content):
    """One dataset into the open file, its name, type, shape and bytes into
    the content hash (_checksum's order: datasets by name, each in order)."""
    if not isinstance(value, Pieces):
        a = np.ascontiguousarray(value)
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        f.create_dataset(key, data=a)
        content.update(f"dataset {key} {a.dtype.str} {a.shape}\n".encode())
        content.update(memoryview(a).cast("B"))
        return
    dataset = f.create_dataset(key, shape=(value.size,), dtype="<f4")
    content.update(f"dataset {key} <f4 {(value.size,)}\n".encode())
    at = 0
    for piece in value.pieces:
        piece = _flat32(piece, key)
        if at + piece.size > value.size:
            raise ValueError(f"{key}: the pieces hold more than its {value.size} values")
        dataset[at:at + piece.size] = piece
        content.update(memoryview(piece).cast("B"))
        at += piece.size
    if at != value.size:
        raise ValueError(f"{key}: the pieces hold {at} of its {value.size} values")


def _hasher(version):
    return hashlib.sha256(f"{FORMAT} {version}\n".encode())


def _header(version, digest):
    return f"{FORMAT} {version} sha256 {digest}\n".encode().ljust(USERBLOCK, b"\0")


def stamp(path, durable=False):
    """Write the header of a checkpoint file whose HDF5 part is complete."""
    with open(path, "r+b") as f:
        f.seek(USERBLOCK)
        h = _hasher(FORMAT_VERSION)
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        f.seek(0)
        f.write(_header(FORMAT_VERSION, h.hexdigest()))
        f.flush()
        if durable:
            os.fsync(f.fileno())


def _flat32(array, what):
    a = np.ascontiguousarray(array, dtype="<f4")
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
    """[(step, path)] of DIR's checkpoint files, newest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise HpctrainError(f"--checkpoint-dir {directory}: cannot list ({e.strerror})") from None
    found = [(int(m.group(1)), os.path.join(directory, n)) for n in names if (m := _NAME_RE.match(n))]
    return sorted(found, reverse=True)


def _prune(directory, keep, mine):
    """Keep the newest `keep` checkpoints up to `mine` (the one just written),
    by the step in their names; remove the older ones. A file named above
    `mine` is never removed here: it is either newer than this run's step or a
    file whose name lies about its step (a renamed copy, which resume reports
    and skips); counted among the `keep`, a lying name would prune the real
    newest checkpoints, the one just written included."""
    mine_step = int(_NAME_RE.match(os.path.basename(mine)).group(1))
    older = [path for step, path in list_checkpoints(directory) if step <= mine_step and path != mine]
    for path in older[max(keep - 1, 0):]:
        _unlink_quietly(path)


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


def _plain(value):
    """An attribute as read by h5py -> the Python value it was written as."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) and value.shape == ():
        return value.item()
    return value


# ---------------------------------------------------------------------------
# reading

def _check_header(path, raw):
    """The file's bytes against its header: _Corrupt unless they match."""
    if len(raw) < USERBLOCK:
        raise _Corrupt(f"truncated ({len(raw)} bytes)")
    fields = raw[:USERBLOCK].split(b"\n", 1)[0].split(b" ")
    if len(fields) != 4 or fields[0] != FORMAT.encode() or fields[2] != b"sha256":
        raise _Corrupt("no hpctrain checkpoint header")
    version = fields[1].decode(errors="replace")
    h = _hasher(version)
    h.update(memoryview(raw)[USERBLOCK:])
    if raw[:USERBLOCK] != _header(version, h.hexdigest()):
        raise _Corrupt("checksum mismatch")
    if version != str(FORMAT_VERSION):
        raise HpctrainError(f"{path}: checkpoint format version {version}, this hpctrain reads "
                            f"version {FORMAT_VERSION}; start fresh with another --checkpoint-dir")


# A lazy read hashes the file and its datasets this many bytes at a time.
BLOCK_BYTES = 1 << 22


def _check_header_streamed(path):
    """_check_header, reading the file a block at a time (a lazy read holds
    no more than a block of it): its size, or _Corrupt."""
    try:
        with open(path, "rb") as f:
            head = f.read(USERBLOCK)
            if len(head) < USERBLOCK:
                raise _Corrupt(f"truncated ({len(head)} bytes)")
            fields = head.split(b"\n", 1)[0].split(b" ")
            if len(fields) != 4 or fields[0] != FORMAT.encode() or fields[2] != b"sha256":
                raise _Corrupt("no hpctrain checkpoint header")
            version = fields[1].decode(errors="replace")
            h = _hasher(version)
            size = USERBLOCK
            for block in iter(lambda: f.read(BLOCK_BYTES), b""):
                h.update(block)
                size += len(block)
    except OSError as e:
        raise _Corrupt(f"cannot read: {e.strerror}") from None
    if head != _header(version, h.hexdigest()):
        raise _Corrupt("checksum mismatch")
    if version != str(FORMAT_VERSION):
        raise HpctrainError(f"{path}: checkpoint format version {version}, this hpctrain reads "
                            f"version {FORMAT_VERSION}; start fresh with another --checkpoint-dir")
    return size


def read(path, lazy=False):
    """One checkpoint, verified (Checkpoint), or _Corrupt with the reason.
    lazy: the file is hashed a block at a time, its datasets too, and params
    and the optimizer state stay in it (OnDisk, read by slices until close()):
    no more than a block of it in memory."""
    import h5py
    source = None
    try:
        if lazy:
            size = _check_header_streamed(path)
            opened = path
        else:
            try:
                with open(path, "rb") as f:
                    raw = f.read()
            except OSError as e:
                raise _Corrupt(f"cannot read: {e.strerror}") from None
            _check_header(path, raw)
            size = len(raw)
            opened = io.BytesIO(raw)   # from memory: the bytes just verified are the bytes parsed
        try:
            f = source = h5py.File(opened, "r", locking=False) if lazy else h5py.File(opened, "r")
            attrs = {k: _plain(v) for k, v in f.attrs.items()}
            if attrs.get("format") != FORMAT:
                raise _Corrupt("not an hpctrain checkpoint")
            if "sha256" not in attrs:
                raise _Corrupt("no content checksum")
            check_attr_types(attrs)
            names = [n for n in str(attrs.get("optimizer_state", "")).split(",") if n]
            keys = ["params", "data_positions"] + [f"optimizer/{n}" for n in names]
            if attrs.get("model_state", 0):   # written before batch norm: absent, none
                keys.append("model_state")
            compressed = [n for n in str(attrs.get("compression_state", "")).split(",") if n]
            keys += [f"compression/{n}" for n in compressed]   # written before --compression: none
            found = {key: stored_dataset(f, key, size) for key in keys}
            if sum(obj.nbytes for obj in found.values()) > size:
                raise _Refused(f"its datasets hold more bytes than the file ({size})")
            big = {"params", *(f"optimizer/{n}" for n in names)} if lazy else set()
            datasets = {key: obj[()] for key, obj in found.items() if key not in big}
            content = hashlib.sha256()
            for key in sorted(found):
                if key in big:
                    _hash_on_disk(found[key], key, content)
                else:
                    _checksum({key: datasets[key]}, {}, content)
        except (OSError, KeyError, ValueError, RuntimeError, TypeError, OverflowError) as e:
            # Whatever damaged bytes make HDF5 raise, the file cannot be trusted.
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise _Corrupt(f"unreadable HDF5: {first}") from None
        try:
            matches = _checksum({}, attrs, content) == attrs["sha256"]
        except (TypeError, ValueError, KeyError) as e:   # damaged attribute names or values
            raise _Corrupt(f"unreadable attributes ({type(e).__name__})") from None
        if not matches:
            raise _Corrupt("content checksum mismatch")
        if lazy:
            params = OnDisk(found["params"])
            state = {n: OnDisk(found[f"optimizer/{n}"]) for n in names}
        else:
            params, state = datasets["params"], {n: datasets[f"optimizer/{n}"] for n in names}
        positions = datasets["data_positions"]
        if len(params.shape) != 1 or params.dtype != np.float32:
            raise _Corrupt(f"params is {params.dtype} {params.shape}, expected flat float32")
        if positions.ndim != 2 or positions.shape[1] != 2:
            raise _Corrupt(f"data_positions has shape {positions.shape}, expected (workers, 2)")
        for n, a in state.items():
            if a.shape != params.shape or a.dtype != np.float32:
                raise _Corrupt(f"optimizer state {n} is {a.dtype} {a.shape}, params are {params.shape}")
        for key in ("step", "optimizer_t"):
            if not isinstance(attrs.get(key), int):
                raise _Corrupt(f"attribute {key} missing or not an integer")
        model_state = datasets.get("model_state", np.zeros(0, np.float32))
        if model_state.ndim != 1 or model_state.dtype != np.float32 or \
                model_state.size != attrs.get("model_state", 0):
            raise _Corrupt(f"model_state is {model_state.dtype} {model_state.shape}, "
                           f"the attributes say {attrs.get('model_state')!r} floats")
        check_ranges(attrs, positions)
        ckpt = Checkpoint(path=os.fspath(path), step=attrs["step"], optimizer_t=attrs["optimizer_t"],
                          params=params, optimizer_state=state,
                          data_positions=positions.astype(np.int64, copy=False), attrs=attrs,
                          model_state=model_state, source=source if lazy else None,
                          compression_state={n: datasets[f"compression/{n}"] for n in compressed})
    except BaseException:
        if source is not None:
            source.close()
        raise
    if not lazy and source is not None:
        source.close()
    return ckpt


def _hash_on_disk(dataset, key, content):
    """_checksum of one flat float32 dataset read from the file a block at a time."""
    content.update(f"dataset {key} <f4 {(int(dataset.size),)}\n".encode())
    step = BLOCK_BYTES // 4
    for lo in range(0, int(dataset.size), step):
        block = np.ascontiguousarray(dataset[lo:lo + step], dtype="<f4")
        content.update(memoryview(block).cast("B"))


def check_compatible(ckpt, expected_settings):
    """HpctrainError naming the first setting that differs between the checkpoint and this run."""
    version = ckpt.attrs.get("format_version")
    if version != FORMAT_VERSION:
        raise HpctrainError(f"{ckpt.path}: checkpoint format version {version}, this hpctrain reads "
                            f"version {FORMAT_VERSION}; use --resume no with a new --checkpoint-dir")
    for key, want in expected_settings.items():
        have = ckpt.attrs.get(key, RESUME_DEFAULTS.get(key))
        if have is None:
            raise HpctrainError(f"{ckpt.path}: checkpoint does not record {key}; cannot resume "
                                f"from it (use a new --checkpoint-dir or --resume no)")
        if str(have) != str(want):
            raise HpctrainError(f"{ckpt.path}: checkpoint was written with {_describe(key, have)}, this "
                                f"run has {_describe(key, want)}; resume with the same setting, or start "
                                f"fresh with another --checkpoint-dir")


def check_data(ckpt, digest, data_dir, other_ok=False):
    """The checkpoint against this run's data (its manifest's digest): None
    when it was trained on the same data; a line to print when it records no
    data (an hpctrain before `data_digest`: not checked) or, with other_ok
    (--resume-other-data), other data; otherwise HpctrainError naming both."""
    have = ckpt.attrs.get("data_digest")
    if not have:
        return (f"{ckpt.name} does not record the data it was trained on (written by an earlier hpctrain): "
                f"resuming on --data {data_dir} unchecked")
    if have == digest:
        return None
    was = f"{ckpt.attrs.get('data') or '?'} (manifest digest {have})"
    now = f"--data {data_dir} (manifest digest {digest})"
    if other_ok:
        return (f"--resume-other-data: {ckpt.name} was trained on {was}; this run goes on from it on {now}, "
                f"from that data's first epoch")
    raise HpctrainError(f"{ckpt.path}: checkpoint was trained on other data, {was}; this run has {now}; resume "
                        f"on the same data, pass --resume-other-data to go on from it on this data "
                        f"(fine-tuning), or start fresh with another --checkpoint-dir")


def load_latest(directory, expected_settings, warn=None, lazy=False):
    """The newest valid checkpoint in DIR (Checkpoint), or None if it holds none.

    The newest is the one with the highest step stored inside it: a file whose
    name says another step than its content (a renamed copy) is reported
    through warn(line) and skipped, as corrupt files are, so a copy named
    `ckpt-99999999.h5` cannot pin every later run to an old step. A valid file
    that does not match expected_settings raises HpctrainError. lazy: read()'s.
    """
    warn = warn or (lambda line: print(f"hpctrain: warning: {line}", file=sys.stderr, flush=True))
    for named, path in list_checkpoints(directory):
        try:
            ckpt = read(path, lazy=lazy)
        except _Refused as e:
            raise HpctrainError(f"{path}: refused: {e}; hpctrain writes no such checkpoint (a crafted file?): "
                                f"move it away to resume from an earlier one") from None
        except _Corrupt as e:
            warn(f"{os.path.basename(path)}: corrupt ({e}), trying the previous one")
            continue
        if ckpt.step != named:
            ckpt.close()
            warn(_misnamed(path, named, ckpt.step))
            continue
        try:
            check_compatible(ckpt, expected_settings)
        except HpctrainError:
            ckpt.close()
            raise
        return ckpt
    return None


def _misnamed(path, named, step):
    return (f"{os.path.basename(path)}: its name says step {named} but it holds step {step} (a renamed "
            f"copy?), skipped; trying the previous one")
