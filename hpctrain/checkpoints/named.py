"""Checkpoints of named whole tensors, written by their owners in parallel
(issue 55; torch's distributed checkpoint and DeepSpeed's universal
checkpoint are the anchors): no rank holds or writes the whole state.

A checkpoint is a folder, `DIR/ckpt-00000123/` (the global step, 8 digits):

    rank-00003.h5      the pieces rank 3 of the writing communicator owns: one
                       dataset each ("000000", ...: the box's shape, the tensor's
                       dtype; attributes `tensor` and `box` for people), plain
                       contiguous HDF5 any tool reads
    index.h5           written by the chief last:
      user block (512 B)   "hpctrain-checkpoint-index 1 sha256 <hex>\\n": a hash
                           of every byte after it, checked before HDF5 parses it
      <tensor name>        an HDF5 VIRTUAL dataset of the whole tensor's shape over
                           the rank files' pieces (sources named relative to the
                           folder, so the folder can move): `h5py.File(".../index.h5")
                           ["layer0/W"][...]` reads it whole; fill value NaN, so a
                           missing rank file reads as NaN, never as plausible zeros
      <alias>              a soft link to the tensor it is tied to (none for a
                           transposed use: the manifest records it)
      <small>              datasets the chief writes whole (data positions, ...)
      _hpctrain/manifest   JSON bytes: every tensor (shape, dtype, aliases: a tied
                           tensor's other names, [{"name": "head/W", "transpose":
                           true}]: the GPT's head reads embedding/E transposed), every
                           piece (tensor, box, file, dataset), every rank file's
                           size and sha256
      attrs                format, format_version, step, and the run's attributes
                           (ints, floats, strs), as a flat checkpoint's

Writing (`write_checkpoint`, collective): the pieces' metadata goes to the
chief as JSON bytes (no pickle), which checks that the writers' boxes tile
every tensor exactly once; every rank writes its file into one hidden
temporary folder beside the checkpoint (exclusive, unpredictable, named with
the chief's pid for the sweep at the next start), fsyncs it and reports its
size and hash; the chief writes the index last, fsyncs it, renames the folder
into place and fsyncs DIR. A refusal or any rank's failure leaves no
checkpoint (the temporary folder removed) and raises the same error on every
rank. The newest `keep` checkpoints are kept, old flat files (checkpoints/file.py)
counted too.

Reading (`open_checkpoint`): the index's hash is checked before HDF5 parses
it, every rank file it names must exist with its recorded size, and a rank
file is hashed whole before its first piece is read; a reader reads only the
pieces under the boxes it asks for, from the rank files directly (not through
the virtual datasets, which would read a missing file as fill). A damaged or
missing file is `trust.Corrupt`; a crafted index (names outside the folder,
boxes that do not tile) is `trust.Refused`.

    mpirun -n 3 python -m mpi4py -m pytest --with-mpi -q tests/test_named_checkpoint.py
"""
import contextlib
import hashlib
import json
import os
import re
import shutil

import numpy as np

from . import file as flat
from .trust import MAX_COUNT, Corrupt, Refused, check_attr_types, check_ranges, hard_linked, plain, stored_inside
from ..base.errors import EXIT_FAILURE, HpctrainError
from ..base.files import create_new, temp_name_next_to
from ..base.precision import file_dtype
from ..state.parts import box_shape, box_slices

FORMAT = "hpctrain-checkpoint"
INDEX = "index.h5"
INDEX_HEADER = "hpctrain-checkpoint-index"
INDEX_VERSION = 1
MANIFEST = "_hpctrain/manifest"
_RANK_FILE_RE = re.compile(r"^rank-\d{5,}\.h5$")


def rank_file_name(rank):
    return f"rank-{int(rank):05d}.h5"


def _no_watchdog(what, peer=None):
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------
# writing

