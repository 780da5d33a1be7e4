"""prepare from what users bring: folders of images (real PNG and JPEG files
written here with Pillow, one of them corrupt), NumPy arrays (.npz, a .npy
pair), HDF5 files with two named datasets, and CSV files of label + pixels.

Serial, no MPI; every bad input is checked through the command's main (the
first of each list as the command line itself): one line `hpctrain: error:
...`, exit 2, nothing written.

    .venv/bin/python -m pytest tests/test_user_data.py
"""
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from PIL import Image

from hpctrain import data
from hpctrain.data import __main__ as data_cli
from hpctrain.data import arrays as arrays_mod

REPO = Path(__file__).resolve().parent.parent


def quiet(*args):
    pass


def run_cli(*args, cwd=REPO):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "hpctrain.data", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def run_main(capsys, *args):
    """run_cli in this process: the command's own main (its one-line error
    tail included), for the refusals after the one a test runs as the command."""
    code = data_cli.main(list(map(str, args)))
    got = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, got.out, got.err)


def picture(label, i, size=(12, 10), rgb=True):
    """An image that says its class and number: pixel (0, 0) is the label,
    (0, 1) the number, the rest a gradient of both."""
    h, w = size
    a = np.zeros((h, w, 3), np.uint8)
    a[..., 0] = (np.arange(h)[:, None] * 7 + label * 40) % 256
    a[..., 1] = (np.arange(w)[None, :] * 11 + i * 3) % 256
    a[..., 2] = 200 - label * 30
    a[0, 0], a[0, 1] = label, i
    return a if rgb else a[..., 0]


def image_folder(root, classes=("cat", "dog", "emu"), train=6, test=2, size=(12, 10), rgb=True, fmt="png"):
    """root/train/CLASS/NNN.png (and test/ when test > 0): real image files."""
    written = {}
    for split, n in (("train", train), ("test", test)):
        for c, name in enumerate(classes):
            if not n:
                continue
            d = root / split / name
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                path = d / f"{i:03d}.{fmt}"
                Image.fromarray(picture(c, i, size, rgb)).save(path)
                written[path] = (c, i)
    return root


def shard_arrays(out, split="train"):
    manifest = json.loads((out / "manifest.json").read_text())
    xs, ys = [], []
    for entry in manifest[split]["shards"]:
        with h5py.File(out / entry["file"], "r") as f:
            xs.append(f["images"][()])
            ys.append(f["labels"][()])
    return np.concatenate(xs), np.concatenate(ys), manifest


