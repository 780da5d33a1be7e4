"""Tests for checkpoints and resume (hpctrain/checkpoint.py and the ring loop's use of it).

Serial tests of the old flat files hpctrain still resumes (written here by
conftest.write_flat_checkpoint: corrupt files, checksum, incompatible
settings, pruning beside them) and of an interrupted checkpoint write, then
real jobs under the venv's mpirun: a ring run
stopped by SIGTERM and by SIGUSR1 and resumed ends bit-identical to an
uninterrupted run. The jobs run in the plain pytest pass (skipped inside the
MPI pass), with a small model so the file takes well under a minute on 2 cores:

    .venv/bin/python -m pytest tests/test_checkpoint.py
"""
import os
import re
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from conftest import MPIRUN, OPEN_MPI, REPO, flat_from_named, under_mpirun, write_flat_checkpoint
from hpctrain.run.cluster import child_env
from hpctrain import checkpoint as checkpoint_command
from hpctrain.checkpoints import file as checkpoint
from hpctrain.checkpoints import read_back as reader
from hpctrain.checkpoints.trust import Corrupt
from hpctrain.base.errors import EXIT_PREEMPTED, HpctrainError

SETTINGS = {"mode": "ring", "hidden": "8", "num_params": 16, "optimizer": "adam",
            "batch_size": 4, "seed": 0}


