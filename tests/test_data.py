"""Tests for hpctrain.data: IDX reading, shard preparation, per-worker reading, fetch.

Serial, no MPI, real files only (small IDX files written here in the real
format, the bundled MNIST sample, a local HTTP server for fetch):

    .venv/bin/python -m pytest tests/test_data.py
"""

import functools
import gzip
import hashlib
import http.server
import importlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hpctrain import data
from hpctrain.base.errors import HpctrainError

# The module, not the function of the same name that hpctrain.data re-exports
# (`import hpctrain.data.prepare as m` would bind the function).
prepare_mod = importlib.import_module("hpctrain.data.prepare")

REPO = Path(__file__).resolve().parent.parent


def write_idx(path, array, gz=None):
    """IDX as LeCun's page specifies it, written independently of the module."""
    array = np.asarray(array, dtype=np.uint8)
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.tobytes()
    gz = str(path).endswith(".gz") if gz is None else gz
    Path(path).write_bytes(gzip.compress(payload) if gz else payload)
    return path


def numbered_images(n, start=0):
    """n 28x28 images whose first two pixels spell their number: traceable samples."""
    images = np.zeros((n, 28, 28), np.uint8)
    ids = np.arange(start, start + n)
    images[:, 0, 0], images[:, 0, 1] = ids // 256, ids % 256
    images[:, 5:20, 5:20] = (ids % 251)[:, None, None]
    return images


def sample_ids(images):
    images = images.reshape(len(images), -1)
    return images[:, 0].astype(np.int64) * 256 + images[:, 1]