def write_checkpoint(directory, step, comm, chief, pieces, tensors, attrs, small=None, keep=3, waiting=None):
    """Collective over comm: write DIR/ckpt-<step>/ (this module's format)
    from every rank's pieces; keep the newest `keep`; return its path.

    pieces: this rank's [(name, box, host ndarray of the box's shape)];
    tensors: {name: (shape, dtype str like "<f4", aliases list)} (the
    chief's counts); attrs: {key: int|float|str} (the chief's); small:
    {dataset name: ndarray} the chief writes into the index; chief: its rank
    in comm; waiting(what, peer): a context manager around every blocking MPI
    call (run/world.World.waiting). Raises HpctrainError on every rank, the
    same line, when the boxes do not tile the tensors or any rank fails to
    write; nothing is left behind then."""
    waiting = waiting or _no_watchdog
    directory = os.fspath(directory)
    path = os.path.join(directory, flat.checkpoint_name(step))
    is_chief = comm.Get_rank() == chief

    # The chief names the temporary folder before it exists: an interrupt
    # (Ctrl-C raises wherever a Python function starts) anywhere after it is
    # made removes it below, never leaving a half-written checkpoint behind.
    tmp = temp_name_next_to(path) if is_chief else None
    try:
        return _write(directory, path, step, comm, chief, tmp, pieces, tensors, attrs, small, keep, waiting)
    except HpctrainError:   # the folder already removed, or never made (a planted name is not ours to remove)
        raise
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)   # gone already once renamed into place
        raise


def _write(directory, path, step, comm, chief, tmp, pieces, tensors, attrs, small, keep, waiting):
    """write_checkpoint's three rounds; tmp: the chief's temporary folder's name (None elsewhere)."""
    rank = comm.Get_rank()
    is_chief = rank == chief
    peer = None if is_chief else chief

    # 1. What every rank holds, to the chief; its verdict (and the folder) back.
    mine = _described(rank, pieces)
    everyone = _gather_json(comm, chief, mine, waiting, peer, "checkpoint pieces gather")
    verdict = None
    if is_chief:
        verdict = _chief_prepares(directory, path, tmp, tensors, everyone)
    verdict = _bcast_json(comm, chief, verdict, waiting, peer, "checkpoint plan broadcast")
    if "error" in verdict:
        raise _collective(verdict, is_chief)
    tmp = verdict["tmp"]   # every rank's, now

    # 2. Each rank its file, durable, its size and hash to the chief.
    reports = _gather_json(comm, chief, _written(tmp, rank, pieces), waiting, peer, "checkpoint outcome gather")

    # 3. The chief: the index, the rename, the prune; or the folder removed.
    final = None
    if is_chief:
        final = _chief_finishes(directory, path, tmp, step, tensors, attrs, small or {}, everyone, reports, keep)
    final = _bcast_json(comm, chief, final, waiting, peer, "checkpoint outcome broadcast")
    if "error" in final:
        raise _collective(final, is_chief)
    return final["path"]


def _described(rank, pieces):
    """What the chief checks of a rank's pieces: {"rank", "pieces": [[name,
    box, dtype, shape]]} or {"error": ...}."""
    try:
        return {"rank": rank, "pieces": [[name, [list(map(int, b)) for b in box], file_dtype(np.asarray(v).dtype).str,
                            list(np.shape(v))] for name, box, v in pieces]}
    except Exception as e:   # a box that is no box: said by the chief, like any other refusal
        return {"error": f"rank {rank}: {_reason(e)}"}


def _written(tmp, rank, pieces):
    """This rank's file of `pieces` in folder tmp, durable: {"file", "size",
    "sha256"} ({"file": None}: nothing to write), or {"error": ...}."""
    if not any(box_volume(box) for _, box, _ in pieces):
        return {"file": None}
    name = rank_file_name(rank)
    try:
        size, digest = _write_rank_file(os.path.join(tmp, name), pieces)
        return {"file": name, "size": size, "sha256": digest}
    except Exception as e:
        return {"error": f"rank {rank}: {name}: {_reason(e)}"}


# --- written point to point (ps: the servers write at the cut, the chief last) ---