def write(directory, step, n=16, settings=None, seed=None):
    """An old flat checkpoint of step `step`: (path, params, state, positions)."""
    rng = np.random.default_rng(step if seed is None else seed)
    params = rng.standard_normal(n).astype(np.float32)
    state = {"m": rng.standard_normal(n).astype(np.float32), "v": rng.random(n).astype(np.float32)}
    positions = np.array([[step // 10, 4 * step % 40], [step // 10, 8]], np.int64)
    path = write_flat_checkpoint(directory, step, params, state, positions,
                                 {"world_size": 2, "num_workers": 2, "lr": 1e-4, **(settings or SETTINGS)})
    return path, params, state, positions


def load(directory, settings=None):
    warnings = []
    ckpt = reader.load_latest(directory, settings or SETTINGS, warn=warnings.append)
    return ckpt, warnings


# ---------------------------------------------------------------------------
# the file format

def test_round_trip_keeps_every_bit_and_attribute(tmp_path):
    path, params, state, positions = write(tmp_path, 123)
    assert os.path.basename(path) == "ckpt-00000123.h5"
    ckpt, warnings = load(tmp_path)
    assert warnings == [] and ckpt.step == 123 and ckpt.optimizer_t == 123 and ckpt.path == path
    assert ckpt.params.dtype == np.float32 and np.array_equal(ckpt.params, params)
    assert set(ckpt.optimizer_state) == {"m", "v"}
    assert all(np.array_equal(ckpt.optimizer_state[k], state[k]) for k in state)
    assert ckpt.data_positions.dtype == np.int64 and np.array_equal(ckpt.data_positions, positions)
    with h5py.File(path, "r") as f:
        assert set(f) == {"params", "optimizer", "data_positions"} and set(f["optimizer"]) == {"m", "v"}
        for key in ("step", "optimizer_t", "mode", "world_size", "num_workers", "hidden", "optimizer",
                    "format_version", "sha256"):
            assert key in f.attrs, key
        assert f["params"].dtype == np.float32 and f["data_positions"].shape == (2, 2)


def named_write(directory, step):
    """A one-tensor checkpoint folder written by this process alone (checkpoints/named.py)."""
    from mpi4py import MPI
    from hpctrain.checkpoints import named
    w = np.arange(16, dtype=np.float32)
    return named.write_checkpoint(directory, step, MPI.COMM_SELF, 0, [("w", ((0, 16),), w)],
                                  {"w": ((16,), "<f4", [])}, {}, small={"data_positions": np.zeros((1, 2), np.int64)})


def test_a_checkpoint_write_is_atomic_and_durable(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    path = named_write(tmp_path, 10)
    # the rank file and the index under the temporary folder, the folder, then the directory after the rename
    tmp = os.path.dirname(synced[0])
    assert os.path.basename(tmp).startswith(".ckpt-00000010.tmp-"), synced
    assert synced == [os.path.join(tmp, "rank-00000.h5"), os.path.join(tmp, "index.h5"), tmp, str(tmp_path)]
    assert os.listdir(tmp_path) == ["ckpt-00000010"] and path == str(tmp_path / "ckpt-00000010")


def a_dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_stale_temporary_files_are_swept_at_start_up_and_live_ones_kept(tmp_path):
    from argparse import Namespace
    from hpctrain.run import outputs
    from hpctrain.base.files import STALE_AFTER_S
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    ckpt.mkdir()
    out.mkdir()
    running = subprocess.Popen(["sleep", "60"])   # a running job's writer
    dead, alive = a_dead_pid(), running.pid
    stale = [ckpt / f".ckpt-00000015.h5.tmp-{dead}",              # older versions: pid only
             ckpt / f".ckpt-00000020.h5.tmp-{dead}-abc_1234",     # this version: pid and random
             out / f".p.h5.tmp-{dead}-x1y2z3w4",
             out / "m.jsonl.tmp-{}".format(dead),                  # the old metrics file
             out / "t.json.tmp-{}".format(dead),                   # the timeline's
             out / ".p.h5.tmp-q9r8s7t6"]                           # old --save: no pid, an hour untouched
    kept = [ckpt / f".ckpt-00000030.h5.tmp-{alive}-abcdefgh",     # a running writer's
            out / f".p.h5.tmp-{alive}-abcdefgh",
            out / ".p.h5.tmp-recent00",                            # no pid, recent
            out / f".other.h5.tmp-{dead}-abcdefgh",                # not one of this run's outputs
            out / "notes.txt", ckpt / "ckpt-00000010.h5"]
    hour_ago = time.time() - 2 * STALE_AFTER_S
    for path in stale + kept:
        path.write_bytes(b"half")
        if path.name != ".p.h5.tmp-recent00":
            os.utime(path, (hour_ago, hour_ago))
    os.utime(out / ".p.h5.tmp-recent00", (time.time() - 60, time.time() - 60))
    args = Namespace(save=str(out / "p.h5"), metrics=str(out / "m.jsonl"), timeline=str(out / "t.json"),
                     checkpoint_dir=str(ckpt))
    outputs.check_outputs(args)
    assert all(not p.exists() for p in stale), [p.name for p in stale if p.exists()]
    assert all(p.exists() for p in kept), [p.name for p in kept if not p.exists()]
    # A file written after this process started is never touched, whatever its pid.
    fresh = out / f".p.h5.tmp-{dead}-fresh000"
    fresh.write_bytes(b"")
    assert outputs.sweep_stale_temporaries(args) == [] and fresh.exists()
    # Once its writer is gone, the running job's file is a leftover too.
    running.kill()
    running.wait()
    assert sorted(outputs.sweep_stale_temporaries(args)) == [str(ckpt / f".ckpt-00000030.h5.tmp-{alive}-abcdefgh"),
                                                             str(out / f".p.h5.tmp-{alive}-abcdefgh")]


def test_temporary_names_are_exclusive_unpredictable_and_carry_the_pid(tmp_path):
    from hpctrain.base import files
    names = set()
    for _ in range(3):
        tmp = files.temp_name_next_to(tmp_path / "p.h5")
        os.close(files.create_new(tmp))
        umask = os.umask(0o022)
        os.umask(umask)
        assert os.path.dirname(tmp) == str(tmp_path) and os.stat(tmp).st_mode & 0o777 == 0o666 & ~umask
        assert re.fullmatch(rf"\.p\.h5\.tmp-{os.getpid()}-[a-z0-9_]{{8}}", os.path.basename(tmp)), tmp
        names.add(tmp)
    assert len(names) == 3


def interrupted_at_call(after, directory):
    """A profile hook that raises KeyboardInterrupt at the `after`-th Python
    function start once a temporary exists in directory: where a real
    Ctrl-C lands (CPython runs signal handlers as a function starts)."""
    seen = [0]

    def hook(frame, event, arg):
        if event == "call" and any(".tmp-" in n for n in os.listdir(directory)):
            seen[0] += 1
            if seen[0] == after:
                sys.setprofile(None)
                raise KeyboardInterrupt
    return hook


@pytest.mark.parametrize("after", [1, 2, 3, 5, 8, 13, 40, 120])
def test_ctrl_c_anywhere_in_a_checkpoint_write_leaves_no_temporary(tmp_path, after):
    # CI once found a .ckpt-*.h5.tmp-* after Ctrl-C: the interrupt landed
    # inside mkstemp (after it made the file, before its caller held the name).
    sys.setprofile(interrupted_at_call(after, tmp_path))
    try:
        with pytest.raises(KeyboardInterrupt):
            named_write(tmp_path, 10)
    finally:
        sys.setprofile(None)
    assert os.listdir(tmp_path) == []


def test_a_file_whose_name_lies_about_its_step_is_skipped_and_never_pins_pruning(tmp_path):
    # A copy of step 10 named far above every real step: before, resume took
    # it (newest by name) and pruning kept it while deleting the real newest.
    old, params10, _, _ = write(tmp_path, 10)
    liar = tmp_path / "ckpt-99999999.h5"
    liar.write_bytes(open(old, "rb").read())
    _, params20, _, _ = write(tmp_path, 20)
    checkpoint._prune(tmp_path, 2, mine=str(tmp_path / "ckpt-00000020.h5"))
    ckpt, warnings = load(tmp_path)
    assert ckpt.step == 20 and np.array_equal(ckpt.params, params20)
    assert warnings == ["ckpt-99999999.h5: its name says step 99999999 but it holds step 10 (a renamed "
                        "copy?), skipped; trying the previous one"]
    # Pruning keeps the newest 2 up to the one just written; the lying name is
    # neither counted nor removed (resume reports it every time).
    checkpoint._prune(tmp_path, 2, mine=write(tmp_path, 30)[0])
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000020.h5", "ckpt-00000030.h5", "ckpt-99999999.h5"]
    # A name below its content is a liar too: skipped for the real previous one.
    (tmp_path / "ckpt-00000030.h5").rename(tmp_path / "ckpt-00000025.h5")
    ckpt, warnings = load(tmp_path)
    assert ckpt.step == 20 and len(warnings) == 2
    assert warnings[1].startswith("ckpt-00000025.h5: its name says step 25 but it holds step 30 ")
    assert checkpoint_command.main([str(tmp_path)]) == 1


def test_truncated_newest_falls_back_to_the_previous_one_with_a_warning(tmp_path):
    write(tmp_path, 10)
    _, params20, _, _ = write(tmp_path, 20)
    newest = tmp_path / "ckpt-00000030.h5"
    write(tmp_path, 30)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    ckpt, warnings = load(tmp_path)
    assert ckpt.step == 20 and np.array_equal(ckpt.params, params20)
    assert len(warnings) == 1
    assert warnings[0].startswith("ckpt-00000030.h5: corrupt (") and warnings[0].endswith(
        "), trying the previous one")


def test_the_header_hash_catches_any_flipped_byte_before_hdf5_reads_it(tmp_path):
    # (Some flips in HDF5's metadata crash the HDF5 library itself: no file
    # reaches h5py unless every byte matches the header's hash.)
    path, _, _, _ = write(tmp_path, 10)
    good = open(path, "rb").read()
    for at in range(0, len(good), 97):
        bad = bytearray(good)
        bad[at] ^= 0x10
        with open(path, "wb") as f:
            f.write(bad)
        ckpt, warnings = load(tmp_path)
        assert ckpt is None and len(warnings) == 1, at
        assert "checksum mismatch" in warnings[0] or "header" in warnings[0], (at, warnings)


def test_a_lazy_read_checks_the_header_a_block_at_a_time(tmp_path):
    path, params, state, _ = write(tmp_path, 10)
    ckpt = reader.read(path, lazy=True)
    assert np.array_equal(ckpt.params.read(0, 16), params) and np.array_equal(ckpt.optimizer_state["v"].read(3, 9),
                                                                               state["v"][3:9])
    ckpt.close()
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(Corrupt, match="^checksum mismatch$"):
        reader.read(path, lazy=True)


def test_checksum_catches_a_flipped_bit_on_disk(tmp_path):
    write(tmp_path, 10)
    path, _, _, _ = write(tmp_path, 20)
    with h5py.File(path, "r") as f:
        offset = f["optimizer/v"].id.get_offset()  # contiguous dataset: its bytes in the file
    with open(path, "r+b") as f:
        f.seek(offset + 5)
        byte = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([byte[0] ^ 0x01]))
    ckpt, warnings = load(tmp_path)
    assert ckpt.step == 10
    assert warnings == ["ckpt-00000020.h5: corrupt (checksum mismatch), trying the previous one"]


def test_an_edited_file_fails_its_header_hash(tmp_path):
    write(tmp_path, 10)
    path, _, _, _ = write(tmp_path, 20)
    with h5py.File(path, "r+") as f:
        assert f.userblock_size == checkpoint.USERBLOCK
        f["params"][0] = 1.5
    ckpt, warnings = load(tmp_path)
    assert ckpt.step == 10
    assert warnings == ["ckpt-00000020.h5: corrupt (checksum mismatch), trying the previous one"]


@pytest.mark.parametrize("damage, reason", [
    (lambda f: f.attrs.__setitem__("step", 21), "content checksum mismatch"),
    (lambda f: f["params"].__setitem__(0, 1.5), "content checksum mismatch"),
    (lambda f: f.attrs.__delitem__("sha256"), "no content checksum"),
    (lambda f: f["optimizer"].__delitem__("v"), "missing dataset optimizer/v"),
    (lambda f: f.__delitem__("data_positions"), "missing dataset data_positions"),
])
def test_files_with_a_valid_header_but_wrong_content_are_skipped(tmp_path, damage, reason):
    # A file edited and then given a fresh header (as a buggy writer would):
    # the content checksum and the structure checks still catch it.
    write(tmp_path, 10)
    path, _, _, _ = write(tmp_path, 20)
    with h5py.File(path, "r+") as f:
        damage(f)
    checkpoint.stamp(path)
    ckpt, warnings = load(tmp_path)
    assert ckpt.step == 10 and warnings == [f"ckpt-00000020.h5: corrupt ({reason}), trying the previous one"]


def test_the_reader_refuses_a_precision_it_does_not_run(tmp_path):
    # A flat file of float64 datasets, its content hash over them: this code
    # runs float32 only, so the reader refuses the file in one line rather
    # than convert it (a resume promises the same bits).
    rng = np.random.default_rng(0)
    params = rng.standard_normal(16)
    state = {"m": rng.standard_normal(16), "v": rng.random(16)}
    write(tmp_path, 10)
    write_flat_checkpoint(tmp_path, 20, params, state, np.zeros((2, 2), np.int64), SETTINGS, model_state=np.ones(3))
    ckpt, warnings = load(tmp_path)
    assert ckpt.step == 10 and warnings == [
        "ckpt-00000020.h5: corrupt (dataset params is float64 (16,), expected float32 with 1 dimension(s)), "
        "trying the previous one"]


def test_a_checkpoint_of_another_format_version_is_a_clear_error(tmp_path):
    path, _, _, _ = write(tmp_path, 10)
    raw = open(path, "rb").read()
    # Version 1 (data positions were offsets into each worker's own part).
    h = checkpoint._hasher(1)
    h.update(raw[checkpoint.USERBLOCK:])
    with open(path, "r+b") as f:
        f.write(checkpoint._header(1, h.hexdigest()))
    with pytest.raises(HpctrainError, match=r"ckpt-00000010.h5: checkpoint format version 1, this hpctrain "
                                            r"reads version 2"):
        load(tmp_path)


def test_nothing_to_resume(tmp_path):
    assert load(tmp_path / "absent") == (None, [])
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert load(tmp_path) == (None, [])
    (tmp_path / "ckpt-00000010.h5").write_bytes(b"")
    ckpt, warnings = load(tmp_path)
    assert warnings == ["ckpt-00000010.h5: corrupt (truncated (0 bytes)), trying the previous one"]
    assert ckpt is None


@pytest.mark.parametrize("key, value, have, want", [
    ("hidden", "16", "--hidden 8", "--hidden 16"), ("optimizer", "sgd", "--optimizer adam", "--optimizer sgd"),
    ("mode", "ps", "--mode ring", "--mode ps"),
    ("batch_size", 8, "--batch-size 4", "--batch-size 8"), ("seed", 1, "--seed 0", "--seed 1"),
])
def test_a_checkpoint_of_another_job_is_a_clear_error(tmp_path, key, value, have, want):
    write(tmp_path, 10)
    write(tmp_path, 20)
    with pytest.raises(HpctrainError) as e:
        load(tmp_path, {**SETTINGS, key: value})
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'ckpt-00000020.h5'}: checkpoint was written with {have}, "
                              f"this run has {want}; "), message
    assert "\n" not in message


def _external_params(tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(16, dtype="<f4").tobytes())

    def edit(f):
        del f["params"]
        f.create_dataset("params", shape=(16,), dtype="<f4", external=[(str(secret), 0, 64)])
    return edit


def _linked_params(link):
    def edit(f):
        f["real"] = f["params"][()]
        del f["params"]
        f["params"] = link(f)
    return edit


def _other_file(tmp_path):
    with h5py.File(tmp_path / "other.h5", "w") as g:
        g["params"] = np.zeros(16, np.float32)
    return h5py.ExternalLink(str(tmp_path / "other.h5"), "/params")


@pytest.mark.parametrize("craft, reason", [
    (lambda tmp: lambda f: f["data_positions"].__setitem__((0, 0), 2 ** 63 - 1),
     "a data position's epoch 9223372036854775807 is out of range (0..9007199254740992)"),
    (lambda tmp: lambda f: f["data_positions"].__setitem__((1, 1), -3),
     "a data position -3 is out of range (0..9007199254740992)"),
    (lambda tmp: lambda f: f.attrs.__setitem__("optimizer_t", -1), "optimizer_t -1 is out of range"),
    (lambda tmp: lambda f: f.attrs.__setitem__("step", -20), "step -20 is out of range"),
    (lambda tmp: lambda f: f.attrs.__setitem__("num_workers", 5), "num_workers 5 is out of range (2..2)"),
    (lambda tmp: lambda f: f.attrs.__setitem__("lr", np.arange(3.0)), "attribute lr is a ndarray"),
    (lambda tmp: lambda f: f.attrs.__setitem__("lr", np.nan), "attribute lr is nan"),
    (_external_params, "dataset params is not stored contiguously in the file (chunked, virtual or external"),
    (lambda tmp: _linked_params(lambda f: h5py.SoftLink("/real")), "params is a soft link, not a dataset stored"),
    (lambda tmp: _linked_params(lambda f: _other_file(tmp)), "params is an external link, not a dataset stored"),
])
def test_a_crafted_checkpoint_with_valid_checksums_is_refused_in_one_line(tmp_path, craft, reason):
    # Each used to go on: an epoch of 2**63-1 until an OverflowError at the
    # last checkpoint, a negative optimizer_t to a math domain error, external
    # storage and links to read whatever file they name.
    write(tmp_path, 10)
    path, _, _, _ = write(tmp_path, 20)
    recheck(path, craft(tmp_path))
    with pytest.raises(HpctrainError) as e:
        load(tmp_path)
    message = str(e.value)
    assert message.startswith(f"{path}: refused: {reason}") and "\n" not in message, message
    assert message.endswith("; hpctrain writes no such checkpoint (a crafted file?): move it away to resume "
                            "from an earlier one"), message


def test_a_small_file_claiming_a_huge_params_is_refused_before_it_is_read(tmp_path):
    # 10**9 chunked float32 in a file of a few KB (unwritten chunks read as
    # zeros): reading it allocated 4 GB. Refused by its layout, unread: the
    # reader runs under a 2 GiB address-space limit.
    write(tmp_path, 10)
    path, _, _, _ = write(tmp_path, 20)
    with h5py.File(path, "r+") as f:
        del f["params"]
        f.create_dataset("params", shape=(10 ** 9,), dtype="<f4", chunks=(1 << 20,))
    checkpoint.stamp(path)
    assert os.path.getsize(path) < 100_000
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)); "
            "from hpctrain.checkpoints import read_back as reader; from hpctrain.base.errors import HpctrainError\n"
            "try:\n    reader.load_latest(sys.argv[1], {})\n"
            "except HpctrainError as e:\n    print(e)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                       cwd=REPO)
    assert r.returncode == 0 and r.stdout.startswith(
        f"{path}: refused: dataset params is not stored contiguously in the file (chunked"), (r.stdout, r.stderr)


