"""Checkpoints of named tensors written by their owners
(hpctrain/checkpoints/named.py): the pieces of a ZeRO-like flat layout and
of a column split round-trip at any box; a damaged or missing rank file is
found; boxes that do not tile a tensor, or a rank that fails to write, leave
nothing behind and raise the same error on every rank. Beside flat files:
the newest valid one resumed, the command's listing, the sweep of a killed
writer's folder.

    python -m pytest -q tests/test_named_checkpoint.py                  # in-process, COMM_SELF
    mpirun -n 3 python -m mpi4py -m pytest --with-mpi -q tests/test_named_checkpoint.py
"""
import contextlib
import os
import shutil
import subprocess
import tempfile
import time

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from conftest import write_flat_checkpoint
from hpctrain import checkpoint as checkpoint_command
from hpctrain.checkpoints import file as flat
from hpctrain.checkpoints import named, read_back
from hpctrain.checkpoints.trust import Corrupt
from hpctrain.base.errors import HpctrainError
from hpctrain.state.parts import box_slices, flat_parts

# name -> (shape, dtype, aliases): the flat layout's tensors, then a column-split one
FLAT = {"layer0/W": ((33, 17), "<f4", []), "layer0/b": ((17,), "<f4", []),
        "embed/E": ((9, 8), "<f4", ["head/W", {"name": "out/W", "transpose": True}]),
        "adam.m/layer0/W": ((33, 17), "<f4", []),
        "layer1/W": ((384, 256), "<f4", [])}   # most of the bytes: the chief's share is measured
SPLIT = {"tp/W": ((6, 10), "<f8", [])}
TENSORS = {**FLAT, **SPLIT}


def whole_values():
    rng = np.random.default_rng(55)
    return {n: rng.standard_normal(s).astype(d) for n, (s, d, _) in TENSORS.items()}