@contextlib.contextmanager
def new_folder(directory, step):
    """The chief's temporary folder for a checkpoint that ranks write into
    outside a collective (ps's servers, each when it takes the cut): made
    empty and exclusive, named as write_checkpoint's (the sweep at the next
    start knows it; `step`: the expected one, the name only), and removed on
    the way out whatever happens, an interrupt included (once `finish`
    renamed it into place it is gone already). A failure to make it is one
    line."""
    path = os.path.join(os.fspath(directory), flat.checkpoint_name(step))
    tmp = temp_name_next_to(path)   # named before it exists, as write_checkpoint's
    try:
        os.makedirs(os.fspath(directory), exist_ok=True)
        os.mkdir(tmp)
    except OSError as e:   # nothing made (a planted name is not ours to remove)
        raise HpctrainError(f"{path}: cannot write checkpoint ({_reason(e)})") from None
    except BaseException:   # an interrupt right after it was made
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_part(tmp, rank, pieces):
    """Rank `rank`'s file of `pieces` [(name, box, host ndarray)] in the
    temporary folder `tmp` (new_folder's): what `finish` takes of it,
    JSON-able (its pieces, file, size and sha256, or the error)."""
    described = _described(rank, pieces)
    return {**described, **_written(tmp, rank, pieces)} if "error" not in described else described


def finish(directory, step, tmp, tensors, attrs, small, parts, keep=3):
    """The chief, once every writer's `write_part` outcome is in `parts`
    (one per rank file, any order): the tiling checked, the index written,
    the folder renamed into place, the older ones pruned; the path. Any
    failure: one line (HpctrainError), and no checkpoint (new_folder removes tmp)."""
    directory = os.fspath(directory)
    path = os.path.join(directory, flat.checkpoint_name(step))
    refusal = _refusal(path, tensors, parts)
    if refusal:
        raise HpctrainError(refusal)
    final = _chief_finishes(directory, path, tmp, step, tensors, attrs, small, parts, parts, keep)
    if "error" in final:
        raise HpctrainError(final["error"])
    return final["path"]


def box_volume(box):
    return int(np.prod(box_shape(box), dtype=np.int64))


def _reason(e):
    return " ".join(str(getattr(e, "strerror", None) or e).split()) or type(e).__name__


def _collective(said, is_chief):
    """The chief's verdict as the same error on every rank, printed once."""
    return HpctrainError(said["error"], exit_code=said.get("exit_code"), collective=True, report=is_chief)


def _chief_prepares(directory, path, tmp, tensors, everyone):
    """The chief checks the tiling and makes the temporary folder `tmp`:
    {"tmp": tmp} or {"error": ..., "exit_code": ...}."""
    refusal = _refusal(path, tensors, everyone)
    if refusal:   # a layout that writes a box twice or not at all: a bug, said on every rank
        return {"error": refusal, "exit_code": EXIT_FAILURE}
    try:
        os.makedirs(directory, exist_ok=True)
        os.mkdir(tmp)   # exclusive: a name someone planted fails here, it is never written into
    except OSError as e:
        return {"error": f"{path}: cannot write checkpoint ({_reason(e)})"}
    return {"tmp": tmp}


def _refusal(path, tensors, described):
    """The line for pieces that are not written (`_described`'s of every
    writer: one's error, or boxes that do not tile the tensors), or None."""
    errors = [e["error"] for e in described if "error" in e]
    if errors:
        return f"{path}: not written: {errors[0]}"
    try:
        table = [(name, tuple(map(tuple, box)), f"rank {e['rank']}", dtype, shape)
                 for e in described for name, box, dtype, shape in e["pieces"]]
        check_tiling({n: (tuple(s), file_dtype(d).str) for n, (s, d, _) in tensors.items()}, table)
    except Exception as e:
        return f"{path}: not written: {_reason(e)}"
    return None