def test_the_chief_closes_the_checkpoint_it_resumed_from_once_restored(tmp_path):
    # Ring mode kept the chief's checkpoint (a folder's index, a lazily read
    # flat file) open for the whole run; every loop resumes through
    # Frame.resumed, which closes it after the loop's restore, failed or not.
    from types import SimpleNamespace
    from hpctrain.loops.frame import Frame
    path, params, _, positions = write(tmp_path, 10)
    for fails in (False, True):
        ckpt = reader.read(path, lazy=True)
        assert ckpt.source is not None
        said = []
        frame = SimpleNamespace(resume=SimpleNamespace(checkpoint=ckpt, held=None), steps=20,
                                checkpoints=SimpleNamespace(seek_readers=lambda reader, resume: None,
                                                            resumed_line=lambda resume, steps: "resumed",
                                                            saved_step=10),
                                world=SimpleNamespace(say=said.append),
                                report=SimpleNamespace(resume_at=lambda step, resume: None))

        def restore(resume):
            assert np.array_equal(resume.checkpoint.params.read(0, 16), params)   # open while restoring
            if fails:
                raise HpctrainError("a rank could not restore")
        if fails:
            with pytest.raises(HpctrainError):
                Frame.resumed(frame, None, restore)
        else:
            Frame.resumed(frame, None, restore)
            assert said == ["resumed"]
        assert ckpt.source is None and np.array_equal(ckpt.data_positions, positions)