def refused(r, out, *fragments):
    """One error line naming the fragments, exit 2, and no output directory."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpctrain: error: "), r.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not Path(out).exists()
    assert not any(p.name.startswith(f".{Path(out).name}.tmp") for p in Path(out).parent.iterdir())
    return lines[0]


# ---------------------------------------------------------------------------
# Image folders

def test_image_folder_with_train_and_test_becomes_shards(tmp_path):
    src = image_folder(tmp_path / "photos", train=6, test=2)
    out = tmp_path / "out"
    r = run_cli("prepare", "--source", src, "--out", out, "--shards", 2)
    assert r.returncode == 0, r.stderr
    x, y, manifest = shard_arrays(out)
    assert manifest["class_names"] == ["cat", "dog", "emu"]
    assert manifest["image_shape"] == [12, 10, 3] and manifest["num_classes"] == 3
    assert manifest["source"]["layout"] == "image-folder"
    assert manifest["preprocess"] == {"kind": "image-folder", "mode": "RGB", "image_shape": [12, 10, 3],
                                      "resize": None, "resample": "bilinear", "exif_transpose": True}
    assert [f["count"] for f in manifest["source"]["files"]] == [18, 6]
    assert manifest["train"]["num_samples"] == 18 and manifest["test"]["num_samples"] == 6
    # PNG is lossless: every stored image is the picture of its class and number, once.
    seen = set()
    for image, label in zip(x, y):
        c, i = int(image[0, 0, 0]), int(image[0, 1, 0])
        assert c == label
        np.testing.assert_array_equal(image, picture(c, i))
        seen.add((c, i))
    assert seen == {(c, i) for c in range(3) for i in range(6)}
    tx, ty, _ = shard_arrays(out, "test")
    assert sorted(ty.tolist()) == [0, 0, 1, 1, 2, 2]
    # Every shard has every class (the stratified deal).
    for entry in manifest["train"]["shards"]:
        assert all(n == 3 for n in entry["per_class"].values())


def test_class_names_are_sorted_and_without_test_a_fraction_is_split(tmp_path):
    src = tmp_path / "flat"
    for c, name in enumerate(["zebra", "Apple", "mango"]):
        (src / name).mkdir(parents=True)
        for i in range(10):
            Image.fromarray(picture(c, i)).save(src / name / f"{i}.png")
    (src / "zebra" / "notes.txt").write_text("not an image: skipped")
    (src / "mango" / ".hidden.png").write_bytes(b"skipped too")
    m = data.prepare(src, tmp_path / "out", shards=2, test_fraction=0.2, log=quiet)
    assert m["class_names"] == ["Apple", "mango", "zebra"]   # sorted, as ImageFolder does
    assert m["train"]["num_samples"] == 24 and m["test"]["num_samples"] == 6
    assert m["test_fraction"] == 0.2
    x, y, _ = shard_arrays(tmp_path / "out")
    # Folder "zebra" was drawn as class 0: it is label 2 now.
    names = ["zebra", "Apple", "mango"]
    for image, label in zip(x, y):
        assert m["class_names"][label] == names[image[0, 0, 0]]


def test_jpeg_grayscale_and_resize(tmp_path):
    src = image_folder(tmp_path / "photos", train=4, test=0, size=(16, 12), fmt="jpg")
    out = tmp_path / "out"
    r = run_cli("prepare", "--source", src, "--out", out, "--shards", 2, "--image-size", "8,6",
                "--grayscale", "--test-fraction", "0.25")
    assert r.returncode == 0, r.stderr
    x, y, m = shard_arrays(out)
    assert x.shape[1:] == (8, 6) and m["image_shape"] == [8, 6]
    assert m["preprocess"]["mode"] == "L" and m["preprocess"]["resize"] == [8, 6]
    # What prepare stores is what decode() makes of the file (predict uses it).
    one = sorted((src / "train" / "cat").iterdir())[0]
    expected = np.asarray(Image.open(one).convert("L").resize((6, 8), Image.Resampling.BILINEAR))
    assert any(np.array_equal(image, expected) for image in x)
    # A folder whose images are all grayscale stays 2-D without --grayscale.
    gray = image_folder(tmp_path / "gray", train=3, test=1, rgb=False)
    m = data.prepare(gray, tmp_path / "out2", shards=1, log=quiet)
    assert m["image_shape"] == [12, 10] and m["preprocess"]["mode"] == "L"


def test_exif_orientation_is_applied(tmp_path):
    src = image_folder(tmp_path / "photos", train=2, test=0, size=(12, 10), fmt="jpg")
    # One more image, stored 10x12 but tagged "rotate 90": seen as 12x10, as the others.
    im = Image.fromarray(picture(0, 9, (10, 12)))
    exif = Image.Exif()
    exif[0x0112] = 6
    im.save(src / "train" / "cat" / "rotated.jpg", exif=exif)
    m = data.prepare(src, tmp_path / "out", shards=1, test_fraction=0, log=quiet)
    assert m["image_shape"] == [12, 10, 3] and m["train"]["num_samples"] == 7


def folder_refusals(tmp_path):
    """(name, source folder, extra flags, fragments of the one line)."""
    cases = []

    def case(name, *flags, fragments, make):
        src = tmp_path / name
        image_folder(src, train=3, test=1)
        make(src)
        cases.append((name, src, list(flags), fragments))

    def truncate(src):
        path = src / "train" / "dog" / "001.png"
        path.write_bytes(path.read_bytes()[:-40])   # the header whole, the pixels cut off
    case("truncated", fragments=["train/dog/001.png: unreadable image"], make=truncate)

    def garbage(src):
        (src / "train" / "cat" / "000.png").write_bytes(b"\x89PNG but not really" * 4)
    case("garbage", fragments=["train/cat/000.png: unreadable image"], make=garbage)

    def mixed(src):
        Image.fromarray(picture(1, 7, (14, 10))).save(src / "train" / "dog" / "big.png")
    case("mixed", fragments=["images of different sizes", "dog/big.png is 14x10", "--image-size H,W"], make=mixed)

    def empty(src):
        (src / "train" / "fox").mkdir()
        (src / "train" / "fox" / "readme.txt").write_text("no images")
    case("empty", fragments=["train/fox: an empty class"], make=empty)

    def one_class(src):
        import shutil
        for split in ("train", "test"):
            for name in ("dog", "emu"):
                shutil.rmtree(src / split / name)
    case("one", fragments=["one class folder (cat)", "at least two classes"], make=one_class)

    def outside(src):
        elsewhere = tmp_path / "elsewhere.png"
        Image.fromarray(picture(0, 5)).save(elsewhere)
        (src / "train" / "cat" / "005.png").symlink_to(elsewhere)
    case("outside", fragments=["train/cat/005.png: a symbolic link to", "outside the source folder"], make=outside)

    def link_up(src):
        (src / "train" / "cat" / "up").symlink_to("..")
    case("linkup", fragments=["train/cat/up: a symbolic link back up to", "(above this class folder)", "as cat"],
         make=link_up)

    def link_to_itself(src):
        (src / "train" / "emu" / "more").mkdir()
        (src / "train" / "emu" / "more" / "loop").symlink_to(src / "train" / "emu")
    case("linkself", fragments=["emu/more/loop: a symbolic link back up to", "(this class folder)"],
         make=link_to_itself)

    def link_across(src):
        (src / "train" / "cat" / "dogs").symlink_to("../dog")
    case("linkacross", fragments=["train/cat/dogs: a symbolic link to", "the class folder", "train/dog",
                                  "in two classes"], make=link_across)

    def class_folder_link(src):
        (src / "train" / "hound").symlink_to("dog")
    case("classlink", fragments=["train/dog and", "train/hound: one folder", "in two classes"],
         make=class_folder_link)

    def link_loop(src):
        (src / "train" / "cat" / "x").symlink_to("y")
        (src / "train" / "cat" / "y").symlink_to("x")
    case("linkloop", fragments=["train/cat/x: a symbolic link loop", "remove it"], make=link_loop)

    def dead_link(src):
        (src / "train" / "cat" / "gone.png").symlink_to("nowhere.png")
    case("deadlink", fragments=["train/cat/gone.png: a symbolic link to nowhere.png, which does not exist"],
         make=dead_link)

    def latin1(src):
        for split in ("train", "test"):
            os.rename(src / split / "dog", os.fsdecode(bytes(src / split) + b"/caf\xe9"))
    case("latin1", fragments=["train/caf\\xe9: a class folder whose name is not UTF-8", "rename it"], make=latin1)

    def flat(src, split):
        for folder in (src / "train").iterdir():
            folder.rename(src / folder.name)
        (src / "train").rmdir()
        (src / "test").rename(src / split)
    case("testbeside", fragments=["holds test/ beside class folders but no train/", "test/ would be taken as a class"],
         make=lambda src: flat(src, "test"))
    case("valbeside", fragments=["holds val/ beside class folders but no train/", "--val-fraction"],
         make=lambda src: flat(src, "val"))

    def stray_test_class(src):
        image_folder(src, classes=("cat", "dog", "emu", "gnu"), train=0, test=1)
    case("strayclass", fragments=["test/gnu: a test class that the training folder does not have"],
         make=stray_test_class)
    return cases


def test_bad_image_folders_are_one_line_exit_2_nothing_written(tmp_path, capsys):
    for i, (name, src, flags, fragments) in enumerate(folder_refusals(tmp_path)):
        out = tmp_path / f"out-{name}"
        run = run_cli if i == 0 else functools.partial(run_main, capsys)   # the command once, then its main
        refused(run("prepare", "--source", src, "--out", out, *flags), out, *fragments)


def test_links_inside_the_folder_are_followed(tmp_path):
    src = image_folder(tmp_path / "photos", train=3, test=0)
    (src / "train" / "cat" / "again.png").symlink_to(src / "train" / "dog" / "000.png")
    # Subfolders of a class folder are the class's too; a folder link to a
    # hidden folder (no class's) is followed. Links back up or into a class
    # folder are refused (folder_refusals).
    (src / "train" / "emu" / "more").mkdir()
    Image.fromarray(picture(2, 8)).save(src / "train" / "emu" / "more" / "x.png")
    (src / ".extra").mkdir()
    Image.fromarray(picture(2, 9)).save(src / ".extra" / "y.png")
    (src / "train" / "emu" / "extra").symlink_to("../../.extra")
    m = data.prepare(src, tmp_path / "out", shards=1, test_fraction=0, log=quiet)
    assert m["train"]["num_samples"] == 12 and m["train"]["per_class"] == {"0": 4, "1": 3, "2": 5}


def test_relative_paths_from_another_working_directory(tmp_path):
    # Every spelling of one folder prepares the same shards and the same
    # source digest (before, a relative --source failed after decoding
    # everything: "... is not in the subpath of ...").
    src = image_folder(tmp_path / "photos", train=3, test=1)
    (tmp_path / "data").mkdir()
    os.rename(src, tmp_path / "data" / "photos")
    (tmp_path / "link").symlink_to("data/photos")
    runs = [(tmp_path, "data/photos", "out1"), (tmp_path, "./data/photos", "./out2"),
            (tmp_path / "data", "photos", "../out3"), (tmp_path / "data" / "photos" / "test", "..", "../../../out4"),
            (tmp_path, "link", "out5")]
    digests = set()
    for cwd, source, out in runs:
        r = run_cli("prepare", "--source", source, "--out", out, "--shards", 2, cwd=cwd)
        assert r.returncode == 0, (source, r.stderr)
        x, y, m = shard_arrays(cwd / out)
        assert m["class_names"] == ["cat", "dog", "emu"] and len(y) == 9
        digests.add(json.dumps(m["source"]["files"]))
    assert len(digests) == 1 and '"name": "test"' in digests.pop()


def ramp16(path, shape=(4, 256)):
    """A 16-bit grayscale PNG (Pillow's "I;16") running 0..65535; returns its values."""
    values = np.linspace(0, 65535, np.prod(shape)).round().astype(np.uint16).reshape(shape)
    Image.fromarray(values).save(path)
    assert Image.open(path).mode == "I;16"
    return values


def test_16_bit_images_are_scaled_not_clipped(tmp_path):
    # Before, 0..65535 became 0, 255, 255, ...: Pillow's convert clips.
    src = tmp_path / "flat"
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
    values = [ramp16(src / c / f"{i}.png") for c in ("a", "b") for i in range(2)]
    m = data.prepare(src, tmp_path / "out", shards=1, test_fraction=0, log=quiet)
    x, _, _ = shard_arrays(tmp_path / "out")
    assert m["preprocess"]["mode"] == "L"
    expected = np.rint(values[0] * (255 / 65535)).astype(np.uint8)
    assert expected[0, 1] == 0 and expected[-1, -1] == 255 and len(np.unique(expected)) == 256
    for image in x:
        np.testing.assert_array_equal(image, expected)
    # Beside an RGB image, each channel of the ramp is scaled alike.
    Image.fromarray(np.zeros((4, 256, 3), np.uint8)).save(src / "b" / "rgb.png")
    m = data.prepare(src, tmp_path / "rgb", shards=1, test_fraction=0, log=quiet)
    x, y, _ = shard_arrays(tmp_path / "rgb")
    assert m["preprocess"]["mode"] == "RGB"
    ramps = [image for image in x if image.any()]
    assert len(ramps) == 4 and all(np.array_equal(image, np.stack([expected] * 3, -1)) for image in ramps)


def test_images_past_pillows_bomb_size_are_one_line(tmp_path):
    # A warning line of our own in place of Pillow's two (file:line and
    # "warnings.warn("); past twice that size, Pillow's error as one line.
    src = image_folder(tmp_path / "photos", train=2, test=0, rgb=False)
    Image.new("L", (9500, 9500)).save(src / "train" / "cat" / "big.png")   # 90 megapixels
    out = tmp_path / "out"
    r = run_cli("prepare", "--source", src, "--out", out, "--shards", 1, "--image-size", "8,8", "--test-fraction", 0)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [f"hpctrain: warning: 1 image over 89 megapixels, where Pillow warns of "
                                     f"decompression bombs (the largest: {src}/train/cat/big.png, 9500x9500, 90 "
                                     f"megapixels): decoding each takes about 0.3 GiB of memory"]
    Image.new("1", (13500, 13500)).save(src / "train" / "cat" / "big.png")   # 182 megapixels
    refused(run_cli("prepare", "--source", src, "--out", out.with_name("out2"), "--image-size", "8,8"),
            out.with_name("out2"), "train/cat/big.png: too large to decode safely",
            "exceeds limit of 178956970 pixels", "shrink the image")


def test_out_inside_the_image_folder_is_refused(tmp_path, capsys):
    # Before, it was written there, and every later prepare of the folder
    # found an empty class (the shards' folder).
    src = image_folder(tmp_path / "photos", train=3, test=0)
    here = functools.partial(run_main, capsys)   # the command once, then its main
    for out, run in ((src / "prepared", run_cli), (src / "train" / "cat" / "prepared", here)):
        refused(run("prepare", "--source", src, "--out", out), out,
                f"--out {out} is inside the image folder --source {src}", "write them elsewhere")
    assert run_cli("prepare", "--source", src, "--out", tmp_path / "prepared", "--shards", 1).returncode == 0


def test_force_replaces_only_a_prepared_dataset_or_an_empty_folder(tmp_path):
    src = image_folder(tmp_path / "photos", train=3, test=0)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    r = run_cli("prepare", "--source", src, "--out", mine, "--force")
    assert r.returncode == 2 and r.stderr == (f"hpctrain: error: {mine}: holds files but no manifest.json, so it "
                                              f"is not a prepared dataset; --force replaces only a prepared dataset "
                                              f"or an empty folder: choose another --out\n")
    assert [p.name for p in mine.iterdir()] == ["thesis.tex"]
    out = tmp_path / "out"
    for shards in (1, 2):   # the second replaces the first
        r = run_cli("prepare", "--source", src, "--out", out, "--shards", shards, "--force")
        assert r.returncode == 0, r.stderr
    assert len(json.loads((out / "manifest.json").read_text())["train"]["shards"]) == 2


# ---------------------------------------------------------------------------
# NumPy, HDF5, CSV

def digits(n=60, classes=4, shape=(6, 6), seed=0):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % classes
    x = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
    x.reshape(n, -1)[:, 0] = y   # the first pixel says the class
    return x, y


def test_npz_x_y_and_float_images_in_0_1(tmp_path):
    x, y = digits()
    np.savez(tmp_path / "a.npz", x=x.astype(np.float32) / 255, y=y.astype(np.int64))
    m = data.prepare(tmp_path / "a.npz", tmp_path / "out", shards=2, test_fraction=0.25, log=quiet)
    assert m["source"]["layout"] == "npz" and m["image_shape"] == [6, 6] and m["num_classes"] == 4
    assert m["preprocess"] == {"kind": "arrays", "pixel_scale": 1, "image_shape": [6, 6]}
    sx, sy, _ = shard_arrays(tmp_path / "out")
    tx, ty, _ = shard_arrays(tmp_path / "out", "test")
    got = np.concatenate([sx, tx])
    # Every image comes back as it was (x / 255 * 255, rounded), none twice.
    assert sorted(map(bytes, got)) == sorted(map(bytes, x))
    assert len(ty) == 16 and "class_names" not in m   # round(15 x 0.25) of each of 4 classes


def test_npz_with_keras_names_keeps_its_test_split(tmp_path):
    x, y = digits(80)
    np.savez_compressed(tmp_path / "mnist.npz", x_train=x[:60], y_train=y[:60].astype(np.uint8),
                        x_test=x[60:], y_test=y[60:].astype(np.uint8))
    m = data.prepare(tmp_path / "mnist.npz", tmp_path / "out", shards=3, log=quiet)
    assert m["train"]["num_samples"] == 60 and m["test"]["num_samples"] == 20 and m["test_fraction"] is None
    tx, ty, _ = shard_arrays(tmp_path / "out", "test")
    np.testing.assert_array_equal(tx, x[60:])
    np.testing.assert_array_equal(ty, y[60:])


def test_npy_pair_with_channels_first_and_channel_axis(tmp_path):
    x, y = digits(40, shape=(3, 5, 7))   # (N, C, H, W): PyTorch's layout
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y.astype(np.int32))
    r = run_cli("prepare", "--images", tmp_path / "x.npy", "--labels", tmp_path / "y.npy", "--out",
                tmp_path / "out", "--shards", 2)
    assert r.returncode == 0, r.stderr
    sx, _, m = shard_arrays(tmp_path / "out")
    assert m["image_shape"] == [5, 7, 3] and m["source"]["layout"] == "npy"
    tx, _, _ = shard_arrays(tmp_path / "out", "test")
    assert sorted(map(bytes, np.concatenate([sx, tx]))) == sorted(map(bytes, x.transpose(0, 2, 3, 1).copy()))
    # A channel axis of 1 is dropped: 2-D images, as MNIST's.
    np.save(tmp_path / "x1.npy", x[:, :1, :, :].transpose(0, 2, 3, 1))
    m = data.prepare(None, tmp_path / "out1", shards=2, images=tmp_path / "x1.npy", labels=tmp_path / "y.npy",
                     log=quiet)
    assert m["image_shape"] == [5, 7]