def make_single_source(dirpath, n=1000, classes=10):
    """A label-sorted images/labels pair, like the bundled sample."""
    dirpath.mkdir(parents=True, exist_ok=True)
    write_idx(dirpath / "images-idx3-ubyte.gz", numbered_images(n))
    write_idx(dirpath / "labels-idx1-ubyte.gz", np.repeat(np.arange(classes), n // classes))
    return dirpath


def quiet(*args):
    pass


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    out = tmp_path_factory.mktemp("bundled") / "shards"
    manifest = data.prepare(data.bundled_sample_dir(), out, log=quiet)
    return out, manifest


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    """1000 traceable samples: 900 train in 8 shards, 100 test."""
    base = tmp_path_factory.mktemp("numbered")
    source = make_single_source(base / "src")
    out = base / "shards"
    data.prepare(source, out, shards=8, test_fraction=0.1, seed=3, log=quiet)
    return out


def train_ids(out):
    """The ids of every training sample, read straight from the shard files."""
    import h5py
    manifest = json.loads((out / "manifest.json").read_text())
    ids = []
    for entry in manifest["train"]["shards"]:
        with h5py.File(out / entry["file"], "r") as f:
            ids.append(sample_ids(f["images"][:]))
    return np.concatenate(ids)


# ---------------------------------------------------------------------------
# read_idx

@pytest.mark.parametrize("name", ["x-images-idx3-ubyte", "x-images-idx3-ubyte.gz"])
def test_read_idx_raw_and_gzip(tmp_path, name):
    images = numbered_images(7)
    labels = np.arange(7, dtype=np.uint8)
    got = data.read_idx(write_idx(tmp_path / name, images))
    assert got.dtype == np.uint8 and got.shape == (7, 28, 28)
    np.testing.assert_array_equal(got, images)
    np.testing.assert_array_equal(data.read_idx(write_idx(tmp_path / "l.gz", labels)), labels)


def test_read_idx_detects_gzip_by_content_not_name(tmp_path):
    images = numbered_images(3)
    path = write_idx(tmp_path / "misnamed", images, gz=True)
    np.testing.assert_array_equal(data.read_idx(path), images)
    path = write_idx(tmp_path / "misnamed.gz", images, gz=False)
    np.testing.assert_array_equal(data.read_idx(path), images)


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_from_a_fifo(tmp_path, gz):
    # A FIFO cannot seek back over the two bytes that tell gzip from raw; before,
    # that was an uncaught OSError ("Illegal seek").
    labels = np.arange(300) % 10
    payload = write_idx(tmp_path / "l.idx", labels, gz=gz).read_bytes()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_bytes, args=(payload,), daemon=True)
    writer.start()
    np.testing.assert_array_equal(data.read_idx(fifo, "labels"), labels)
    writer.join(timeout=10)


def test_read_idx_bundled_sample():
    images = data.read_idx(data.bundled_sample_dir() / "images-idx3-ubyte.gz", "images")
    labels = data.read_idx(data.bundled_sample_dir() / "labels-idx1-ubyte.gz", "labels")
    assert images.shape == (5000, 28, 28) and labels.shape == (5000,)
    assert np.bincount(labels).tolist() == [500] * 10


def test_read_idx_wrong_magic(tmp_path):
    path = tmp_path / "images.gz"
    path.write_bytes(gzip.compress(b"\0" * 100))
    with pytest.raises(HpctrainError) as e:
        data.read_idx(path, "images")
    assert str(e.value) == (f"{path}: not an IDX image file (magic 0x00000000, "
                            f"expected 0x00000803)")
    labels = write_idx(tmp_path / "labels", np.zeros(3))
    with pytest.raises(HpctrainError, match="not an IDX image file .*0x00000801"):
        data.read_idx(labels, "images")
    text = tmp_path / "notes.txt"
    text.write_text("hello, world\n")
    with pytest.raises(HpctrainError, match="notes.txt: not an IDX file"):
        data.read_idx(text)


def test_read_idx_unsupported_dtype(tmp_path):
    path = tmp_path / "floats"
    path.write_bytes(struct.pack(">BBBBI", 0, 0, 0x0D, 1, 2) + b"\0" * 8)
    with pytest.raises(HpctrainError, match="unsupported IDX data type 0x0d"):
        data.read_idx(path)


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_truncated(tmp_path, gz):
    full = struct.pack(">BBBBIII", 0, 0, 8, 3, 10, 28, 28) + bytes(10 * 784)
    cut = full[:-100]
    path = tmp_path / "images"
    path.write_bytes(gzip.compress(cut) if gz else cut)
    with pytest.raises(HpctrainError, match=r"truncated \(header says 10x28x28 = 7840 data "
                                            r"bytes, file has 7740\)"):
        data.read_idx(path)
    path.write_bytes(full[:9])
    with pytest.raises(HpctrainError, match="truncated IDX header"):
        data.read_idx(path)


def test_read_idx_trailing_garbage(tmp_path):
    path = tmp_path / "labels"
    path.write_bytes(struct.pack(">BBBBI", 0, 0, 8, 1, 3) + b"\1\2\3\4")
    with pytest.raises(HpctrainError, match="more data than its header"):
        data.read_idx(path)


def test_read_idx_corrupt_gzip(tmp_path):
    blob = gzip.compress(struct.pack(">BBBBIII", 0, 0, 8, 3, 50, 28, 28) +
                         numbered_images(50).tobytes())
    cut = tmp_path / "cut.gz"
    cut.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(HpctrainError, match="cut.gz: corrupt gzip data"):
        data.read_idx(cut)
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0xFF
    bad = tmp_path / "flipped.gz"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(HpctrainError, match="flipped.gz: "):
        data.read_idx(bad)


def test_read_idx_missing_file(tmp_path):
    with pytest.raises(HpctrainError, match="nothing.gz: no such file"):
        data.read_idx(tmp_path / "nothing.gz")


def read_idx_peak(path, kind=None):
    """read_idx's HpctrainError and the peak Python/NumPy memory it took."""
    import tracemalloc
    tracemalloc.start()
    try:
        with pytest.raises(HpctrainError) as e:
            data.read_idx(path, kind)
        return str(e.value), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_lying_header_is_refused_before_allocating(tmp_path, gz):
    # 80 million images claimed (62.7 GB), ten present: one line, a few MB at most.
    lie = struct.pack(">BBBBIII", 0, 0, 8, 3, 80_000_000, 28, 28) + numbered_images(10).tobytes()
    path = tmp_path / ("images.gz" if gz else "images")
    path.write_bytes(gzip.compress(lie) if gz else lie)
    message, peak = read_idx_peak(path, "images")
    if gz:
        size = path.stat().st_size
        assert message == (f"{path}: corrupt IDX header (claims 80000000x28x28 = 62720000000 "
                           f"data bytes; {size} bytes of gzip hold at most {size * 1032})")
    else:
        assert message == (f"{path}: truncated (header says 80000000x28x28 = 62720000000 data "
                           f"bytes, file has 7840)")
    assert peak < 4 << 20, peak


def test_read_idx_gzip_grows_with_the_data_not_the_header(tmp_path):
    # Incompressible data, so the claim passes the compression-ratio bound:
    # the reader must find the lie by reading, holding no more than it read.
    payload = np.random.default_rng(0).integers(0, 256, 200_000, dtype=np.uint8).tobytes()
    path = tmp_path / "labels.gz"
    path.write_bytes(gzip.compress(struct.pack(">BBBBI", 0, 0, 8, 1, 150_000_000) + payload))
    message, peak = read_idx_peak(path, "labels")
    assert message == (f"{path}: truncated (header says 150000000 = 150000000 data bytes, "
                       f"file has 200000)")
    assert peak < 8 << 20, peak


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_zero_or_too_many_dimensions(tmp_path, gz):
    cases = [(struct.pack(">BBBBIII", 0, 0, 8, 3, 10, 0, 28), "claims 10x0x28 elements; no "
                                                               "dimension may be 0"),
             (struct.pack(">BBBBI", 0, 0, 8, 1, 0), "claims 0 elements; no dimension may be 0"),
             (struct.pack(">BBBB5I", 0, 0, 8, 5, 1, 1, 1, 1, 1) + b"\1",
              "5 dimensions, hpctrain reads at most 4"),
             (struct.pack(">BBBB", 0, 0, 8, 255) + b"\1" * 1020,
              "255 dimensions, hpctrain reads at most 4")]
    for i, (blob, problem) in enumerate(cases):
        path = tmp_path / f"f{i}"
        path.write_bytes(gzip.compress(blob) if gz else blob)
        with pytest.raises(HpctrainError) as e:
            data.read_idx(path)
        assert str(e.value) == f"{path}: corrupt IDX header ({problem})"


@pytest.mark.parametrize("gz", [False, True])
def test_cli_lying_idx_header_is_one_line_exit_2(tmp_path, gz):
    src = tmp_path / "src"
    src.mkdir()
    lie = struct.pack(">BBBBIII", 0, 0, 8, 3, 80_000_000, 28, 28) + numbered_images(10).tobytes()
    images = src / ("images-idx3-ubyte.gz" if gz else "images-idx3-ubyte")
    images.write_bytes(gzip.compress(lie) if gz else lie)
    write_idx(src / "labels-idx1-ubyte", np.zeros(10))
    r = run_cli("prepare", "--source", src, "--out", tmp_path / "out")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"hpctrain: error: {images}: ") and r.stderr.count("\n") == 1
    assert "80000000x28x28" in r.stderr and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------
# prepare