# ---------------------------------------------------------------------------
# real jobs

needs_own_jobs = pytest.mark.skipif(under_mpirun(), reason="launches its own mpirun jobs: runs in the plain pytest pass")
SMALL = ["--hidden", "64", "--log-every", "1000"]


def run(n, *args, timeout=120):
    cmd = [MPIRUN, "-n", str(n), sys.executable, "-m", "hpctrain.mnist", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env(), cwd=REPO)


def errors(r):
    return [line for line in r.stderr.splitlines() if line.startswith("hpctrain: error:")]


def run_and_signal(n, sig, ckpt_dir, after_step, *args, timeout=120):
    """Start a job, and once it has written a checkpoint past `after_step`,
    send `sig` to mpirun (MPICH's hydra forwards SIGTERM/SIGUSR1 to every rank).
    The ranks wait for the signal after that checkpoint (tests/held_for_signals.py):
    they stop after the step that follows it, at any speed."""
    cmd = [MPIRUN, "-n", str(n), sys.executable, "-m", "held_for_signals", *map(str, args)]
    env = child_env()
    env.update(PYTHONPATH=os.path.dirname(os.path.abspath(__file__)), HELD_AFTER_STEP=str(after_step))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    deadline = time.monotonic() + timeout
    try:
        while p.poll() is None and time.monotonic() < deadline:
            steps = [s for s, _ in checkpoint.list_checkpoints(ckpt_dir)]
            if steps and steps[0] > after_step:
                p.send_signal(sig)
                break
            time.sleep(0.005)
        out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def saved(path):
    with h5py.File(path, "r") as f:
        return {f"{g}/{k}": f[g][k][()] for g in f for k in f[g]}, dict(f.attrs)