def my_pieces(comm, values, skip=(), extra=()):
    """This rank's pieces: an uneven share of the flat buffer of FLAT (ZeRO's
    owned range, as range boxes) and a block of columns of tp/W (2-D boxes)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    spec, at = [], 0
    for name, (shape, _, _) in FLAT.items():
        n = int(np.prod(shape))
        spec.append((name, shape, at, at + n))
        at += n
    buffer = np.concatenate([values[n].ravel() for n in FLAT])
    cuts = [0] + [at * (r + 1) // size - 3 * (r + 1 < size) for r in range(size)]   # uneven on purpose
    lo, hi = cuts[rank], cuts[rank + 1]
    parts = flat_parts(spec, [(lo, hi)], buffer[lo:hi].copy())
    pieces = [(p.name, p.box, p.view) for p in parts]
    cols = [10 * r // size for r in range(size + 1)]
    box = ((0, 6), (cols[rank], cols[rank + 1]))
    pieces.append(("tp/W", box, values["tp/W"][box_slices(box)]))
    return [p for i, p in enumerate(pieces) if i not in skip] + list(extra)


@contextlib.contextmanager
def shared_dir(comm):
    """A fresh folder every rank of comm sees (its name broadcast as bytes)."""
    buf = np.zeros(4096, np.uint8)
    if comm.Get_rank() == 0:
        raw = tempfile.mkdtemp(prefix="named-ckpt-").encode()
        buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    comm.Bcast(buf, root=0)
    path = bytes(buf).rstrip(b"\0").decode()
    try:
        yield path
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)


class Waits:
    """A watchdog stand-in recording what was waited for."""

    def __init__(self):
        self.seen = []

    def __call__(self, what, peer=None):
        self.seen.append((what, peer))
        return contextlib.nullcontext()


def write(comm, d, step, pieces, keep=3, waiting=None):
    attrs = {"model": "mlp 1234", "optimizer": "adam", "lr": 0.1}
    small = {"data_positions": np.array([[1, 40], [1, 41]], np.int64), "model_state": np.zeros(0, np.float32)}
    return named.write_checkpoint(d, step, comm, 0, pieces, TENSORS, attrs, small=small, keep=keep,
                                  waiting=waiting)


def flip_last_byte(path):
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))


def hidden(d):
    return sorted(n for n in os.listdir(d) if n.startswith("."))


# ---------------------------------------------------------------------------

def round_trip(comm):
    values = whole_values()
    with shared_dir(comm) as d:
        if comm.Get_rank() == 0:   # an old flat checkpoint counts among the kept
            write_flat_checkpoint(d, 5, np.zeros(3, np.float32), {}, np.zeros((1, 2), np.int64), {})
        comm.Barrier()
        waits = Waits()
        path = write(comm, d, 10, my_pieces(comm, values), waiting=waits)
        assert path == os.path.join(d, "ckpt-00000010")
        assert waits.seen and all(peer == (None if comm.Get_rank() == 0 else 0) for _, peer in waits.seen)
        with named.open_checkpoint(path) as c:
            assert c.step == 10 and c.attrs["lr"] == 0.1 and c.attrs["optimizer"] == "adam"
            assert c.tensors == {n: (s, d_) for n, (s, d_, _) in TENSORS.items()}
            np.testing.assert_array_equal(c.small("data_positions"), [[1, 40], [1, 41]])
            assert c.small("model_state").shape == (0,)
            rng = np.random.default_rng(comm.Get_rank())
            for name, want in values.items():
                assert np.array_equal(c.read(name), want), name
                for _ in range(5):   # boxes that cross the writers' pieces
                    box = tuple(tuple(sorted(rng.integers(0, n + 1, 2))) for n in want.shape)
                    assert np.array_equal(c.read(name, box), want[box_slices(box)]), (name, box)
            assert np.array_equal(c.read("head/W"), values["embed/E"])   # an alias: the tied tensor once
            # a transposed one (the GPT's head reads its embedding so): read transposed, a box of it too
            assert np.array_equal(c.read("out/W"), values["embed/E"].T)
            assert np.array_equal(c.read("out/W", ((1, 7), (2, 5))), values["embed/E"].T[1:7, 2:5])
        # Any h5py user reads the whole tensor through the index's virtual datasets.
        with h5py.File(os.path.join(path, named.INDEX), "r") as f:
            assert np.array_equal(f["layer0/W"][...], values["layer0/W"])
            assert np.array_equal(f["head/W"][...], values["embed/E"])
            assert "out/W" not in f   # no link reads a transposed use as it is stored
            # named relative to the index: the folder can be moved or copied whole
            assert {s.file_name for s in f["tp/W"].virtual_sources()} == \
                {named.rank_file_name(r) for r in range(comm.Get_size())}
        comm.Barrier()
        # The chief's share of the bytes: its rank file and the index, against the whole state.
        if comm.Get_rank() == 0:
            state = sum(v.nbytes for v in values.values())
            index = os.path.getsize(os.path.join(path, named.INDEX))
            chief = index + os.path.getsize(os.path.join(path, named.rank_file_name(0)))
            print(f"\nnamed checkpoint at {comm.Get_size()} rank(s): the chief writes {chief} bytes (the index "
                  f"{index}), the state is {state} bytes ({chief / state:.2f})")
            assert chief < state / comm.Get_size() + 64 * 1024   # its share, the index and HDF5's headers
        # Later steps prune the oldest, the flat file first; nothing temporary is left.
        write(comm, d, 20, my_pieces(comm, values), keep=2)
        write(comm, d, 30, my_pieces(comm, values), keep=2)
        assert [s for s, _ in flat.list_checkpoints(d)] == [30, 20]
        assert hidden(d) == []


def test_round_trip_in_process(capsys):
    round_trip(MPI.COMM_SELF)


@pytest.mark.mpi(min_size=2)
def test_round_trip_on_every_rank():
    round_trip(MPI.COMM_WORLD)


def damaged_files_are_found(comm):
    values = whole_values()
    last = named.rank_file_name(comm.Get_size() - 1)
    with shared_dir(comm) as d:
        path = write(comm, d, 10, my_pieces(comm, values))
        comm.Barrier()
        if comm.Get_rank() == 0:
            flip_last_byte(os.path.join(path, last))   # one flipped bit of data, same size
        comm.Barrier()
        with named.open_checkpoint(path) as c:
            with pytest.raises(Corrupt, match=f"{last}: checksum mismatch"):
                c.read("tp/W")   # every rank holds columns of it: the last rank's file is read
        comm.Barrier()
        if comm.Get_rank() == 0:
            os.unlink(os.path.join(path, last))
        comm.Barrier()
        with pytest.raises(Corrupt, match=f"{last}: No such file"):
            named.open_checkpoint(path)
        with h5py.File(os.path.join(path, named.INDEX), "r") as f:   # read past the reader: NaN, never zeros
            assert np.isnan(f["tp/W"][:, -1]).all()
        comm.Barrier()
        if comm.Get_rank() == 0:   # the index itself: hashed before HDF5 parses it
            flip_last_byte(os.path.join(path, named.INDEX))
        comm.Barrier()
        with pytest.raises(Corrupt, match=f"^{named.INDEX}: checksum mismatch$"):
            named.open_checkpoint(path)


def test_damaged_files_are_found_in_process():
    damaged_files_are_found(MPI.COMM_SELF)


@pytest.mark.mpi(min_size=2)
def test_damaged_files_are_found_on_every_rank():
    damaged_files_are_found(MPI.COMM_WORLD)


def refused_and_failed_leave_nothing(comm):
    values = whole_values()
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    with shared_dir(comm) as d:
        # A gap: rank 0 leaves out its first piece.
        with pytest.raises(HpctrainError, match=r"layer0/W: the writers' boxes cover \d+ of its 561 values") as e:
            write(comm, d, 10, my_pieces(comm, values, skip=(0,) if rank == 0 else ()))
        assert e.value.collective and e.value.report == (rank == 0)
        assert os.listdir(d) == []
        # An overlap: the last rank writes rank 0's first column block too.
        theirs = my_pieces(comm, values)[-1] if rank == 0 else None
        box = ((0, 6), (0, 10 // comm.Get_size()))
        extra = [("tp/W", box, values["tp/W"][box_slices(box)])] if rank == last else []
        with pytest.raises(HpctrainError, match=r"tp/W: rank \d+'s box \[0:6, 0:\d+\] and rank \d+'s .* overlap"):
            write(comm, d, 10, my_pieces(comm, values, extra=extra))
        assert theirs is None or theirs[1] == box
        assert os.listdir(d) == []
        # A rank whose write fails: no checkpoint, the temporary folder removed, the older one kept.
        write(comm, d, 10, my_pieces(comm, values))
        real = named._write_rank_file

        def fails(path, pieces):
            real(path, pieces)
            raise OSError(28, "No space left on device")
        named._write_rank_file = fails if rank == last else real
        try:
            with pytest.raises(HpctrainError, match=f"ckpt-00000020: not written: rank {last}: "
                                                    f"rank-\\d+.h5: No space left on device"):
                write(comm, d, 20, my_pieces(comm, values))
        finally:
            named._write_rank_file = real
        comm.Barrier()
        assert os.listdir(d) == ["ckpt-00000010"]


def test_refused_and_failed_leave_nothing_in_process():
    refused_and_failed_leave_nothing(MPI.COMM_SELF)


@pytest.mark.mpi(min_size=2)
def test_refused_and_failed_leave_nothing_on_every_rank():
    refused_and_failed_leave_nothing(MPI.COMM_WORLD)


# ---------------------------------------------------------------------------
# finding, checking and listing them beside flat files (one process)

def test_the_newest_valid_checkpoint_of_either_format_is_resumed(tmp_path):
    values, comm = whole_values(), MPI.COMM_SELF
    for step in (5, 10):
        write_flat_checkpoint(tmp_path, step, np.zeros(3, np.float32), {}, np.zeros((1, 2), np.int64),
                              {"model": "mlp 1234"})
    path = write(comm, tmp_path, 10, my_pieces(comm, values))
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000005.h5", "ckpt-00000010"]   # step 10's file replaced
    warnings = []
    ckpt = read_back.load_latest(tmp_path, {"model": "mlp 1234"}, warn=warnings.append)
    assert (ckpt.path, ckpt.step, warnings) == (path, 10, [])
    assert np.array_equal(ckpt.read("tp/W"), values["tp/W"])
    ckpt.close()
    with pytest.raises(HpctrainError, match="ckpt-00000010: checkpoint was written with --model mlp 1234, this "
                                            "run has --model gpt 99"):
        read_back.load_latest(tmp_path, {"model": "gpt 99"})
    # A rank file gone: the folder is skipped for the flat file before it.
    os.unlink(os.path.join(path, named.rank_file_name(0)))
    ckpt = read_back.load_latest(tmp_path, {"model": "mlp 1234"}, warn=warnings.append)
    assert ckpt.step == 5 and warnings == ["ckpt-00000010: corrupt (rank-00000.h5: No such file or directory), "
                                           "trying the previous one"]
    # A folder whose name lies about its step is skipped as a renamed file is.
    os.rename(write(comm, tmp_path, 20, my_pieces(comm, values)), tmp_path / "ckpt-00000030")
    warnings.clear()
    assert read_back.load_latest(tmp_path, {}, warn=warnings.append).step == 5
    assert warnings[0].startswith("ckpt-00000030: its name says step 30 but it holds step 20")


def test_a_crafted_index_is_refused_in_one_line(tmp_path):
    values, comm = whole_values(), MPI.COMM_SELF
    named.write_checkpoint(tmp_path, 10, comm, 0, my_pieces(comm, values), TENSORS, {},
                           small={"data_positions": np.array([[2 ** 60, 0]], np.int64)})
    with pytest.raises(HpctrainError, match="ckpt-00000010: refused: a data position's epoch 1152921504606846976 "
                                            "is out of range"):
        read_back.load_latest(tmp_path, {})


def test_the_checkpoint_command_lists_the_tensors_of_both_formats(tmp_path, capsys):
    values, comm = whole_values(), MPI.COMM_SELF
    write_flat_checkpoint(tmp_path, 5, np.zeros(3, np.float32), {"m": np.zeros(3, np.float32)},
                          np.zeros((1, 2), np.int64), {"optimizer": "adam"})
    path = write(comm, tmp_path, 10, my_pieces(comm, values))
    assert checkpoint_command.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ckpt-00000010: ok, step 10, ")
    assert out[1:11] == ["  layer0/W         float32 (33, 17)", "  layer0/b         float32 (17,)",
                        "  embed/E          float32 (9, 8)", "  adam.m/layer0/W  float32 (33, 17)",
                        "  layer1/W         float32 (384, 256)", "  tp/W             float64 (6, 10)",
                        "  head/W           -> embed/E", "  out/W            -> embed/E (transposed)",
                        "  data_positions   int64 (2, 2)", "  model_state      float32 (0,)"]
    assert out[11].startswith("ckpt-00000005.h5: ok, step 5, ")
    assert out[12:] == ["  params          float32 (3,)", "  optimizer/m     float32 (3,)",
                       "  data_positions  int64 (1, 2)"]
    # The command hashes every rank file, not only those a reader would open.
    flip_last_byte(os.path.join(path, named.rank_file_name(0)))
    assert checkpoint_command.main([str(tmp_path)]) == 1
    assert "ckpt-00000010: corrupt (rank-00000.h5: checksum mismatch" in capsys.readouterr().out


def test_a_killed_writers_temporary_folder_is_swept_at_the_next_start(tmp_path):
    from argparse import Namespace
    from hpctrain.run import outputs
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".ckpt-00000020.tmp-{dead.pid}-abcd1234"        # a checkpoint being written
    aside = tmp_path / f".ckpt-00000010.tmp-{dead.pid}-0123abcd"        # an old one being pruned
    live = tmp_path / f".ckpt-00000030.tmp-{os.getppid()}-abcd1234"      # a running writer's
    for folder in (stale, aside, live):
        folder.mkdir()
        (folder / "rank-00000.h5").write_bytes(b"half")
        os.utime(folder, (time.time() - 7200, time.time() - 7200))   # before this process started
    args = Namespace(save=None, metrics=None, timeline=None, checkpoint_dir=str(tmp_path))
    assert sorted(outputs.sweep_stale_temporaries(args)) == [str(aside), str(stale)]
    assert os.listdir(tmp_path) == [live.name]