def test_hdf5_with_two_named_datasets(tmp_path):
    x, y = digits(50, shape=(8, 8, 3))
    with h5py.File(tmp_path / "set.h5", "w") as f:
        f["group/pixels"] = x
        f["group/classes"] = y.astype(np.int16)
        f["other"] = np.zeros(3)
    r = run_cli("prepare", "--source", tmp_path / "set.h5", "--images", "group/pixels", "--labels",
                "group/classes", "--out", tmp_path / "out", "--shards", 2)
    assert r.returncode == 0, r.stderr
    _, _, m = shard_arrays(tmp_path / "out")
    assert m["image_shape"] == [8, 8, 3] and m["source"]["layout"] == "hdf5"
    out = tmp_path / "out2"
    line = refused(run_cli("prepare", "--source", tmp_path / "set.h5", "--out", out), out)
    assert "group/classes, group/pixels, other" in line and "--images NAME --labels NAME" in line


@pytest.mark.parametrize("header", [True, False])
def test_csv_of_label_and_pixels(tmp_path, header):
    x, y = digits(40, shape=(4, 4))
    rows = np.c_[y, x.reshape(40, -1)]
    head = "label," + ",".join(f"pixel{i}" for i in range(16)) if header else ""
    np.savetxt(tmp_path / "t.csv", rows, fmt="%d", delimiter=",", header=head, comments="")
    m = data.prepare(tmp_path / "t.csv", tmp_path / "out", shards=2, log=quiet)
    assert m["image_shape"] == [4, 4] and m["num_classes"] == 4 and m["preprocess"]["header"] is header
    sx, sy, _ = shard_arrays(tmp_path / "out")
    tx, ty, _ = shard_arrays(tmp_path / "out", "test")
    assert sorted(map(bytes, np.concatenate([sx, tx]))) == sorted(map(bytes, x))
    # Rows that are not square need --image-size.
    wide = np.c_[x.reshape(40, -1), x.reshape(40, -1)[:, :4]]
    np.savetxt(tmp_path / "r.csv", np.c_[y, wide], fmt="%d", delimiter=",")
    m = data.prepare(tmp_path / "r.csv", tmp_path / "out2", shards=2, image_size=(4, 5), log=quiet)
    assert m["image_shape"] == [4, 5]