def assert_bit_identical(a_path, b_path):
    a, a_attrs = saved(a_path)
    b, b_attrs = saved(b_path)
    assert set(a) == set(b) and a
    for key in a:
        assert a[key].tobytes() == b[key].tobytes(), f"{key} differs"
    assert a_attrs["step"] == b_attrs["step"]


@needs_own_jobs
@pytest.mark.parametrize("zero", [[], ["--zero", "2", "--fusion-mb", "0.01"], ["--zero", "3", "--fusion-mb", "0.01"],
                                  ["--tensor-parallel", "2"]],
                         ids=["zero-auto", "zero-2", "zero-3", "tensor-2"])
def test_ring_run_stopped_by_signals_and_resumed_ends_bit_identical(tmp_path, zero):
    # Rank 0 waits for each signal after the checkpoint the test sends it at
    # (run_and_signal), so the runs stop after steps 11 and 21 at any speed:
    # 60 steps, not 1500-3000 of margin for a signal that landed anywhere
    # (the steps were most of the test's time). The last run writes the
    # checkpoints of steps 30 to 60. --zero 2 with small buckets: every rank
    # stops after the same step there too.
    steps = 60
    every = 10
    common = ["--steps", steps, *SMALL, *zero]  # Adam, the default optimizer
    r = run(2, *common, "--save", tmp_path / "full.h5")
    assert r.returncode == 0, r.stderr

    ckpt_dir = tmp_path / "ckpt"
    resumable = [*common, "--checkpoint-dir", ckpt_dir, "--checkpoint-every", every, "--save", tmp_path / "resumed.h5"]
    stopped_at, stopped_path = 0, None
    # Open MPI's mpirun turns SIGTERM into killing the ranks; it relays USR1.
    for sig in (signal.SIGUSR1, signal.SIGUSR1) if OPEN_MPI else (signal.SIGTERM, signal.SIGUSR1):
        r = run_and_signal(2, sig, ckpt_dir, stopped_at, *resumable)
        assert r.returncode == EXIT_PREEMPTED, (r.returncode, r.stdout, r.stderr)
        lines = errors(r)
        assert len(lines) == 1, r.stderr  # from the chief only
        m = re.fullmatch(rf"hpctrain: error: stopped by {sig.name} after step (\d+); checkpoint (\S+); "
                         r"run the same command again to resume", lines[0])
        assert m, lines[0]
        step, path = int(m.group(1)), m.group(2)
        assert step == stopped_at // every * every + every + 1 and path == str(ckpt_dir / f"ckpt-{step:08d}")
        assert checkpoint.list_checkpoints(ckpt_dir)[0] == (step, path)
        if stopped_at:
            assert f"resumed from {stopped_path} at step {stopped_at}" in r.stdout
        assert not (tmp_path / "resumed.h5").exists()
        stopped_at, stopped_path = step, path

    r = run(2, *resumable)
    assert r.returncode == 0, r.stderr
    assert f"resumed from {stopped_path} at step {stopped_at}" in r.stdout
    assert_bit_identical(tmp_path / "full.h5", tmp_path / "resumed.h5")
    # the final checkpoint, and only the newest --keep-checkpoints (3)
    assert [s for s, _ in checkpoint.list_checkpoints(ckpt_dir)] == [steps, steps - every, steps - 2 * every]
    assert [n for n in os.listdir(ckpt_dir) if not n.startswith("ckpt-")] == []