def check_tiling(tensors, table):
    """Refused unless the boxes of `table` [(name, box, who, dtype, shape)]
    (who: the writer, for the message) lie inside their tensors of `tensors` {name: (shape, dtype)},
    with the tensor's dtype and the box's shape, and tile every tensor exactly
    once (no value written twice, none left out). Empty boxes are ignored."""
    by_name = {name: [] for name in tensors}
    for name, box, who, dtype, shape in table:
        if name not in tensors:
            raise Refused(f"{who} writes a piece of {name!r}, which is not a tensor of the checkpoint")
        whole, want = tensors[name]
        if len(box) != len(whole) or any(not (0 <= a <= b <= n) for (a, b), n in zip(box, whole)):
            raise Refused(f"{who}'s box {_show(box)} of {name} lies outside its shape {tuple(whole)}")
        if dtype != want or tuple(shape) != box_shape(box):
            raise Refused(f"{who}'s piece of {name} at {_show(box)} is {dtype} {tuple(shape)}, "
                          f"the tensor is {want} and the box {box_shape(box)}")
        if box_volume(box):
            by_name[name].append((box, who))
    for name, boxes in by_name.items():
        whole = tensors[name][0]
        boxes.sort(key=lambda b: b[0][0] if b[0] else 0)
        for i, (box, who) in enumerate(boxes):
            for other, other_who in boxes[i + 1:]:
                if box and other[0][0] >= box[0][1]:
                    break   # sorted by the first start: nothing further meets this box
                if all(a < d and c < b for (a, b), (c, d) in zip(box, other)):
                    raise Refused(f"{name}: {who}'s box {_show(box)} and {other_who}'s {_show(other)} "
                                  f"overlap (each value has one writer)")
        written = sum(box_volume(b) for b, _ in boxes)
        total = int(np.prod(whole, dtype=np.int64))
        if written != total:
            raise Refused(f"{name}: the writers' boxes cover {written} of its {total} values (a gap)")


def _show(box):
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def _write_rank_file(path, pieces):
    """This rank's pieces into a new file, fsync'd: (size, sha256 hex)."""
    import h5py
    os.close(create_new(path))
    with h5py.File(path, "w", locking=False) as f:
        for k, (name, box, values) in enumerate(pieces):
            if not box_volume(box):
                continue
            a = np.ascontiguousarray(values)
            d = f.create_dataset(f"{k:06d}", data=a.astype(file_dtype(a.dtype), copy=False))
            d.attrs["tensor"] = name
            d.attrs["box"] = json.dumps([list(map(int, b)) for b in box])
    return _digest(path, durable=True)


def _digest(path, durable=False):
    """A file's (size, sha256 hex), read a block at a time; durable: fsync'd first."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        if durable:
            os.fsync(f.fileno())
        for block in iter(lambda: f.read(flat.BLOCK_BYTES), b""):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def _chief_finishes(directory, path, tmp, step, tensors, attrs, small, everyone, reports, keep):
    """Every rank wrote: the index, the rename into place, the prune;
    {"path": ...}. Otherwise (or failing here) the folder removed and
    {"error": ...}."""
    try:
        errors = [r["error"] for r in reports if "error" in r]
        if errors:
            raise HpctrainError(f"{path}: not written: {errors[0]}" + (
                f" (and {len(errors) - 1} more rank(s))" if len(errors) > 1 else ""))
        files = {r["file"]: {"size": r["size"], "sha256": r["sha256"]} for r in reports if r["file"]}
        pieces = [[name, box, report["file"], f"{k:06d}"]
                  for e, report in zip(everyone, reports) for k, (name, box, _, _) in enumerate(e["pieces"])
                  if box_volume(box)]
        _write_index(os.path.join(tmp, INDEX), step, tensors, attrs, small, pieces, files)
        flat._fsync_dir(tmp)
        if os.path.isdir(path) and not os.path.islink(path):   # this step written before: replaced whole
            flat._remove_folder(path)
        os.replace(tmp, path)
        flat._unlink_quietly(path + ".h5")   # a flat file of this step (an older hpctrain's): replaced too
        flat._fsync_dir(directory)
    except Exception as e:   # whatever it is, every rank hears it (none is left waiting)
        shutil.rmtree(tmp, ignore_errors=True)
        text = str(e) if isinstance(e, HpctrainError) else f"{path}: cannot write checkpoint ({_reason(e)})"
        return {"error": text}
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        flat._prune(directory, keep, mine=path)
    except OSError as e:
        return {"error": f"{path}: written, but an older checkpoint cannot be removed ({_reason(e)})"}
    return {"path": path}


def _write_index(index, step, tensors, attrs, small, pieces, files):
    """The chief's index (this module's docstring), stamped and fsync'd."""
    import h5py
    manifest = {"tensors": {n: {"shape": list(map(int, s)), "dtype": file_dtype(d).str,
                                "aliases": [dict(zip(("name", "transpose"), alias_of(x))) for x in a]}
                            for n, (s, d, a) in tensors.items()},
                "pieces": pieces, "files": files, "small": sorted(small)}
    by_name = {}
    for name, box, fname, dataset in pieces:
        by_name.setdefault(name, []).append((box, fname, dataset))
    head = {"format": FORMAT, "format_version": flat.FORMAT_VERSION, "step": int(step)}
    os.close(create_new(index))
    with h5py.File(index, "w", userblock_size=flat.USERBLOCK, locking=False) as f:
        for name, (shape, dtype, aliases) in tensors.items():
            dtype = file_dtype(dtype)
            layout = h5py.VirtualLayout(shape=tuple(shape), dtype=dtype)
            for box, fname, dataset in by_name.get(name, []):
                layout[box_slices(box)] = h5py.VirtualSource(fname, dataset, shape=box_shape(box), dtype=dtype)
            f.create_virtual_dataset(name, layout, fillvalue=np.nan if dtype.kind == "f" else 0)
            for alias in aliases:   # a link reads the tensor as it is: none for a transposed use
                alias, transposed = alias_of(alias)
                if not transposed:
                    f[alias] = h5py.SoftLink("/" + name)
        for key, value in small.items():
            a = np.ascontiguousarray(value)
            f.create_dataset(key, data=a.astype(file_dtype(a.dtype), copy=False))
        f.create_dataset(MANIFEST, data=np.frombuffer(json.dumps(manifest).encode(), np.uint8))
        for key, value in {**head, **{k: v for k, v in attrs.items() if k not in head}}.items():
            f.attrs[key] = flat._attr_value(key, value)
    flat.stamp(index, durable=True, kind=INDEX_HEADER, version=INDEX_VERSION)