def test_csv_with_a_byte_order_mark_keeps_its_first_row(tmp_path):
    # Excel's "CSV UTF-8" starts with EF BB BF: the first row once read as a header and was lost.
    x, y = digits(40, shape=(4, 4))
    lines = "\n".join(",".join(map(str, row)) for row in np.c_[y, x.reshape(40, -1)])
    (tmp_path / "excel.csv").write_bytes(b"\xef\xbb\xbf" + lines.encode() + b"\n")
    m = data.prepare(tmp_path / "excel.csv", tmp_path / "out", shards=2, log=quiet)
    assert m["preprocess"]["header"] is False
    assert m["train"]["num_samples"] + m["test"]["num_samples"] == 40
    sx, _, _ = shard_arrays(tmp_path / "out")
    tx, _, _ = shard_arrays(tmp_path / "out", "test")
    assert sorted(map(bytes, np.concatenate([sx, tx]))) == sorted(map(bytes, x))
    # With a header after the mark, the header alone is skipped.
    (tmp_path / "head.csv").write_bytes(b"\xef\xbb\xbflabel," + ",".join(f"p{i}" for i in range(16)).encode()
                                        + b"\n" + lines.encode() + b"\n")
    m = data.prepare(tmp_path / "head.csv", tmp_path / "out2", shards=2, log=quiet)
    assert m["preprocess"]["header"] is True and m["train"]["num_samples"] + m["test"]["num_samples"] == 40


