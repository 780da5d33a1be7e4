"""Reading an old flat checkpoint file back (its format: checkpoints/file.py;
hpctrain now writes folders, checkpoints/named.py): verified before it is
trusted; and the newest valid checkpoint of a --checkpoint-dir, flat files
and folders of named tensors (named.py reads and verifies those) alike.

Newest first; a file that is unreadable, truncated, incomplete,
fails a checksum or holds another step than its name says (a renamed copy)
is reported through `warn` and skipped for the previous one. A valid
checkpoint of a different job (another model, mode, optimizer, worker count,
batch size or seed) is an error naming the setting, never silently skipped.
A file with a valid header that hpctrain's flat writer could not have
written is refused with one line (never read, never skipped): a dataset that is not a hard
link, not stored contiguously inside the file (chunked, compressed, virtual,
external storage, which would read any file named), or larger than the
file; an attribute that is not a plain int, float or str; a step, optimizer
step, data position or sample count out of range. So a crafted file can
neither make the reader allocate more than its own size nor read elsewhere
(those rules: checkpoints/trust.py). Only h5py reads; nothing is unpickled.

No MPI here: the loops broadcast what the chief reads (checkpoints/resume.py).

    .venv/bin/python -m pytest -q tests/test_checkpoint.py tests/test_checkpoint_properties.py
"""
import hashlib
import io
import os
import sys
from dataclasses import dataclass, field

import numpy as np

from .named import NamedCheckpoint, is_named, open_checkpoint
from .file import BLOCK_BYTES, FORMAT, FORMAT_VERSION, USERBLOCK, _checksum, _hasher, _header, check_stamp
from .file import list_checkpoints
from .trust import Corrupt as _Corrupt
from .trust import Refused as _Refused
from .trust import check_attr_types, check_ranges, stored_dataset
from .trust import plain as _plain
from ..base.errors import HpctrainError
from ..base.precision import FLOAT32

# What a checkpoint written before a setting existed means by it (it is
# missing there): checkpoints from before --lr-schedule were all constant,
# from before the model spec (issue 20) all the MLP, and from before
# --accumulate-steps all one batch per step.
RESUME_DEFAULTS = {"lr_schedule": "constant", "model": "mlp", "accumulate_steps": 1}
# Settings that checkpoints began to record late (--momentum: issue 41,
# --adam-betas: issue 43), so a
# checkpoint without one may have been written with any value: resumed
# unchecked, as before, rather than refused or judged against a guess.
UNRECORDED_BEFORE = ("momentum", "adam_betas")


def _describe(key, value):
    """A setting as the user knows it: "--hidden 64", "1000 parameters"."""
    if key == "num_params":
        return f"{value} parameters"
    if key == "accumulate_steps":   # --accumulate-steps K or a pipeline's --micro-batches M: batches a step
        return f"{value} batch{'es' if str(value) != '1' else ''} per step and worker (--accumulate-steps, or a " \
               f"pipeline's --micro-batches)"
    return f"--{key.replace('_', '-')} {value}"


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
    model_state: np.ndarray = field(default_factory=lambda: np.zeros(0, FLOAT32.params))
    source: object = None   # the open file of a lazy read
    compression_state: dict = field(default_factory=dict)   # name -> flat, the params' dtype (compression/<name>)

    @property
    def name(self):
        return os.path.basename(self.path)

    @property
    def named(self):
        """A checkpoint of named tensors (checkpoints/named.py): its tensors in `source`'s rank files."""
        return isinstance(self.source, NamedCheckpoint)

    def close(self):
        if self.source is not None:
            self.source.close()
            self.source = None


class OnDisk:
    """A flat dataset (the params' dtype) of a verified checkpoint, left in the file:
    `read(lo, hi)` its slice (a pipeline's resume hands each stage its part,
    and no rank holds the whole)."""

    def __init__(self, dataset):
        self._dataset = dataset
        self.size, self.shape = int(dataset.size), tuple(dataset.shape)
        self.dtype = np.dtype(dataset.dtype).newbyteorder("=")

    def read(self, lo, hi):
        return np.asarray(self._dataset[lo:hi], dtype=self.dtype)


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


def read(path, lazy=False):
    """One checkpoint, verified (Checkpoint), or _Corrupt with the reason.
    lazy: the file is hashed a block at a time, its datasets too, and params
    and the optimizer state stay in it (OnDisk, read by slices until close()):
    no more than a block of it in memory."""
    import h5py
    source = None
    try:
        if lazy:
            size = check_stamp(path)
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
        if len(params.shape) != 1:   # its dtype is one of precision.FLOATS (trust.stored_dataset)
            raise _Corrupt(f"params is {params.dtype} {params.shape}, expected a flat array")
        if positions.ndim != 2 or positions.shape[1] != 2:
            raise _Corrupt(f"data_positions has shape {positions.shape}, expected (workers, 2)")
        for n, a in state.items():
            if a.shape != params.shape or a.dtype != params.dtype:
                raise _Corrupt(f"optimizer state {n} is {a.dtype} {a.shape}, params are {params.shape}")
        for key in ("step", "optimizer_t"):
            if not isinstance(attrs.get(key), int):
                raise _Corrupt(f"attribute {key} missing or not an integer")
        model_state = datasets.get("model_state", np.zeros(0, params.dtype))
        if model_state.ndim != 1 or model_state.dtype != params.dtype or \
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
    """_checksum of one flat float dataset read from the file a block at a time."""
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
        if key in UNRECORDED_BEFORE and key not in ckpt.attrs:
            continue
        have = ckpt.attrs.get(key, RESUME_DEFAULTS.get(key))
        if have is None:
            raise HpctrainError(f"{ckpt.path}: checkpoint does not record {key}; cannot resume "
                                f"from it (use a new --checkpoint-dir or --resume no)")
        if str(have) != str(want) and not (key == "model" and _cut_name_of(str(have), str(want))):
            raise HpctrainError(f"{ckpt.path}: checkpoint was written with {_describe(key, have)}, this "
                                f"run has {_describe(key, want)}; resume with the same setting, or start "
                                f"fresh with another --checkpoint-dir")


def _cut_name_of(have, want):
    """Whether a checkpoint's model identity ("NAME DIGEST") is `want` as an
    hpctrain before issue 54 recorded it: the name's last 40 characters
    (nn/spec.py identity), the same digest."""
    have_name, _, have_digest = have.rpartition(" ")
    want_name, _, want_digest = want.rpartition(" ")
    return have_digest == want_digest and len(have_name) == 40 < len(want_name) and want_name.endswith(have_name)


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
    """The newest valid checkpoint in DIR, or None if it holds none: a flat
    file's Checkpoint, or a folder's checkpoints/named.NamedCheckpoint (its
    index and the presence of its rank files verified; each rank file is
    hashed when first read).

    The newest is the one with the highest step stored inside it: a file whose
    name says another step than its content (a renamed copy) is reported
    through warn(line) and skipped, as corrupt files are, so a copy named
    `ckpt-99999999.h5` cannot pin every later run to an old step. A valid file
    that does not match expected_settings raises HpctrainError. lazy: read()'s.
    """
    warn = warn or (lambda line: print(f"hpctrain: warning: {line}", file=sys.stderr, flush=True))
    for named, path in list_checkpoints(directory):
        try:
            ckpt = open_checkpoint(path) if is_named(path) else read(path, lazy=lazy)
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
