"""Datasets beyond MNIST: Fashion-MNIST, KMNIST, EMNIST (IDX) and CIFAR-10 (binary batches).

Every file here is written by the test itself, small, in each format's own
layout; nothing depends on a downloaded dataset. fetch is tested against a
local HTTP server; one short end-to-end run per format trains a model whose
shape follows the manifest.

    .venv/bin/python -m pytest tests/test_datasets.py
"""
import functools
import gzip
import hashlib
import http.server
import io
import struct
import tarfile
import threading
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import checkpoint_file, newest_checkpoint
from hpctrain import data
from hpctrain.data.cifar import read_cifar10
from hpctrain.base.errors import HpctrainError


def quiet(*args):
    pass


def write_idx(path, array):
    """IDX as LeCun's page specifies it, gzip-compressed, written independently of the module."""
    array = np.asarray(array, dtype=np.uint8)
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    Path(path).write_bytes(gzip.compress(header + array.tobytes()))
    return path


def idx_quartet(root, n_train, n_test, classes, prefix="", test="t10k", seed=0):
    """The four IDX files of one dataset (MNIST's names, or EMNIST's with a prefix)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), (test, n_test)):
        labels = np.arange(n) % classes
        # Images that say their class (a bright block per class), so a few steps learn something.
        images = rng.integers(0, 40, (n, 28, 28), dtype=np.uint8)
        images[np.arange(n), labels % 28, :] = 255
        write_idx(root / f"{prefix}{split}-images-idx3-ubyte.gz", images)
        write_idx(root / f"{prefix}{split}-labels-idx1-ubyte.gz", labels)
    return root


def cifar_record(label, planes):
    """One CIFAR-10 record as its page specifies: the label byte, then the
    red, green and blue 32x32 planes, each row-major."""
    return bytes([label]) + np.asarray(planes, np.uint8).tobytes()


def cifar_batches(root, per_batch=12, batches=2, test=10, classes=10):
    """data_batch_1..N.bin and test_batch.bin; record i of the whole set has
    red = i % 256, green = its label, blue = 255 - red, and pixel (0, 1)'s
    red value 7, so both the order of planes and of pixels show."""
    root.mkdir(parents=True, exist_ok=True)
    at = 0
    names = [f"data_batch_{b + 1}.bin" for b in range(batches)] + ["test_batch.bin"]
    for name in names:
        n = test if name == "test_batch.bin" else per_batch
        blob = b""
        for _ in range(n):
            label = at % classes
            planes = np.zeros((3, 32, 32), np.uint8)
            planes[0], planes[1], planes[2] = at % 256, label, 255 - at % 256
            planes[0, 0, 1] = 7
            blob += cifar_record(label, planes)
            at += 1
        (root / name).write_bytes(blob)
    return root


# ---------------------------------------------------------------------------
# prepare: each format

def test_cifar10_batches_become_32x32x3_shards(tmp_path):
    src = cifar_batches(tmp_path / "cifar", per_batch=12, batches=2, test=10)
    manifest = data.prepare(src, tmp_path / "shards", shards=2, log=quiet)
    assert manifest["image_shape"] == [32, 32, 3] and manifest["num_classes"] == 10
    assert manifest["source"]["layout"] == "cifar-10"
    assert [f["role"] for f in manifest["source"]["files"]] == ["train_1", "train_2", "test"]
    assert manifest["train"]["num_samples"] == 24 and manifest["test"]["num_samples"] == 10
    assert data.model_shape(manifest) == ((32, 32, 3), 10)
    x, y = data.load_test(tmp_path / "shards", raw=True)
    with h5py.File(tmp_path / "shards" / "test-00000-of-00001.h5") as f:
        images = f["images"][...]
    # Channel-major planes became the last axis: (rows, cols, [R, G, B]).
    order = np.argsort(images[:, 1, 1, 0])
    red = np.arange(24, 34) % 256
    assert (images[order, 1, 1, 0] == red).all() and (images[order, 1, 1, 2] == 255 - red).all()
    assert (images[:, 1, 1, 1] == y).all() and (images[:, 0, 1, 0] == 7).all()
    assert (images[:, 1, 0, 0] != 7).all()   # (row 0, col 1), not (row 1, col 0)
    assert x.shape == (10, 3072) and x.dtype == np.uint8


def test_cifar10_inside_its_archive_directory(tmp_path):
    # The archive unpacks to cifar-10-batches-bin/: that directory's parent works too.
    cifar_batches(tmp_path / "raw" / "cifar-10-batches-bin", batches=1)
    manifest = data.prepare(tmp_path / "raw", tmp_path / "shards", shards=2, log=quiet)
    assert manifest["train"]["num_samples"] == 12


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(p.read_bytes()[:-5]), "not a whole number of CIFAR-10 records"),
    (lambda p: p.write_bytes(b""), "0 bytes, not a whole number of CIFAR-10 records"),
    (lambda p: p.write_bytes(bytes([10]) + p.read_bytes()[1:]), "label 10 in record 0; CIFAR-10's labels are 0..9"),
    (lambda p: p.unlink(), "CIFAR-10 needs data_batch_N.bin and test_batch.bin"),
])
def test_bad_cifar10_batch_is_one_line(tmp_path, damage, message):
    src = cifar_batches(tmp_path / "cifar", batches=1)
    damage(src / "test_batch.bin")
    with pytest.raises(HpctrainError, match=message) as e:
        data.prepare(src, tmp_path / "shards", shards=2, log=quiet)
    assert "\n" not in str(e.value) and not (tmp_path / "shards").exists()


@pytest.mark.parametrize("read, expected", [(data.read_idx, "an IDX file"),
                                            (read_cifar10, "a CIFAR-10 batch")])
def test_idx_and_cifar_readers_map_file_errors_alike(tmp_path, read, expected):
    (tmp_path / "plain").write_bytes(b"x")
    for path, message in [(tmp_path / "gone", "gone: no such file"),
                          (tmp_path, f"is a directory, expected {expected}"),
                          (tmp_path / "plain" / "below", r"below: cannot read \(Not a directory\)")]:
        with pytest.raises(HpctrainError, match=message) as e:
            read(path)
        assert "\n" not in str(e.value)


def test_emnist_balanced_names_and_47_classes(tmp_path):
    src = idx_quartet(tmp_path / "emnist", 94, 47, classes=47, prefix="emnist-balanced-", test="test")
    manifest = data.prepare(src, tmp_path / "shards", shards=2, log=quiet)
    assert manifest["num_classes"] == 47 and manifest["image_shape"] == [28, 28]
    assert data.model_shape(manifest) == ((28, 28), 47)
    assert manifest["class_names"][:3] == ["0", "1", "2"] and manifest["class_names"][36:] == list("abdefghnqrt")
    # Two of EMNIST's splits in one directory: which one is meant is not guessed.
    idx_quartet(src, 20, 10, classes=10, prefix="emnist-digits-", test="test")
    with pytest.raises(HpctrainError, match="holds more than one dataset"):
        data.prepare(src, tmp_path / "shards2", shards=2, log=quiet)


def test_known_idx_sets_get_their_class_names_by_their_labels_checksums(tmp_path, monkeypatch):
    # Fashion-MNIST prepared from IDX once had no class names: predict printed 7 for a sneaker.
    src = idx_quartet(tmp_path / "fashion", 40, 20, classes=10)
    monkeypatch.setitem(data.MD5, "fashion-mnist", md5s(*src.iterdir()))
    manifest = data.prepare(src, tmp_path / "shards", shards=2, log=quiet)
    assert manifest["class_names"][7] == "Sneaker" and len(manifest["class_names"]) == 10
    # Other labels under the same names are not Fashion-MNIST: no names, as before.
    write_idx(src / "t10k-labels-idx1-ubyte.gz", np.arange(20)[::-1] % 10)
    assert "class_names" not in data.prepare(src, tmp_path / "other", shards=2, log=quiet)
    # CIFAR-10's layout is CIFAR-10.
    manifest = data.prepare(cifar_batches(tmp_path / "cifar"), tmp_path / "cifar-shards", shards=2, log=quiet)
    assert manifest["class_names"][0] == "airplane" and manifest["class_names"][9] == "truck"


# ---------------------------------------------------------------------------
# fetch: a local server in each dataset's published layout

class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/", root
    httpd.shutdown()
    httpd.server_close()


def md5s(*paths):
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in paths}


def test_fetch_kmnist_then_prepare(server, tmp_path, monkeypatch):
    url, root = server
    idx_quartet(root, 40, 10, classes=10)
    monkeypatch.setitem(data.MD5, "kmnist", md5s(*root.iterdir()))
    paths = data.fetch("kmnist", tmp_path / "raw", mirror=url, log=quiet)
    assert len(paths) == 4
    assert data.prepare(tmp_path / "raw", tmp_path / "shards", shards=2, log=quiet)["num_classes"] == 10


def test_fetch_emnist_takes_the_split_out_of_the_zip(server, tmp_path, monkeypatch):
    url, root = server
    src = idx_quartet(tmp_path / "src", 94, 47, classes=47, prefix="emnist-balanced-", test="test")
    idx_quartet(src, 20, 10, classes=10, prefix="emnist-digits-", test="test")
    with zipfile.ZipFile(root / "gzip.zip", "w") as z:   # NIST's layout: gzip/emnist-*.gz
        for p in sorted(src.iterdir()):
            z.write(p, f"gzip/{p.name}")
    monkeypatch.setitem(data.MD5, "emnist", md5s(root / "gzip.zip"))
    out = tmp_path / "raw"
    paths = data.fetch("emnist", out, mirror=url, log=quiet)
    assert sorted(p.name for p in paths) == sorted(p.name for p in src.iterdir() if "balanced" in p.name)
    assert all(p.read_bytes() == (src / p.name).read_bytes() for p in paths)
    assert data.prepare(out, tmp_path / "shards", shards=2, log=quiet)["num_classes"] == 47
    lines = []
    data.fetch("emnist", out, mirror=url, log=lines.append, split="digits")   # the zip is kept
    assert "present, checksum ok" in lines[0]
    with pytest.raises(HpctrainError, match="unknown EMNIST split 'nope'"):
        data.fetch("emnist", out, mirror=url, log=quiet, split="nope")


def tar_with(path, members):
    """A tar.gz of (name, bytes or a TarInfo-editing function) pairs."""
    with tarfile.open(path, "w:gz") as t:
        for name, content in members:
            info = tarfile.TarInfo(name)
            if callable(content):
                content(info)
                t.addfile(info)
            else:
                info.size = len(content)
                t.addfile(info, io.BytesIO(content))
    return path


def test_fetch_cifar10_extracts_only_its_batches(server, tmp_path, monkeypatch):
    url, root = server
    src = cifar_batches(tmp_path / "src", batches=5, per_batch=4)
    tar_with(root / "cifar-10-binary.tar.gz",
             [(f"cifar-10-batches-bin/{p.name}", p.read_bytes()) for p in sorted(src.iterdir())]
             + [("cifar-10-batches-bin/readme.html", b"<html>"), ("../../escaped.txt", b"x")])
    monkeypatch.setitem(data.MD5, "cifar-10", md5s(root / "cifar-10-binary.tar.gz"))
    out = tmp_path / "deep" / "raw"
    paths = data.fetch("cifar-10", out, mirror=url, log=quiet)
    assert [p.name for p in paths] == list(data.CIFAR10_BATCHES)
    assert sorted(p.name for p in out.iterdir()) == sorted([*data.CIFAR10_BATCHES, "cifar-10-binary.tar.gz"])
    assert not list(tmp_path.rglob("escaped.txt"))
    manifest = data.prepare(out, tmp_path / "shards", shards=2, log=quiet)
    assert manifest["image_shape"] == [32, 32, 3] and manifest["train"]["num_samples"] == 20


def test_extract_refuses_links_and_traversal(tmp_path):
    # A member named like a batch that is a symlink (to /etc/passwd, say) is
    # refused; a member whose path climbs out is written under out, by its name.
    out = tmp_path / "out"
    out.mkdir()
    batch = cifar_record(1, np.zeros((3, 32, 32)))

    def link(info):
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    evil = tar_with(tmp_path / "evil.tar.gz", [("data_batch_1.bin", link)])
    with pytest.raises(HpctrainError, match="data_batch_1.bin is not a regular file"):
        data.extract(evil, {"data_batch_1.bin": "data_batch_1.bin"}, out, log=quiet)
    assert list(out.iterdir()) == []
    climbing = tar_with(tmp_path / "climb.tar.gz", [("../../../tmp/x/data_batch_1.bin", batch)])
    paths = data.extract(climbing, {"data_batch_1.bin": "data_batch_1.bin"}, out, log=quiet)
    assert paths == [out / "data_batch_1.bin"] and paths[0].read_bytes() == batch
    with pytest.raises(HpctrainError, match="no member test_batch.bin"):
        data.extract(climbing, {"test_batch.bin": "test_batch.bin"}, out, log=quiet)
    (tmp_path / "junk.tar.gz").write_bytes(b"\x1f\x8b not really")
    with pytest.raises(HpctrainError, match="corrupt archive"):
        data.extract(tmp_path / "junk.tar.gz", {"a": "a"}, out, log=quiet)
    assert sorted(p.name for p in out.iterdir()) == ["data_batch_1.bin"]


# ---------------------------------------------------------------------------
# End to end: the model follows the manifest (ring for each format, ps for CIFAR-10)

@pytest.mark.parametrize("fmt", ["fashion-mnist", "emnist", "cifar-10"])
def test_train_a_few_steps_on_each_format(fmt, tmp_path, job):
    if fmt == "cifar-10":
        src = cifar_batches(tmp_path / "src", batches=2, per_batch=16, test=10)
        shape, flags = (3072, 10), ["--mode", "ps", "--num-ps", "1"]
    elif fmt == "emnist":
        src = idx_quartet(tmp_path / "src", 94, 47, classes=47, prefix="emnist-balanced-", test="test")
        shape, flags = (784, 47), []
    else:
        src = idx_quartet(tmp_path / "src", 40, 10, classes=10)
        shape, flags = (784, 10), []
    data.prepare(src, tmp_path / "shards", shards=2, log=quiet)
    r = job(2, "--data", tmp_path / "shards", "--steps", "4", "--hidden", "16", "--batch-size", "8",
            "--save", tmp_path / "p.h5", "--checkpoint-dir", tmp_path / "ckpt", *flags, timeout=120)
    assert r.returncode == 0, r.stderr
    with h5py.File(tmp_path / "p.h5") as f:
        assert f["layer0/W"].shape == (shape[0], 16) and f["layer1/W"].shape == (16, shape[1])
    with h5py.File(checkpoint_file(newest_checkpoint(tmp_path / "ckpt"))) as f:
        assert (f.attrs["inputs"], f.attrs["classes"]) == shape
        assert f.attrs["num_params"] == shape[0] * 16 + 16 + 16 * shape[1] + shape[1]