def array_refusals(tmp_path):
    x, y = digits(30)
    cases = []

    def npz(name, **arrays):
        np.savez(tmp_path / f"{name}.npz", **arrays)
        return tmp_path / f"{name}.npz"
    cases.append((["--source", npz("range", x=x, y=np.r_[y[:-1], 300])], ["label 300 in row 29 is out of range"]))
    cases.append((["--source", npz("neg", x=x, y=np.r_[-1, y[1:]])], ["label -1 in row 0 is out of range"]))
    cases.append((["--source", npz("frac", x=x, y=np.r_[y[:5], 0.5, y[6:]])], ["label 0.5 in row 5 is not an integer"]))
    cases.append((["--source", npz("short", x=x, y=y[:-2])], ["30 images but", "has 28 labels"]))
    cases.append((["--source", npz("one", x=x, y=np.zeros(30, int))], ["one class is nothing to classify"]))
    cases.append((["--source", npz("pickled", x=x, y=np.array([str(v) for v in y], object))],
                  ["hpctrain loads no pickled data"]))
    cases.append((["--source", npz("bright", x=x.astype(np.float32) * 2, y=y)], ["pixel values run from 0 to 510"]))
    cases.append((["--source", npz("onehot", x=x, y=np.eye(4)[y])], ["one-hot?"]))
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y[:20])
    cases.append((["--images", tmp_path / "x.npy", "--labels", tmp_path / "y.npy"], ["30 images but", "has 20 labels"]))
    (tmp_path / "ragged.csv").write_text("1,2,3,4,5\n0,1,2,3\n")
    cases.append((["--source", tmp_path / "ragged.csv"], ["ragged.csv: not a CSV of numbers"]))
    (tmp_path / "odd.csv").write_text("1," + ",".join(["7"] * 10) + "\n0," + ",".join(["9"] * 10) + "\n")
    cases.append((["--source", tmp_path / "odd.csv"], ["10 pixels per image is neither a square image",
                                                       "give --image-size H,W"]))
    (tmp_path / "header.csv").write_text("label,p1,p2,p3,p4\n")   # numpy's warning printed above the line
    cases.append((["--source", tmp_path / "header.csv"], ["header.csv: a header line and no rows"]))
    np.savetxt(tmp_path / "flat.csv", np.c_[y, x.reshape(30, -1)], fmt="%d", delimiter=",")
    # A size that starts with '-' once got argparse's 'expected one argument'; 1,1 was accepted.
    cases.append((["--source", tmp_path / "flat.csv", "--image-size", "-5,5"],
                  ["--image-size expects H,W (two positive integers), got '-5,5'"]))
    cases.append((["--source", tmp_path / "flat.csv", "--image-size", "1,36"],
                  ["--image-size 1,36: too small to train on; each side must be at least 4 pixels"]))
    np.save(tmp_path / "scalar.npy", np.array(7))   # 0-d arrays: a TypeError from len() once
    cases.append((["--images", tmp_path / "scalar.npy", "--labels", tmp_path / "y.npy"],
                  ["scalar.npy: a single number (a 0-d array), not one image per sample"]))
    with h5py.File(tmp_path / "scalar.h5", "w") as f:
        f["images"], f["labels"] = x, np.int64(3)
    cases.append((["--source", tmp_path / "scalar.h5"], ["scalar.h5[labels]: a single number (a 0-d array)"]))
    # A link named images was once reported missing ("none of images/labels"), not as a link.
    with h5py.File(tmp_path / "soft.h5", "w") as f:
        f["pixels"], f["labels"] = x, y
        f["images"] = h5py.SoftLink("/pixels")
    cases.append((["--source", tmp_path / "soft.h5"], ["soft.h5[images]: a soft link (to /pixels), not a dataset"]))
    with h5py.File(tmp_path / "external.h5", "w") as f:
        f["labels"] = y
        f["images"] = h5py.ExternalLink("soft.h5", "/pixels")
    cases.append((["--source", tmp_path / "external.h5"],
                  ["external.h5[images]: an external link (to soft.h5:/pixels), not a dataset stored in this file"]))
    (tmp_path / "cut.npz").write_bytes((tmp_path / "range.npz").read_bytes()[:200])
    cases.append((["--source", tmp_path / "cut.npz"], ["cut.npz: not an .npz file"]))
    (tmp_path / "notes.txt").write_text("hello")
    cases.append((["--source", tmp_path / "notes.txt"], ["notes.txt: a file, expected a directory"]))
    return cases