@needs_own_jobs
def test_an_old_flat_checkpoint_resumes_and_a_corrupt_newest_one_is_skipped(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    flags = ["--steps", 40, *SMALL, "--checkpoint-dir", ckpt_dir, "--checkpoint-every", 10]
    r = run(2, *flags, "--save", tmp_path / "first.h5")
    assert r.returncode == 0, r.stderr
    # as an hpctrain before issue 55 left them: flat files, one file to truncate
    for step in (30, 40):
        flat_from_named(ckpt_dir / f"ckpt-{step:08d}")
    newest = ckpt_dir / "ckpt-00000040.h5"
    newest.write_bytes(newest.read_bytes()[:1000])
    r = run(2, *flags, "--save", tmp_path / "again.h5")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("hpctrain: warning: ckpt-00000040.h5: corrupt (") == 1, r.stderr
    assert f"resumed from {ckpt_dir / 'ckpt-00000030.h5'} at step 30" in r.stdout
    assert_bit_identical(tmp_path / "first.h5", tmp_path / "again.h5")

    # a valid checkpoint of another model is an error, on every rank, in one line
    r = run(2, "--steps", 40, "--hidden", "32", "--checkpoint-dir", ckpt_dir, "--save", tmp_path / "x.h5")
    assert r.returncode == 2 and len(errors(r)) == 1, r.stderr
    assert "checkpoint was written with --hidden 64, this run has --hidden 32" in errors(r)[0]
    assert not (tmp_path / "x.h5").exists()

    # starting fresh over another run's checkpoints would mix the two
    r = run(2, *flags, "--resume", "no")
    assert r.returncode == 2 and len(errors(r)) == 1, r.stderr
    assert "--resume no, but" in errors(r)[0] and "(newest ckpt-00000040)" in errors(r)[0]


@needs_own_jobs
def test_resume_yes_without_a_checkpoint_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty"
    r = run(2, "--steps", 10, *SMALL, "--checkpoint-dir", empty, "--resume", "yes", "--save", tmp_path / "p.h5")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert errors(r) == [f"hpctrain: error: --resume yes, but --checkpoint-dir {empty} holds no checkpoint"]
    assert not (tmp_path / "p.h5").exists() and os.listdir(empty) == []


def recheck(path, edit):
    """Edit a checkpoint with h5py and make it valid again: its content
    checksum and its header recomputed the way checkpoint.py does."""
    with h5py.File(path, "r+") as f:
        edit(f)
        attrs = {k: reader._plain(v) for k, v in f.attrs.items()}
        names = ["params", "data_positions", *(f"optimizer/{n}" for n in f.get("optimizer", {}))]
        f.attrs["sha256"] = checkpoint._checksum({n: f[n][()] for n in names}, attrs)
    checkpoint.stamp(path)


@needs_own_jobs
def test_a_checkpoint_resumes_only_on_the_data_it_was_trained_on(tmp_path):
    # Other data (here: the same shards under a manifest that says another
    # seed, so another digest) was resumed at the checkpoint's step, exit 0.
    import json
    import shutil
    from hpctrain import data
    other = tmp_path / "other"
    shutil.copytree(data.default_data_dir(), other)
    manifest = json.loads((other / data.MANIFEST).read_text())
    (other / data.MANIFEST).write_text(json.dumps(dict(manifest, seed=99)))
    ckpt_dir = tmp_path / "ckpt"
    flags = ["--steps", 20, *SMALL, "--checkpoint-dir", ckpt_dir]
    r = run(2, *flags)
    assert r.returncode == 0, r.stderr
    flat_from_named(ckpt_dir / "ckpt-00000020")   # recheck edits a flat file
    r = run(2, *flags, "--data", other, "--steps", 30)
    assert r.returncode == 2 and len(errors(r)) == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert re.fullmatch(rf"hpctrain: error: {ckpt_dir / 'ckpt-00000020.h5'}: checkpoint was trained on other "
                        rf"data, {data.default_data_dir()} \(manifest digest [0-9a-f]{{16}}\); this run has "
                        rf"--data {other} \(manifest digest [0-9a-f]{{16}}\); resume on the same data, pass "
                        rf"--resume-other-data to go on .*", errors(r)[0]), errors(r)
    # Deliberately (fine-tuning): it goes on from the checkpoint, from the new data's first epoch.
    r = run(2, *flags, "--data", other, "--steps", 30, "--resume-other-data")
    assert r.returncode == 0 and f"resumed from {ckpt_dir / 'ckpt-00000020.h5'} at step 20" in r.stdout, r.stderr
    assert "hpctrain: warning: --resume-other-data: ckpt-00000020.h5 was trained on" in r.stderr, r.stderr
    with h5py.File(ckpt_dir / "ckpt-00000030" / "index.h5") as f:
        assert f.attrs["data"] == str(other) and f.attrs["samples"] == 10 * 2 * 32
    flat_from_named(ckpt_dir / "ckpt-00000030")
    # A checkpoint from before checkpoints recorded their data still resumes, and says so.
    recheck(ckpt_dir / "ckpt-00000030.h5", lambda f: [f.attrs.__delitem__(k) for k in ("data", "data_digest")])
    r = run(2, *flags, "--steps", 40)
    assert r.returncode == 0 and "at step 30" in r.stdout, r.stderr
    assert ("hpctrain: warning: ckpt-00000030.h5 does not record the data it was trained on (written by an "
            "earlier hpctrain): resuming on --data") in r.stderr, r.stderr


@needs_own_jobs
def test_a_crafted_checkpoint_stops_the_job_in_one_line(tmp_path):
    # An epoch of 2**63-1 with valid checksums trained to the end and failed
    # at the last checkpoint (OverflowError, exit 1).
    ckpt_dir = tmp_path / "ckpt"
    flags = [*SMALL, "--checkpoint-dir", ckpt_dir]
    r = run(2, "--steps", 10, *flags)
    assert r.returncode == 0, r.stderr
    path = flat_from_named(ckpt_dir / "ckpt-00000010")   # recheck edits a flat file
    recheck(path, lambda f: f["data_positions"].__setitem__((0, 0), 2 ** 63 - 1))
    r = run(2, "--steps", 100, *flags, "--save", tmp_path / "p.h5")   # past the end of that epoch
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"hpctrain: error: {path}: refused: a data position's epoch 9223372036854775807 is out of range "
        f"(0..9007199254740992); hpctrain writes no such checkpoint (a crafted file?): move it away to resume "
        f"from an earlier one"], r.stderr
    assert "step " not in r.stdout and not (tmp_path / "p.h5").exists()