def test_prepare_bundled_sample_is_class_balanced(bundled):
    out, manifest = bundled
    assert manifest["train"]["num_samples"] == 4500
    assert manifest["test"]["num_samples"] == 500
    assert manifest["test"]["per_class"] == {str(c): 50 for c in range(10)}
    assert manifest["train"]["per_class"] == {str(c): 450 for c in range(10)}
    shards = manifest["train"]["shards"]
    assert [s["file"] for s in shards] == [f"train-{i:05d}-of-00008.h5" for i in range(8)]
    sizes = [s["num_samples"] for s in shards]
    assert sum(sizes) == 4500 and max(sizes) - min(sizes) <= 1
    for c in map(str, range(10)):
        counts = [s["per_class"][c] for s in shards]
        assert min(counts) >= 1 and max(counts) - min(counts) <= 1, (c, counts)

    import h5py
    for s in shards + manifest["test"]["shards"]:
        with h5py.File(out / s["file"], "r") as f:
            images, labels = f["images"], f["labels"]
            assert images.dtype == np.uint8 and images.shape == (s["num_samples"], 28, 28)
            assert labels.dtype == np.uint8 and labels.shape == (s["num_samples"],)
            assert images.chunks is not None and images.compression == "gzip"
            counts = np.bincount(labels[:], minlength=10)
            assert {str(c): int(n) for c, n in enumerate(counts)} == s["per_class"]
            # The source is sorted by label; a shard must not be.
            assert (np.diff(labels[:].astype(int)) != 0).sum() > len(labels) // 3


def test_prepare_manifest_contents(bundled):
    out, manifest = bundled
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == manifest
    assert manifest["format"] == "hpctrain-shards" and manifest["version"] == 1
    assert manifest["seed"] == 0 and manifest["test_fraction"] == 0.1
    assert manifest["image_shape"] == [28, 28] and manifest["num_classes"] == 10
    files = {f["name"]: f for f in manifest["source"]["files"]}
    sample = data.bundled_sample_dir()
    for name in ("images-idx3-ubyte.gz", "labels-idx1-ubyte.gz"):
        raw = (sample / name).read_bytes()
        assert files[name]["sha256"] == hashlib.sha256(raw).hexdigest()
        assert files[name]["bytes"] == len(raw)
    assert files["images-idx3-ubyte.gz"]["sha256"] == (
        "35c4442b3738be6b58df4ff21f19341f0368e1c3d24840252fb3ff06ba646387")
    assert [s["file"] for s in manifest["test"]["shards"]] == ["test-00000-of-00001.h5"]
    for s in manifest["train"]["shards"] + manifest["test"]["shards"]:
        raw = (out / s["file"]).read_bytes()
        assert s["sha256"] == hashlib.sha256(raw).hexdigest() and s["bytes"] == len(raw)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["manifest.json"] + [s["file"] for s in manifest["train"]["shards"]] +
        ["test-00000-of-00001.h5"])
    assert data.is_prepared(out) and not data.is_prepared(out.parent)


def test_prepare_is_deterministic_and_disjoint(tmp_path, numbered):
    source = make_single_source(tmp_path / "src")
    again = data.prepare(source, tmp_path / "again", shards=8, seed=3, log=quiet)
    first = json.loads((numbered / "manifest.json").read_text())
    assert [s["sha256"] for s in again["train"]["shards"]] == [
        s["sha256"] for s in first["train"]["shards"]]
    ids = train_ids(numbered)
    x, _ = data.load_test(numbered)
    test = sample_ids((x * 255).round().astype(np.uint8))
    assert len(ids) == 900 and len(test) == 100
    assert sorted(np.concatenate([ids, test]).tolist()) == list(range(1000))