def alias_of(entry):
    """(name, transposed) of an alias as the manifest records it: {"name":
    "head/W", "transpose": true} (a tie, nn/spec.ModelSpec.aliases), or a
    plain name (read as the tensor is)."""
    if isinstance(entry, str):
        return entry, False
    name, transposed = entry["name"], entry.get("transpose", False)
    if not isinstance(name, str) or not isinstance(transposed, bool):
        raise ValueError(f"alias {entry!r} is not a name and a transpose flag")
    return name, transposed


# ---------------------------------------------------------------------------
# MPI: JSON bytes, no pickle

def _gather_json(comm, root, obj, waiting, peer, what):
    """Every rank's obj (JSON-able) on root, in rank order (None elsewhere)."""
    from mpi4py import MPI
    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    is_root = comm.Get_rank() == root
    counts = np.zeros(comm.Get_size(), np.int64) if is_root else None
    with waiting(f"{what} (sizes)", peer):
        comm.Gather(np.array([raw.size], np.int64), counts, root=root)
    recv = None
    if is_root:
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
        buf = np.empty(int(counts.sum()), np.uint8)
        recv = [buf, counts.tolist(), displs.tolist(), MPI.BYTE]
    with waiting(what, peer):
        comm.Gatherv(raw, recv, root=root)
    if not is_root:
        return None
    return [json.loads(bytes(buf[d:d + c])) for d, c in zip(displs, counts)]


def _bcast_json(comm, root, obj, waiting, peer, what):
    """root's obj (JSON-able) on every rank."""
    is_root = comm.Get_rank() == root
    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8) if is_root else None
    n = np.array([raw.size if is_root else 0], np.int64)
    with waiting(f"{what} (size)", peer):
        comm.Bcast(n, root=root)
    buf = raw.copy() if is_root else np.empty(int(n[0]), np.uint8)
    with waiting(what, peer):
        comm.Bcast(buf, root=root)
    return json.loads(bytes(buf))


# ---------------------------------------------------------------------------
# reading

def is_named(path):
    """Whether path is a checkpoint folder of this format (not a flat file)."""
    return os.path.isdir(path) and not os.path.islink(path)


def open_checkpoint(path):
    """The checkpoint folder at path, its index verified (NamedCheckpoint);
    trust.Corrupt (damaged, incomplete) or trust.Refused (crafted)."""
    return NamedCheckpoint(os.fspath(path))