def test_bad_arrays_are_one_line_exit_2_nothing_written(tmp_path, capsys):
    for i, (flags, fragments) in enumerate(array_refusals(tmp_path)):
        out = tmp_path / f"out{i}"
        run = run_cli if i == 0 else functools.partial(run_main, capsys)   # the command once, then its main
        refused(run("prepare", *flags, "--out", out, "--shards", 2), out, *fragments)


def test_a_source_bigger_than_memory_is_refused_before_it_is_read(tmp_path, monkeypatch, capsys):
    x, y = digits(40, shape=(8, 8, 3))
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    np.savez(tmp_path / "a.npz", x=x, y=y)
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["images"], f["labels"] = x, y
    src = image_folder(tmp_path / "photos", train=3, test=1)
    monkeypatch.setattr(arrays_mod, "memory_available", lambda: 1000)

    def never(*args, **kwargs):
        raise AssertionError("read before the memory was checked")
    monkeypatch.setattr(np, "load", never)
    monkeypatch.setattr(np, "loadtxt", never)
    monkeypatch.setattr(data.images, "decode", never)
    np.savetxt(tmp_path / "a.csv", np.c_[y, x.reshape(40, -1)], fmt="%d", delimiter=",")
    for flags in (["--images", tmp_path / "x.npy", "--labels", tmp_path / "y.npy"], ["--source", tmp_path / "a.npz"],
                  ["--source", tmp_path / "a.h5"], ["--source", tmp_path / "a.csv"], ["--source", src]):
        out = tmp_path / "out"
        assert data_cli.main(["prepare", *map(str, flags), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "of memory to prepare, this machine has 0.0 GiB available" in err, err
        assert not out.exists()


def test_no_flip_is_recorded_only_when_asked(tmp_path):
    x, y = digits(40)
    np.savez(tmp_path / "a.npz", x=x, y=y)
    assert "no_flip" not in data.prepare(tmp_path / "a.npz", tmp_path / "o1", shards=2, log=quiet)
    assert data.prepare(tmp_path / "a.npz", tmp_path / "o2", shards=2, no_flip=True, log=quiet)["no_flip"] is True
    # IDX sources too (digits are the case for it), and their manifests are otherwise unchanged.
    plain = data.prepare(data.bundled_sample_dir(), tmp_path / "o3", shards=2, log=quiet)
    flipless = data.prepare(data.bundled_sample_dir(), tmp_path / "o4", shards=2, no_flip=True, log=quiet)
    assert {k: v for k, v in flipless.items() if k != "no_flip"} == plain and "preprocess" not in plain


def test_image_options_on_idx_sources_are_refused(tmp_path, capsys):
    out, here = tmp_path / "out", functools.partial(run_main, capsys)   # the command once, then its main
    refused(run_cli("prepare", "--source", data.bundled_sample_dir(), "--out", out, "--grayscale"), out,
            "--image-size and --grayscale are for image folders")
    refused(here("prepare", "--source", data.bundled_sample_dir(), "--out", out, "--image-size", "0,3"), out,
            "--image-size expects H,W")
    refused(here("prepare", "--source", tmp_path / "nowhere", "--out", out, "--image-size", "8,8"), out,
            "nowhere: no such directory")