def test_prepare_standard_layout_keeps_its_split(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_idx(src / "train-images-idx3-ubyte.gz", numbered_images(60))
    write_idx(src / "train-labels-idx1-ubyte.gz", np.arange(60) % 3)
    write_idx(src / "t10k-images-idx3-ubyte", numbered_images(9, start=60))
    write_idx(src / "t10k-labels-idx1-ubyte", np.arange(9) % 3)
    manifest = data.prepare(src, tmp_path / "out", shards=4, test_fraction=0.5, log=quiet)
    assert manifest["source"]["layout"] == "standard" and manifest["test_fraction"] is None
    assert manifest["train"]["num_samples"] == 60 and manifest["test"]["num_samples"] == 9
    assert sorted(train_ids(tmp_path / "out").tolist()) == list(range(60))
    x, y = data.load_test(tmp_path / "out")
    assert sample_ids((x * 255).round().astype(np.uint8)).tolist() == list(range(60, 69))


def test_prepare_warns_of_empty_classes_below_the_largest_label(tmp_path):
    # One 12 among 0..9: a 13-class manifest with classes 10 and 11 empty, trained as
    # a 13-output model. Far more often a corrupt label than a real class: one line.
    src = tmp_path / "src"
    src.mkdir()
    labels = np.arange(100) % 10
    labels[37] = 12
    write_idx(src / "images-idx3-ubyte.gz", numbered_images(100))
    write_idx(src / "labels-idx1-ubyte.gz", labels)
    warned = []
    manifest = data.prepare(src, tmp_path / "out", shards=2, log=quiet, warn=warned.append)
    assert manifest["num_classes"] == 13
    line = (f"{src}: labels run to 12, but classes 10-11 have no sample and class 12 has 1: "
            f"a corrupt label? the model gets 13 outputs")
    assert warned == [line]
    warned.clear()
    data.prepare(make_single_source(tmp_path / "ok", n=100), tmp_path / "out2", shards=2, log=quiet,
                 warn=warned.append)
    assert warned == []
    r = run_cli("prepare", "--source", src, "--out", tmp_path / "out3", "--shards", 2)
    assert r.returncode == 0 and r.stderr.splitlines() == [f"hpctrain: warning: {line}"], r.stderr


def test_prepare_refuses_a_single_class(tmp_path):
    # Before: prepared as "1 classes", a model with one output (nothing to learn).
    src = make_single_source(tmp_path / "idx", n=100, classes=1)
    with pytest.raises(HpctrainError, match="every label is 0: one class is nothing to classify"):
        data.prepare(src, tmp_path / "out", shards=2, log=quiet)
    cifar = tmp_path / "cifar"
    cifar.mkdir()
    record = bytes([3]) + bytes(3072)   # label 3, a black 32x32x3 image
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        (cifar / name).write_bytes(record * 4)
    r = run_cli("prepare", "--source", cifar, "--out", tmp_path / "out", "--shards", 2)
    assert r.returncode == 2 and r.stderr == (
        f"hpctrain: error: {cifar}: every label is 3: one class is nothing to classify "
        f"(a wrong or damaged source?)\n")
    assert not (tmp_path / "out").exists()


def test_prepare_without_test_set(tmp_path):
    source = make_single_source(tmp_path / "src", n=100)
    manifest = data.prepare(source, tmp_path / "out", shards=3, test_fraction=0, log=quiet)
    assert manifest["train"]["num_samples"] == 100 and manifest["test"]["num_samples"] == 0
    x, y = data.load_test(tmp_path / "out", 1, 2)
    assert x.shape == (0, 784) and x.dtype == np.float32 and y.shape == (0,)


def test_prepare_refuses_existing_output_without_force(tmp_path):
    source = make_single_source(tmp_path / "src", n=100)
    out = tmp_path / "out"
    data.prepare(source, out, shards=2, log=quiet)
    (out / "stale.txt").write_text("from an older run")
    with pytest.raises(HpctrainError) as e:
        data.prepare(source, out, shards=4, log=quiet)
    assert str(e.value) == f"{out}: already exists (use --force to overwrite)"
    assert (out / "stale.txt").exists()
    manifest = data.prepare(source, out, shards=4, force=True, log=quiet)
    assert len(manifest["train"]["shards"]) == 4 and not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
    empty = tmp_path / "empty"
    empty.mkdir()
    data.prepare(source, empty, shards=2, log=quiet)
    assert data.is_prepared(empty)


def test_failed_prepare_leaves_nothing(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    write_idx(src / "images-idx3-ubyte.gz", numbered_images(20))
    write_idx(src / "labels-idx1-ubyte.gz", np.zeros(19))
    out = tmp_path / "out"
    with pytest.raises(HpctrainError, match="20 images but labels-idx1-ubyte.gz has 19 labels"):
        data.prepare(src, out, shards=2, log=quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]

    # A failure half-way through writing shards must not leave them either.
    good = make_single_source(tmp_path / "good", n=100)
    calls = []
    real = prepare_mod._write_shard

    def failing(path, *args):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(path, *args)

    monkeypatch.setattr(prepare_mod, "_write_shard", failing)
    with pytest.raises(HpctrainError, match="out: cannot write shards .*No space left"):
        data.prepare(good, out, shards=4, log=quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good", "src"]


def temporaries_beside(out):
    return [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp-")]


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 75), (signal.SIGHUP, 75), (signal.SIGINT, 130)])
def test_a_stopped_prepare_removes_its_temporary_folder(tmp_path, sig, code):
    # Before: SIGTERM's default action ended prepare with its .out.tmp-PID-XXXX folder left for ever;
    # then SIGHUP's (a closed terminal, a dropped ssh session) still did.
    rng = np.random.default_rng(0)
    # Random pixels compress slowly: writing the shards takes seconds, time to stop it half-way.
    np.save(tmp_path / "x.npy", rng.integers(0, 256, (30000, 28, 28), dtype=np.uint8))
    np.save(tmp_path / "y.npy", np.arange(30000) % 10)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "hpctrain.data", "prepare", "--images", tmp_path / "x.npy",
                             "--labels", tmp_path / "y.npy", "--out", out, "--shards", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not temporaries_beside(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert temporaries_beside(out) and proc.poll() is None, "prepare never began writing its shards"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert err == (f"hpctrain: error: prepare stopped by {sig.name}: nothing written (--out as it was, the "
                   f"temporary folder removed); run the same command again\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy", "y.npy"]


def test_a_stop_raised_where_python_swallows_it_still_stops_prepare():
    # Before: a SIGTERM whose handler ran inside a __del__ or weakref callback (h5py's, while shards are
    # written) had its exception printed as "Exception ignored" and prepare went on to install (exit 0).
    code = ("import os, signal, sys\n"
            "from hpctrain.data.stopping import signals_held, stops_cleanly\n"
            "from hpctrain.base.errors import one_line_errors\n"
            "class Stops:\n"
            "    def __del__(self):\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n"
            "@stops_cleanly\n"
            "def prepare():\n"
            "    Stops()\n"
            "    with signals_held():\n"
            "        print('installed')\n"
            "sys.exit(one_line_errors(lambda: prepare() or 0)())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert (r.returncode, r.stdout) == (75, "")
    assert r.stderr == ("hpctrain: error: prepare stopped by SIGTERM: nothing written (--out as it was, the "
                        "temporary folder removed); run the same command again\n")


def test_a_stop_while_the_shards_are_renamed_into_place_changes_nothing():
    # A stop between moving the old --out aside and renaming the new one in would leave neither in place.
    code = ("import os, signal\n"
            "from hpctrain.data.stopping import signals_held\n"
            "with signals_held():\n"
            "    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT):\n"
            "        os.kill(os.getpid(), sig)\n"
            "print('installed')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert (r.returncode, r.stdout, r.stderr) == (0, "installed\n", "")


def test_prepare_sweeps_the_temporary_folders_of_killed_prepares(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    running = subprocess.Popen(["sleep", "60"])
    try:
        hour_ago = time.time() - 3600
        left = {name: tmp_path / name for name in (f".out.tmp-{dead.pid}-0123abcd", f".out.tmp-{running.pid}-0123abcd",
                                                   f".other.tmp-{dead.pid}-0123abcd")}
        for path in left.values():
            path.mkdir()
            (path / "train-00000-of-00002.h5").write_bytes(b"half")
            os.utime(path, (hour_ago, hour_ago))
        fresh = tmp_path / f".out.tmp-{dead.pid}-89abcdef"   # written after this process began: maybe another node's
        fresh.mkdir()
        lines = []
        data.prepare(make_single_source(tmp_path / "src", n=100), tmp_path / "out", shards=2, log=lines.append)
    finally:
        running.kill()
    assert not left[f".out.tmp-{dead.pid}-0123abcd"].exists()
    assert left[f".out.tmp-{running.pid}-0123abcd"].exists() and left[f".other.tmp-{dead.pid}-0123abcd"].exists()
    assert fresh.exists()
    assert lines[0] == (f"removed {tmp_path}/.out.tmp-{dead.pid}-0123abcd: left by an earlier prepare "
                        f"(process {dead.pid}, gone)")


def test_prepare_bad_arguments(tmp_path):
    source = make_single_source(tmp_path / "src", n=20, classes=2)
    out = tmp_path / "out"
    with pytest.raises(HpctrainError, match="--shards must be a positive integer"):
        data.prepare(source, out, shards=0)
    for bad in (1.0, -0.1):
        with pytest.raises(HpctrainError, match=r"--test-fraction must be in \[0, 1\)"):
            data.prepare(source, out, test_fraction=bad)
    with pytest.raises(HpctrainError, match="18 training samples, fewer than --shards 19"):
        data.prepare(source, out, shards=19, log=quiet)
    with pytest.raises(HpctrainError, match="nowhere: no such directory"):
        data.prepare(tmp_path / "nowhere", out)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(HpctrainError, match="empty: expected train-/t10k-.*found: none"):
        data.prepare(empty, out)
    assert not out.exists()


# ---------------------------------------------------------------------------
# ShardReader

def epoch_of(readers, steps):
    """Sample ids (as the images spell them) per step and worker: int (steps, W, B)."""
    out = []
    for _ in range(steps):
        out.append([sample_ids((r.next_batch()[0] * 255).round().astype(np.uint8)) for r in readers])
    return np.array(out)


@pytest.mark.parametrize("workers", [1, 3, 8, 12, 20])
@pytest.mark.parametrize("resident", [True, False])
def test_an_epoch_is_one_permutation_dealt_over_the_workers(numbered, workers, resident):
    """Every step takes W*B distinct training samples, worker w the w-th B of
    the step's block of the epoch's permutation; an epoch uses a sample at most
    once and drops fewer than W*B; the next epoch is another permutation."""
    B = 16
    readers = [data.ShardReader(numbered, w, workers, B, seed=0,
                                resident_bytes=data.reader.RESIDENT_BYTES if resident else 0)
               for w in range(workers)]
    assert all(r.resident == resident for r in readers)
    steps = 900 // (workers * B)
    first, second = epoch_of(readers, steps), epoch_of(readers, steps)
    truth = set(train_ids(numbered).tolist())
    for epoch in (first, second):
        ids = epoch.reshape(-1).tolist()
        assert len(set(ids)) == len(ids) == steps * workers * B and set(ids) <= truth
        assert 900 - len(ids) < workers * B
    assert readers[0].position == (1, steps * workers * B)
    assert not np.array_equal(first, second)
    # The dealing is the module's deal(): global ids in shard order.
    order = train_ids(numbered)   # in shard order: a global id's sample
    np.testing.assert_array_equal(first, order[data.reader.deal(900, workers, B, 0, 0)])


@pytest.mark.parametrize("resident", [True, False])
def test_a_run_resized_2_4_3_goes_on_where_the_last_stopped(numbered, resident):
    """seek(position) with another number of workers deals the rest of the
    epoch over them: no sample twice within an epoch, fewer than W*B dropped
    per epoch (W: the workers that end it), the same for the slab-read path."""
    budget = data.reader.RESIDENT_BYTES if resident else 0
    B, used, position = 16, {}, (0, 0)
    order = train_ids(numbered)   # in shard order: a global id's sample
    for workers, steps in ((2, 20), (4, 9), (3, 30)):
        readers = [data.ShardReader(numbered, w, workers, B, seed=4, resident_bytes=budget)
                   for w in range(workers)]
        for r in readers:
            r.seek(*position)
        for _ in range(steps):
            for r in readers:
                x, _ = r.next_batch()
                ids = sample_ids((x * 255).round().astype(np.uint8))
                np.testing.assert_array_equal(order[r.last_ids], ids)   # last_ids: what the test records
                used.setdefault(r.position[0], []).extend(ids.tolist())
        assert len({r.position for r in readers}) == 1
        position = readers[0].position
    assert position[0] >= 2
    for epoch, ids in used.items():
        assert len(ids) == len(set(ids)), f"epoch {epoch} used a sample twice"
        if epoch < position[0]:
            assert 900 - len(ids) < 4 * B
    # Going on at the same size is the same as never stopping.
    a = [data.ShardReader(numbered, w, 3, B, seed=4) for w in range(3)]
    b = [data.ShardReader(numbered, w, 3, B, seed=4) for w in range(3)]
    first = epoch_of(a, 40)
    for r in b:
        r.seek(*a[0].position)
    np.testing.assert_array_equal(epoch_of(a, 25), epoch_of(b, 25))
    assert first.shape == (40, 3, B)


def test_batches_are_deterministic_and_reshuffle_every_epoch(numbered):
    a = data.ShardReader(numbered, 1, 3, 50, seed=7)
    b = data.ShardReader(numbered, 1, 3, 50, seed=7)
    n = a.num_samples
    per_epoch = n // (3 * 50)
    epochs = []
    for _ in range(2):
        seen, labels = [], []
        for _ in range(per_epoch):
            x, y = a.next_batch()
            xb, yb = b.next_batch()
            assert x.dtype == np.float32 and x.shape == (50, 784) and 0 <= x.min() <= x.max() <= 1
            assert y.dtype == np.int64 and y.shape == (50,)
            np.testing.assert_array_equal(x, xb)
            np.testing.assert_array_equal(y, yb)
            seen.extend(sample_ids((x * 255).round().astype(np.uint8)).tolist())
            labels.extend(y.tolist())
        assert len(set(seen)) == per_epoch * 50   # no repeats within an epoch
        ids = sample_ids(a.images).tolist()
        truth = dict(zip(ids, a.labels.tolist()))
        assert [truth[i] for i in seen] == labels
        epochs.append(seen)
    assert epochs[0] != epochs[1]
    other = data.ShardReader(numbered, 1, 3, 50, seed=8)
    assert not np.array_equal(other.next_batch()[1], data.ShardReader(
        numbered, 1, 3, 50, seed=7).next_batch()[1])


def test_batch_arrays_are_reused(numbered):
    r = data.ShardReader(numbered, 0, 2, 32, seed=0)
    x1, y1 = r.next_batch()
    first = x1.copy()
    x2, y2 = r.next_batch()
    assert x1 is x2 and y1 is y2 and not np.array_equal(first, x2)


def test_position_and_seek_resume_the_same_batches(numbered):
    r = data.ShardReader(numbered, 2, 3, 64, seed=5)
    per_epoch = r.num_samples // (3 * 64)
    assert per_epoch < 7   # the 7 batches cross an epoch boundary
    for _ in range(7):
        r.next_batch()
    position = r.position
    assert position == (7 // per_epoch, 3 * 64 * (7 % per_epoch))
    expected = [tuple(a.copy() for a in r.next_batch()) for _ in range(3)]
    fresh = data.ShardReader(numbered, 2, 3, 64, seed=5)
    fresh.seek(*position)
    for x, y in expected:
        xf, yf = fresh.next_batch()
        np.testing.assert_array_equal(x, xf)
        np.testing.assert_array_equal(y, yf)
    with pytest.raises(HpctrainError, match="cannot seek"):
        fresh.seek(0, 901)


@pytest.mark.parametrize("resident", [True, False])
def test_a_reader_of_some_arrays_holds_only_those_and_deals_alike(numbered, tmp_path, resident):
    """arrays=("images",) (a pipeline's first stage), ("labels",) (its last),
    () (the stages between): each holds and hands out only what it names,
    None for the rest, and deals, positions, seeks and draws as a reader of
    both does; a reader of neither opens no shard (here: none is left)."""
    budget = data.reader.RESIDENT_BYTES if resident else 0
    kinds = {"both": ("images", "labels"), "images": ("images",), "labels": ("labels",), "none": ()}
    readers = {k: data.ShardReader(numbered, 1, 3, 50, seed=7, resident_bytes=budget, arrays=a)
               for k, a in kinds.items()}
    bare = tmp_path / "manifest-only"
    bare.mkdir()
    shutil.copy(numbered / "manifest.json", bare)
    readers["bare"] = data.ShardReader(bare, 1, 3, 50, seed=7, resident_bytes=budget, arrays=())
    for step in range(8):   # 6 steps an epoch: across its end, then seek back
        if step == 7:
            for r in readers.values():
                r.seek(0, 150)
        got = {k: r.next_batch() for k, r in readers.items()}
        x, y = got["both"]
        assert np.array_equal(got["images"][0], x) and got["images"][1] is None
        assert got["labels"][0] is None and np.array_equal(got["labels"][1], y)
        assert got["none"] == (None, None) and got["bare"] == (None, None)
        for r in readers.values():
            assert r.position == readers["both"].position and r.last_draw[0] == readers["both"].last_draw[0]
            assert np.array_equal(r.last_draw[1], readers["both"].last_draw[1])
    assert readers["images"].labels is None and readers["labels"].images is None
    assert all(readers[k].images is None and readers[k].labels is None for k in ("none", "bare"))
    with pytest.raises(HpctrainError, match="missing shard"):
        data.ShardReader(bare, 1, 3, 50, seed=7, arrays=("labels",))


def copy_shards(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_corrupt_shard_is_refused(numbered, tmp_path):
    out = copy_shards(numbered, tmp_path / "shards")
    shard = out / "train-00001-of-00008.h5"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 64] = b"\xff" * 64
    shard.write_bytes(bytes(raw))
    # Every worker may be dealt any sample, so every worker checks every shard.
    for worker in (0, 1):
        with pytest.raises(HpctrainError, match="train-00001-of-00008.h5: corrupt shard"):
            data.ShardReader(out, worker, 8, 16, seed=0)


def test_unreadable_or_misshapen_shard_is_refused(numbered, tmp_path):
    import h5py
    out = copy_shards(numbered, tmp_path / "shards")
    manifest = json.loads((out / "manifest.json").read_text())

    def replace(i, write):
        path = out / manifest["train"]["shards"][i]["file"]
        write(path)
        manifest["train"]["shards"][i]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
        (out / "manifest.json").write_text(json.dumps(manifest))

    good = (out / manifest["train"]["shards"][0]["file"]).read_bytes()
    replace(0, lambda p: p.write_bytes(b"not hdf5 at all" * 100))
    with pytest.raises(HpctrainError, match="train-00000-of-00008.h5: unreadable HDF5 shard"):
        data.ShardReader(out, 0, 8, 16, seed=0)
    replace(0, lambda p: p.write_bytes(good))

    def wrong_shape(p):
        with h5py.File(p, "w") as f:
            f["images"] = np.zeros((5, 784), np.uint8)
            f["labels"] = np.zeros(5, np.uint8)
    replace(1, wrong_shape)
    with pytest.raises(HpctrainError, match="train-00001-of-00008.h5: bad shard"):
        data.ShardReader(out, 1, 8, 16, seed=0)


def test_labels_beyond_num_classes_are_refused_naming_the_shard(numbered, tmp_path):
    import h5py
    out = copy_shards(numbered, tmp_path / "shards")
    manifest = json.loads((out / "manifest.json").read_text())
    # A shard whose labels the manifest does not cover, with a matching sha256.
    entry = manifest["train"]["shards"][2]
    path = out / entry["file"]
    with h5py.File(path, "r+") as f:
        labels = f["labels"][:]
        labels[7] = 12
        f["labels"][:] = labels
    entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(HpctrainError) as e:
        data.ShardReader(out, 2, 8, 16, seed=0)
    assert str(e.value) == (f"{path}: label 12 in row 7 is not below the manifest's num_classes "
                            f"10; prepare again with --force")
    assert e.value.exit_code == 2
    # Read epoch by epoch (a training set too big to hold): at the first batch.
    reader = data.ShardReader(out, 1, 8, 16, seed=0, resident_bytes=0)
    with pytest.raises(HpctrainError, match=r"-of-00008.h5: label 12 in row 7 is not below"):
        reader.next_batch()
    # A manifest claiming fewer classes than its shards hold: the same, test set too.
    manifest["num_classes"] = 5
    (out / "manifest.json").write_text(json.dumps(manifest))
    for read in (lambda: data.ShardReader(out, 0, 8, 16, seed=0), lambda: data.load_test(out)):
        with pytest.raises(HpctrainError, match=r"-of-0000\d.h5: label [5-9] in row \d+ is not "
                                                r"below the manifest's num_classes 5"):
            read()


def test_manifest_sizes_are_checked_against_the_shards_before_allocating(numbered, tmp_path):
    # Found by tests/test_data_properties.py: image_shape [10**6, 10**6] made
    # ShardReader allocate 43.7 TiB (MemoryError traceback) before it opened a shard.
    out = copy_shards(numbered, tmp_path / "shards")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["image_shape"] = [10 ** 6, 10 ** 6]
    (out / "manifest.json").write_text(json.dumps(manifest))
    for read in (lambda: data.ShardReader(out, 0, 1, 16, seed=0), lambda: data.load_test(out)):
        with pytest.raises(HpctrainError, match=r"-of-0000\d.h5: bad shard: expected uint8 "
                                                r"images \(\d+, 1000000, 1000000\)"):
            read()


def test_prepare_checks_the_arrays_fit_their_manifest(tmp_path):
    ok = numbered_images(4), np.arange(4, dtype=np.uint8)
    paths = {"images": tmp_path / "i", "labels": tmp_path / "l"}

    def check(train, test=ok, classes=4):
        with pytest.raises(HpctrainError) as e:
            prepare_mod._check_fits({"train": (*train, None), "test": (*test, None)}, classes,
                                    paths)
        return str(e.value)

    prepare_mod._check_fits({"train": (*ok, None), "test": (*ok, None)}, 4, paths)
    prepare_mod._check_fits({"train": (np.zeros((2, 4, 4, 3), np.uint8), ok[1][:2], None),
                             "test": (np.zeros((0, 4, 4, 3), np.uint8), ok[1][:0], None)}, 4, paths)
    assert check((ok[0].astype(np.float32), ok[1])) == (
        "i, l: train images must be uint8 of 2 or 3 dimensions each, got float32 (4, 28, 28)")
    assert "got uint8 (4, 784)" in check((ok[0].reshape(4, -1), ok[1]))
    assert check(ok, (numbered_images(2)[:, :14], ok[1][:2])) == (
        "i, l: test images are (14, 28), training images are (28, 28)")
    assert check(ok, classes=3) == "i, l: train labels must be uint8 below 3, got uint8 (4,)"


def test_model_shape_of_a_bad_manifest_is_one_line(bundled):
    # (was test_model_fit_problem's last case; model_fit_problem was never called and is gone)
    _, manifest = bundled
    with pytest.raises(HpctrainError) as e:
        data.model_shape(dict(manifest, image_shape=[]))
    assert str(e.value) == "bad manifest: image_shape must be a list of positive integers, got []"


def test_missing_shard_or_manifest(numbered, tmp_path):
    out = copy_shards(numbered, tmp_path / "shards")
    (out / "train-00005-of-00008.h5").unlink()
    with pytest.raises(HpctrainError, match="train-00005-of-00008.h5: missing shard"):
        data.ShardReader(out, 2, 3, 16, seed=0)
    (out / "manifest.json").unlink()
    # issue 41, 30: the hint was MNIST's command (--source data/mnist-5k) whatever the data
    with pytest.raises(HpctrainError, match=f"manifest.json: missing.*: hpctrain data prepare --source SOURCE "
                                            f"--out {re.escape(str(out))} "):
        data.ShardReader(out, 0, 1, 16, seed=0)
    with pytest.raises(HpctrainError, match="nowhere: no such directory.*: hpctrain data prepare --source SOURCE"):
        data.load_test(tmp_path / "nowhere")
    with pytest.raises(HpctrainError) as e:
        data.load_manifest(tmp_path / "nowhere")
    assert "mnist" not in str(e.value)
    from hpctrain.data.manifest import _prepare_hint
    assert _prepare_hint(data.default_data_dir()) == f"hpctrain data prepare --out {data.default_data_dir()} " \
                                                     f"(the bundled MNIST sample)"


def test_more_workers_than_samples(tmp_path):
    source = make_single_source(tmp_path / "src", n=20, classes=2)
    out = tmp_path / "out"
    data.prepare(source, out, shards=2, test_fraction=0.1, log=quiet)
    with pytest.raises(HpctrainError, match=r"18 training samples, fewer than one step takes "
                                            r"\(5 workers x --batch-size 4 = 20\)"):
        data.ShardReader(out, 0, 5, 4, seed=0)
    r = data.ShardReader(out, 17, 18, 1, seed=0)
    assert r.next_batch()[0].shape == (1, 784) and r.position == (0, 18)


def test_bad_reader_arguments(numbered):
    with pytest.raises(HpctrainError, match="worker must be in 0..2"):
        data.ShardReader(numbered, 3, 3, 16, seed=0)
    with pytest.raises(HpctrainError, match="--batch-size must be a positive integer"):
        data.ShardReader(numbered, 0, 3, 0, seed=0)


@pytest.mark.parametrize("parts", [1, 3, 7, 100, 130])
def test_load_test_parts_cover_the_test_set(numbered, parts):
    whole_x, whole_y = data.load_test(numbered)
    assert whole_x.shape == (100, 784) and whole_x.dtype == np.float32
    assert whole_y.dtype == np.int64 and np.bincount(whole_y).tolist() == [10] * 10
    xs, ys = zip(*(data.load_test(numbered, p, parts) for p in range(parts)))
    assert max(len(y) for y in ys) - min(len(y) for y in ys) <= 1
    assert all(x.shape == (len(y), 784) and x.dtype == np.float32 for x, y in zip(xs, ys))
    np.testing.assert_array_equal(np.concatenate(xs), whole_x)
    np.testing.assert_array_equal(np.concatenate(ys), whole_y)


def test_training_and_test_pixels_scale_the_same_way(numbered):
    r = data.ShardReader(numbered, 0, 1, 900, seed=0)
    x, _ = r.next_batch()
    assert set(np.unique(x).tolist()) <= set((np.arange(256, dtype=np.float32) / 255).tolist())


def test_default_dirs():
    assert data.default_data_dir() == REPO / "data" / "mnist"
    assert data.bundled_sample_dir() == REPO / "data" / "mnist-5k"


# ---------------------------------------------------------------------------
# fetch

class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """A local HTTP server with four small, valid MNIST-format .gz files."""
    root = tmp_path / "www"
    root.mkdir()
    write_idx(root / "train-images-idx3-ubyte.gz", numbered_images(40))
    write_idx(root / "train-labels-idx1-ubyte.gz", np.arange(40) % 4)
    write_idx(root / "t10k-images-idx3-ubyte.gz", numbered_images(8, start=40))
    write_idx(root / "t10k-labels-idx1-ubyte.gz", np.arange(8) % 4)
    sums = {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in root.iterdir()}
    monkeypatch.setitem(data.MD5, "mnist", sums)
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/", root
    server.shutdown()
    server.server_close()


def test_fetch_from_mirror_then_prepare(mirror, tmp_path):
    url, root = mirror
    out = tmp_path / "raw"
    lines = []
    paths = data.fetch("mnist", out, mirror=url, log=lines.append)
    assert sorted(p.name for p in out.iterdir()) == sorted(data.MD5["mnist"])
    assert [p.read_bytes() for p in paths] == [(root / p.name).read_bytes() for p in paths]
    lines.clear()
    data.fetch("mnist", out, mirror=url.rstrip("/"), log=lines.append)
    assert len(lines) == 4 and all("present, checksum ok" in line for line in lines)
    manifest = data.prepare(out, tmp_path / "shards", shards=2, log=quiet)
    assert manifest["train"]["num_samples"] == 40 and manifest["test"]["num_samples"] == 8


def test_fetch_refuses_a_wrong_file(mirror, tmp_path, monkeypatch):
    url, root = mirror
    monkeypatch.setitem(data.MD5["mnist"], "t10k-images-idx3-ubyte.gz", "0" * 32)
    out = tmp_path / "raw"
    with pytest.raises(HpctrainError, match="t10k-images-idx3-ubyte.gz: checksum mismatch"):
        data.fetch("mnist", out, mirror=url, log=quiet)
    names = sorted(p.name for p in out.iterdir())
    assert "t10k-images-idx3-ubyte.gz" not in names and not any(".part" in n for n in names)


def test_fetch_http_error_and_timeout(mirror, tmp_path):
    url, root = mirror
    (root / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(HpctrainError, match="t10k-labels-idx1-ubyte.gz: HTTP 404"):
        data.fetch("mnist", tmp_path / "raw", mirror=url, log=quiet)
    assert not any(".part" in p.name for p in (tmp_path / "raw").iterdir())
    # A listener that never answers: the kernel completes the connection, no reply comes.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        with pytest.raises(HpctrainError, match="no response within 0.3 s"):
            data.fetch("mnist", tmp_path / "raw2", mirror=f"http://127.0.0.1:{port}/",
                       log=quiet, timeout=0.3)
    with pytest.raises(HpctrainError, match="unknown dataset 'cifar'"):
        data.fetch("cifar", tmp_path / "raw3")


# ---------------------------------------------------------------------------
# Command line

def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "hpctrain.data", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=60)


def test_cli_bad_source_is_one_line_exit_2(tmp_path):
    r = run_cli("prepare", "--source", tmp_path / "missing", "--out", tmp_path / "out")
    assert r.returncode == 2
    assert r.stderr == f"hpctrain: error: {tmp_path / 'missing'}: no such directory\n"
    assert not (tmp_path / "out").exists()


def test_cli_prepare_prints_a_summary(tmp_path):
    source = make_single_source(tmp_path / "src", n=100)
    r = run_cli("prepare", "--source", source, "--out", tmp_path / "out", "--shards", 3,
                "--test-fraction", 0.2, "--seed", 1)
    assert r.returncode == 0, r.stderr
    assert "80 training samples in 3 shards" in r.stdout and "20 test samples" in r.stdout
    assert data.is_prepared(tmp_path / "out")


def test_cli_prepare_force_never_deletes_its_input(tmp_path):
    # --out equal to --source, or a parent of it: refused with one line, the
    # IDX files untouched (before, `--out D --force` replaced D and exited 0).
    source = make_single_source(tmp_path / "raw" / "mnist", n=100)
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    for out, says in ((source, "would write into the run's input"),
                      (tmp_path / "raw", "would write over the run's input"),
                      (tmp_path, "would write over the run's input")):
        r = run_cli("prepare", "--source", source, "--out", out, "--force")
        assert r.returncode == 2, r.stderr
        held = ", which it holds" if out != source else ""
        assert r.stderr == f"hpctrain: error: --out {out} {says} {source} (the --source folder){held}\n"
        assert {p.name: p.read_bytes() for p in source.iterdir()} == before
    # Through a symlink too: the check compares resolved paths.
    link = tmp_path / "link"
    link.symlink_to(source)
    r = run_cli("prepare", "--source", source, "--out", link, "--force")
    assert r.returncode == 2 and "would write into the run's input" in r.stderr
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before
    # A sibling directory is fine.
    r = run_cli("prepare", "--source", source, "--out", tmp_path / "raw" / "shards", "--force")
    assert r.returncode == 0, r.stderr