class NamedCheckpoint:
    """A verified checkpoint folder: `.path .step .attrs .tensors` ({name:
    (shape, dtype)}), `.aliases` ({alias: (name, transposed)}), `.small(name)` (one of `.smalls`),
    `.read(name, box=None)` (the box's values, from the rank files under it,
    each hashed whole before its first read), `.files` ({rank file: (size,
    sha256)}), `.close()`."""

    def __init__(self, path):
        import h5py
        self.path = path
        self._opened = {}
        index = os.path.join(path, INDEX)
        size = _check_index(index)
        try:
            self._index = h5py.File(index, "r", locking=False)
        except OSError as e:
            raise Corrupt(f"{INDEX}: unreadable HDF5: {_reason(e)}") from None
        try:
            self._load(size)
        except BaseException:
            self.close()
            raise

    def _load(self, size):
        f = self._index
        try:
            self.attrs = {k: plain(v) for k, v in f.attrs.items()}
            check_attr_types(self.attrs)
            raw = stored_inside(hard_linked(f, MANIFEST), MANIFEST, size)
            if raw.dtype != np.uint8 or raw.ndim != 1:
                raise Refused(f"{MANIFEST} is {raw.dtype} {raw.shape}, not JSON bytes")
            manifest = json.loads(bytes(raw[()]))
            self.tensors = {n: (tuple(int(x) for x in t["shape"]), np.dtype(str(t["dtype"])).str)
                            for n, t in manifest["tensors"].items()}
            self.aliases = {a: (n, transposed) for n, t in manifest["tensors"].items()
                            for a, transposed in map(alias_of, t["aliases"])}
            self.files = {str(n): (int(v["size"]), str(v["sha256"])) for n, v in manifest["files"].items()}
            self.smalls = [str(n) for n in manifest["small"]]
            pieces = [(str(n), tuple((int(a), int(b)) for a, b in box), str(fn), str(ds))
                      for n, box, fn, ds in manifest["pieces"]]
        except (KeyError, ValueError, TypeError, AttributeError, OSError) as e:
            raise Corrupt(f"{INDEX}: unreadable manifest ({_reason(e)})") from None
        if self.attrs.get("format") != FORMAT or not isinstance(self.attrs.get("step"), int):
            raise Corrupt(f"{INDEX}: not an hpctrain checkpoint index")
        self.step = self.attrs["step"]
        if not 0 <= self.step <= MAX_COUNT:
            raise Refused(f"step {self.step} is out of range (0..{MAX_COUNT})")
        for name, (shape, dtype) in self.tensors.items():
            if np.dtype(dtype).kind not in "fiu" or any(n < 0 for n in shape):
                raise Refused(f"tensor {name} is {dtype} {shape}")
        for fname in self.files:
            if not _RANK_FILE_RE.match(fname):
                raise Refused(f"the index names a rank file {fname!r} (not rank-NNNNN.h5 in the folder)")
        table = []
        for name, box, fname, dataset in pieces:
            if fname not in self.files:
                raise Refused(f"a piece of {name} lies in {fname!r}, which the index does not list")
            shape_dtype = self.tensors.get(name, ((), "?"))
            table.append((name, box, fname, shape_dtype[1], box_shape(box)))
        check_tiling(self.tensors, table)
        self._pieces = {}
        for name, box, fname, dataset in pieces:
            self._pieces.setdefault(name, []).append((box, fname, dataset))
        if "data_positions" in self.smalls:   # the counts a resume computes with, as a flat file's
            positions = self.small("data_positions")
            if positions.dtype != np.int64 or positions.ndim != 2 or positions.shape[1] != 2:
                raise Refused(f"data_positions is {positions.dtype} {positions.shape}, expected int64 (workers, 2)")
            check_ranges({"optimizer_t": 0, **self.attrs}, positions)
        # Every rank file present at its size: a checkpoint with one missing is
        # skipped whole at resume, not found out half-way through reading it.
        for fname, (want, _) in self.files.items():
            try:
                have = os.stat(os.path.join(self.path, fname)).st_size
            except OSError as e:
                raise Corrupt(f"{fname}: {_reason(e)}") from None
            if have != want:
                raise Corrupt(f"{fname}: {have} bytes, the index says {want}")

    @property
    def name(self):
        return os.path.basename(self.path)

    def small(self, name):
        """A dataset the chief wrote whole into the index (data positions, ...)."""
        if name not in self.smalls:
            raise KeyError(name)
        try:
            obj = hard_linked(self._index, name)
            if obj.size:   # an empty dataset has no storage to check
                stored_inside(obj, name, os.path.getsize(os.path.join(self.path, INDEX)))
            return obj[()]
        except OSError as e:
            raise Corrupt(f"{INDEX}: {name}: {_reason(e)}") from None

    def read_as(self, spec):
        """read(name, box) by the names of the model `spec` (nn/spec.py), of a
        checkpoint an older hpctrain wrote (positional names) too:
        ModelSpec.name_in_file."""
        in_file = spec.name_in_file(self.tensors)
        return lambda name, box=None: self.read(in_file(name), box)

    def read(self, name, box=None):
        """The values of `box` ((start, stop) per dimension; None: the whole
        tensor) of tensor `name` (or an alias: a transposed one reads the
        tensor's transposed box, transposed), a new host array of its dtype."""
        if name in self.aliases:
            name, transposed = self.aliases[name]
            if transposed:
                return self.read(name, None if box is None else box[::-1]).T.copy()
        shape, dtype = self.tensors[name]
        box = tuple((0, n) for n in shape) if box is None else tuple((int(a), int(b)) for a, b in box)
        if len(box) != len(shape) or any(not (0 <= a <= b <= n) for (a, b), n in zip(box, shape)):
            raise ValueError(f"box {_show(box)} lies outside {name}'s shape {shape}")
        out = np.empty(box_shape(box), np.dtype(dtype).newbyteorder("="))
        for piece, fname, dataset in self._pieces.get(name, []):
            meet = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, piece))
            if any(a >= b for a, b in meet):
                continue
            ds = self._dataset(fname, dataset, piece, dtype)
            src = tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(meet, piece))
            dst = tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(meet, box))
            try:
                out[dst] = ds[src]
            except OSError as e:
                raise Corrupt(f"{fname}: {_reason(e)}") from None
        return out

    def verify(self):
        """Hash every rank file now (the checkpoint command), not as it is read."""
        for fname in self.files:
            self._verified(fname)

    def _verified(self, fname):
        """Corrupt unless the rank file's bytes are those the index records."""
        size, digest = self.files[fname]
        try:
            have = _digest(os.path.join(self.path, fname))
        except OSError as e:
            raise Corrupt(f"{fname}: {_reason(e)}") from None
        if have != (size, digest):
            raise Corrupt(f"{fname}: checksum mismatch (the index records another file)")

    def _dataset(self, fname, dataset, box, dtype):
        import h5py
        if fname not in self._opened:
            self._verified(fname)
            full = os.path.join(self.path, fname)
            try:
                self._opened[fname] = h5py.File(full, "r", locking=False)
            except OSError as e:
                raise Corrupt(f"{fname}: unreadable HDF5: {_reason(e)}") from None
        f = self._opened[fname]
        try:
            ds = stored_inside(hard_linked(f, dataset), dataset, self.files[fname][0])
        except Corrupt as e:
            raise type(e)(f"{fname}: {e}") from None
        if ds.shape != box_shape(box) or ds.dtype != np.dtype(dtype):
            raise Refused(f"{fname}: dataset {dataset} is {ds.dtype} {ds.shape}, the index says "
                          f"{dtype} {box_shape(box)}")
        return ds

    def close(self):
        for f in self._opened.values():
            f.close()
        self._opened = {}
        if getattr(self, "_index", None) is not None:
            self._index.close()
            self._index = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_index(index):
    """The index's bytes against its header, before HDF5 parses it: its
    size, or Corrupt."""
    try:
        return flat.check_stamp(index, INDEX_HEADER, INDEX_VERSION, "checkpoint index")
    except Corrupt as e:
        raise Corrupt(f"{INDEX}: {e}") from None
