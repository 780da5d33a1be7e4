"""A trained model used: a folder of real images prepared, trained on,
evaluated (the final record's numbers for the same file) and predicted on
(new image files brought to the model's input as prepare made the training
images); the --save file and checkpoints record how to rebuild the model;
mismatched file and data, or a bad image, is one line and exit 2.

    .venv/bin/python -m pytest -q tests/test_predict.py
"""
import importlib
import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
from PIL import Image

from conftest import REPO, copy_checkpoint, flat_from_named, run_job
from hpctrain.run.cluster import child_env
from hpctrain import data
from hpctrain.checkpoints import file as checkpoint
from hpctrain.checkpoints import read_back as reader

TINY = os.path.join(REPO, "tests", "models", "tiny_cnn.py")
COLOURS = {"blue": (30, 60, 220), "green": (40, 200, 60), "red": (220, 40, 40)}


def quiet(*args):
    pass


def photo(colour, i, size=(20, 16)):
    """A noisy picture of mostly one colour: learnable in a few steps."""
    rng = np.random.default_rng(i * 7 + sum(colour))
    a = np.clip(rng.normal(colour, 45, (*size, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(a)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """photos/train/{blue,green,red}/*.png (and .jpg), photos/test/...: 20x16 images,
    prepared at 10x8 (resized)."""
    base = tmp_path_factory.mktemp("photos")
    src = base / "photos"
    for split, n in (("train", 40), ("test", 8)):
        for name, colour in COLOURS.items():
            (src / split / name).mkdir(parents=True)
            for i in range(n):
                photo(colour, i + (1000 if split == "test" else 0)).save(
                    src / split / name / f"{i:03d}.{'jpg' if i % 4 == 0 else 'png'}")
    out = base / "shards"
    data.prepare(src, out, shards=2, image_size=(10, 8), log=quiet)
    return src, out


def train(tmp_path, shards, n=1, *flags, cwd=None):
    save = tmp_path / f"p{n}.h5"
    r = run_job(n, "--data", shards, "--hidden", "32", "--steps", "60", "--batch-size", str(16 // n), "--lr", "3e-3",
                "--log-every", "30", "--save", save, "--metrics", tmp_path / f"m{n}.jsonl",
                "--checkpoint-dir", tmp_path / f"ckpt{n}", *flags, module="hpctrain.train", timeout=180, cwd=cwd)
    assert r.returncode == 0, r.stderr
    final = json.loads((tmp_path / f"m{n}.jsonl").read_text().splitlines()[-1])
    assert final["event"] == "final"
    return save, final


def tool(name, *args, cwd=REPO):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", f"hpctrain.{name}", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=120)


def in_process(capsys, name, *args):
    """`hpctrain name args` run in this process (a new one per case takes
    seconds): (exit code, its standard output, its standard error)."""
    code = importlib.import_module(f"hpctrain.{name}").main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def here(capsys, name, *args):
    """in_process's run as a CompletedProcess, for one_line: a refusal
    there is main's one_line_errors, the same as the command's."""
    code, out, err = in_process(capsys, name, *args)
    return subprocess.CompletedProcess([name, *args], code, out, err)


def one_line(r):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpctrain: error: "), r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def trained_once(photos, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    return (tmp, *train(tmp, photos[1], 1))


def test_evaluate_gives_the_final_records_numbers_for_the_same_file(trained_once, photos):
    tmp, save, final = trained_once
    r = tool("evaluate", "--params", save, "--data", photos[1], "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert (got["accuracy"], got["loss"]) == (final["test_accuracy"], final["test_loss"])
    assert got["accuracy"] > 0.9 and got["num_samples"] == 24 and got["step"] == 60
    confusion = np.array(got["confusion"])
    assert confusion.sum() == 24 and np.trace(confusion) / 24 == pytest.approx(got["accuracy"], abs=1e-6)
    assert got["class_names"] == ["blue", "green", "red"]
    for c, name in enumerate(got["class_names"]):
        assert got["per_class_accuracy"][name] == round(confusion[c, c] / confusion[c].sum(), 6)
    # The final checkpoint holds the same model: the same numbers.
    r = tool("evaluate", "--checkpoint", tmp / "ckpt1", "--data", photos[1], "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["loss"] == final["test_loss"]
    # The table, and the confusion matrix as a picture.
    r = tool("evaluate", "--params", save, "--data", photos[1], "--plot", tmp / "confusion.png")
    assert r.returncode == 0, r.stderr
    assert f"test accuracy {final['test_accuracy']:.4f}  test loss {final['test_loss']:.4f}" in r.stdout
    assert "confusion matrix (rows: true class, columns: predicted class)" in r.stdout
    assert r.stdout.endswith(f"   (2)\nwrote the confusion matrix to {tmp / 'confusion.png'}\n")
    with Image.open(tmp / "confusion.png") as im:
        assert im.format == "PNG" and im.size[0] > 200
    # predict's probabilities come from the logits evaluate's loss is made of.
    from hpctrain.checkpoints import trained
    model = trained.load(params=save)
    x, y = data.load_test(photos[1], raw=True)
    logits = model.logits(x).astype(np.float64)
    logp = logits - logits.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    assert -logp[np.arange(len(y)), y].mean() == pytest.approx(final["test_loss"], abs=2e-6)


def test_evaluate_on_two_ranks_records_the_same_accuracy(photos, tmp_path):
    save, final = train(tmp_path, photos[1], 2)
    got = json.loads(tool("evaluate", "--params", save, "--data", photos[1], "--json").stdout)
    assert got["accuracy"] == final["test_accuracy"]
    assert got["loss"] == pytest.approx(final["test_loss"], abs=2e-6)   # two workers summed two parts


def test_predict_brings_image_files_to_the_input_as_prepare_did(trained_once, photos):
    tmp, save, _ = trained_once
    src, shards = photos
    files = [src / "test" / name / f"{i:03d}.{'jpg' if i % 4 == 0 else 'png'}" for name in COLOURS for i in range(8)]
    r = tool("predict", "--params", save, *files, "--format", "jsonl")
    assert r.returncode == 0, r.stderr
    from_files = [json.loads(line) for line in r.stdout.splitlines()]
    r = tool("predict", "--params", save, "--data", shards, "--format", "jsonl")
    assert r.returncode == 0, r.stderr
    from_data = [json.loads(line) for line in r.stdout.splitlines()]
    # prepare kept the test folder's order: the same images, resized alike, the same probabilities.
    assert [(a["class"], a["probability"]) for a in from_files] == [(b["class"], b["probability"]) for b in from_data]
    assert [a["input"] for a in from_files] == list(map(str, files))
    assert [b["label"] for b in from_data] == [name for name in COLOURS for _ in range(8)]
    right = sum(a["class"] == b["label"] for a, b in zip(from_files, from_data))
    assert right >= 22
    # CSV, --top, --out written whole; a checkpoint predicts the same.
    out = tmp / "pred.csv"
    r = tool("predict", "--checkpoint", tmp / "ckpt1", files[0], files[-1], "--top", "2", "--out", out)
    assert r.returncode == 0 and r.stdout == f"wrote 2 predictions to {out}\n", r.stderr
    lines = out.read_text().splitlines()
    assert lines[0] == "input,class,probability,class_2,probability_2"
    first = lines[1].split(",")
    assert first[:3] == [str(files[0]), from_files[0]["class"], f"{from_files[0]['probability']:.6f}"]
    assert float(first[2]) + float(first[4]) <= 1 + 1e-6


def test_a_new_image_of_another_size_and_mode_is_resized_and_converted(trained_once, photos, tmp_path):
    _, save, _ = trained_once
    big = tmp_path / "big.jpg"
    photo(COLOURS["green"], 5, size=(60, 48)).convert("L").convert("RGB").save(big)   # 60x48, gray-ish
    rgba = tmp_path / "red.png"
    photo(COLOURS["red"], 6, size=(30, 24)).convert("RGBA").save(rgba)
    r = tool("predict", "--params", save, rgba, "--format", "jsonl")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["class"] == "red"
    assert tool("predict", "--params", save, big).returncode == 0


def test_the_files_record_how_to_rebuild_the_model(trained_once, photos):
    tmp, save, _ = trained_once
    with h5py.File(save) as f:
        rec = json.loads(f.attrs["inference"])
    assert rec["model"] == "mlp" and rec["hidden"] == [32] and rec["input_shape"] == [10, 8, 3]
    assert rec["class_names"] == ["blue", "green", "red"] and rec["classes"] == 3
    assert rec["preprocess"]["resize"] == [10, 8] and rec["preprocess"]["mode"] == "RGB"
    assert rec["data"] == str(photos[1]) and len(rec["data_digest"]) == 16
    ckpt = reader.load_latest(tmp / "ckpt1", {})
    assert json.loads(ckpt.attrs["inference"]) == rec


def test_a_users_model_file_is_run_only_where_the_command_line_names_it(photos, tmp_path):
    model = tmp_path / "mine.py"
    shutil.copy(TINY, model)
    # A relative path, as users type it: the record makes it absolute.
    save, final = train(tmp_path, photos[1], 1, "--model", "mine.py:without_batch_norm", cwd=tmp_path)
    with h5py.File(save) as f:
        assert json.loads(f.attrs["inference"])["model"] == f"{model}:without_batch_norm"
    # A shared --save file can name any file: one that marks its import is never run on the record's word.
    planted = tmp_path / "planted.py"
    planted.write_text("open(__file__ + '.ran', 'w').close()\n" + model.read_text())
    shared = tmp_path / "shared.h5"
    shutil.copy(save, shared)
    with h5py.File(shared, "a") as f:
        rec = json.loads(f.attrs["inference"])
        f.attrs["inference"] = json.dumps(dict(rec, model=f"{planted}:without_batch_norm"))
    image = photos[0] / "test/red/001.png"
    for name, *args in (("evaluate", "--data", photos[1]), ("predict", image)):
        line = one_line(tool(name, "--params", shared, *args))
        assert line == (f"hpctrain: error: {shared}: was trained from a user's model file, {planted}:without_batch_"
                        f"norm; predict and evaluate run no code that a saved file names: pass --model {planted}:"
                        f"without_batch_norm to rebuild it with that file (it runs as Python: a file you trust)")
    assert not (tmp_path / "planted.py.ran").exists()
    # Named on the command line, relative to another folder: the final record's numbers.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = tool("evaluate", "--params", save, "--data", photos[1], "--json", "--model", "../mine.py:without_batch_norm",
             cwd=elsewhere)
    assert r.returncode == 0 and json.loads(r.stdout)["loss"] == final["test_loss"], r.stderr
    moved = tmp_path / "moved.py"
    model.rename(moved)
    r = tool("evaluate", "--params", save, "--data", photos[1], "--json", "--model", f"{moved}:without_batch_norm")
    assert r.returncode == 0 and json.loads(r.stdout)["loss"] == final["test_loss"]
    line = one_line(tool("evaluate", "--params", save, "--data", photos[1], "--model", f"{moved}:build"))
    assert "was saved from model" in line
    line = one_line(tool("predict", "--params", save, image, "--model", "vgg"))
    assert line == "hpctrain: error: --model vgg: not a model of the zoo (mlp, lenet, cnn, resnet, small_cnn) nor " \
                   "FILE.py:FUNCTION"


def test_mismatched_file_and_data_are_one_line_exit_2(trained_once, photos, tmp_path, capsys):
    tmp, save, _ = trained_once
    src, shards = photos
    # The same images at another size; four classes; other class names.
    data.prepare(src, tmp_path / "small", shards=2, image_size=(8, 8), log=quiet)
    line = one_line(here(capsys, "evaluate", "--params", save, "--data", tmp_path / "small"))
    assert "8x8x3 images of 3 classes, but the model in" in line and "takes 10x8x3 images of 3 classes" in line
    four = tmp_path / "four"
    shutil.copytree(src, four)
    for split in ("train", "test"):
        shutil.copytree(four / split / "red", four / split / "yellow")
    data.prepare(four, tmp_path / "four-shards", shards=2, image_size=(10, 8), log=quiet)
    assert "of 4 classes, but the model" in one_line(here(capsys, "predict", "--params", save, "--data",
                                                          tmp_path / "four-shards"))
    renamed = tmp_path / "renamed"
    shutil.copytree(src, renamed)
    for split in ("train", "test"):
        (renamed / split / "red").rename(renamed / split / "scarlet")
    data.prepare(renamed, tmp_path / "renamed-shards", shards=2, image_size=(10, 8), log=quiet)
    line = one_line(here(capsys, "evaluate", "--params", save, "--data", tmp_path / "renamed-shards"))
    assert "classes blue, green, scarlet, but the model in" in line
    # A file of another model's parameters; not a parameters file at all; a missing image.
    other = tmp_path / "other.h5"
    shutil.copy(save, other)
    with h5py.File(other, "a") as f:
        del f["layer0/W"]
        f["layer0/W"] = np.zeros((5, 32), np.float32)
    line = one_line(here(capsys, "predict", "--params", other, src / "test/red/001.png"))
    assert "layer0/W is (5, 32), model mlp needs (240, 32)" in line
    (tmp_path / "junk.h5").write_bytes(b"not hdf5")
    line = one_line(here(capsys, "predict", "--params", tmp_path / "junk.h5", src / "test/red/001.png"))
    assert "junk.h5: not a readable --save file" in line
    out = tmp_path / "never.csv"
    broken = tmp_path / "broken.png"
    broken.write_bytes((src / "test/red/001.png").read_bytes()[:-30])
    line = one_line(here(capsys, "predict", "--params", save, src / "test/red/001.png", broken, "--out", out))
    assert "broken.png: unreadable image" in line and not out.exists()
    assert "no such file" in one_line(here(capsys, "predict", "--params", save, tmp_path / "nothing.png"))
    assert "give IMAGE files or --data DIR" in one_line(here(capsys, "predict", "--params", save))


def test_an_image_model_on_text_is_one_line_in_every_command(trained_once, tmp_path, capsys):
    """Issue 54, item 5: the image model's --save file and checkpoint given
    prepared text, in data/fit.py's words (the GPT's side: test_generate.py)."""
    tmp, save, _ = trained_once
    (tmp_path / "t.txt").write_text("To be, or not to be\n" * 20, encoding="utf-8")
    data.prepare_text(str(tmp_path / "t.txt"), str(tmp_path / "t"), "chars", log=quiet)
    says = f"is an image model and data {tmp_path / 't'} holds text: an image model cannot read text\n"
    for name, source in (("evaluate", ("--params", save)), ("predict", ("--params", save)),
                         ("evaluate", ("--checkpoint", tmp / "ckpt1"))):
        code, out, err = in_process(capsys, name, *source, "--data", tmp_path / "t")
        assert code == 2 and out == "" and err.startswith("hpctrain: error: model ") and err.endswith(says), err


def test_a_file_from_before_the_record_loads_with_its_data(trained_once, photos, tmp_path, capsys):
    _, save, _ = trained_once
    old = tmp_path / "old.h5"
    shutil.copy(save, old)
    with h5py.File(old, "a") as f:
        del f.attrs["inference"]
    line = one_line(here(capsys, "predict", "--params", old, photos[0] / "test/red/001.png"))
    assert "did not record how to rebuild the model; give --data DIR" in line
    r = tool("evaluate", "--params", old, "--data", photos[1], "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["class_names"] == ["blue", "green", "red"]
    # given text, it is an image model as every command says (data/fit.py; issue 54, item 5)
    (tmp_path / "t.txt").write_text("To be, or not to be\n" * 20, encoding="utf-8")
    data.prepare_text(str(tmp_path / "t.txt"), str(tmp_path / "t"), "chars", log=quiet)
    assert one_line(here(capsys, "predict", "--params", old, "--data", tmp_path / "t")) == (
        f"hpctrain: error: model {old} is an image model and data {tmp_path / 't'} holds text: an image model "
        f"cannot read text")


def readme_image_commands():
    """README's image-folder commands, as written there (one shell script)."""
    lines = open(os.path.join(REPO, "README.md")).read().splitlines()
    start = lines.index("    hpctrain data prepare --source photos --image-size 32,32 --out data/photos")
    end = lines.index("", start)
    return "\n".join(line[4:] for line in lines[start:end])


def test_readmes_image_folder_commands_run_as_written_from_another_directory(photos, tmp_path):
    # Relative paths from a working directory of the user's (before, prepare
    # failed on every relative --source: "... is not in the subpath of ...").
    # Only the length of the run and its rank count are changed.
    script = readme_image_commands()
    assert script.count("\n") == 4 and "--epochs 10" in script and "mpirun -n 4" in script
    script = script.replace("--epochs 10", "--steps 2").replace("mpirun -n 4", "mpirun -n 1")
    shutil.copytree(photos[0], tmp_path / "photos")
    shutil.copy(photos[0] / "test" / "red" / "000.jpg", tmp_path / "my-cat.jpg")
    env = child_env()
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    r = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "data" / "photos" / "manifest.json").is_file() and (tmp_path / "confusion.png").is_file()
    assert r.stdout.splitlines()[-2:][0] == "input,class,probability"
    assert r.stdout.splitlines()[-1].startswith("my-cat.jpg,")


def test_16_bit_images_are_scaled_as_prepare_scales_them(trained_once, tmp_path):
    # A 0..65535 ramp predicts as its 8-bit equal (before: clipped to white).
    _, save, _ = trained_once
    values = np.linspace(0, 65535, 20 * 16).round().astype(np.uint16).reshape(20, 16)
    Image.fromarray(values).save(tmp_path / "ramp16.png")
    Image.fromarray(np.rint(values * (255 / 65535)).astype(np.uint8)).save(tmp_path / "ramp8.png")
    r = tool("predict", "--params", save, tmp_path / "ramp16.png", tmp_path / "ramp8.png", "--format", "jsonl",
             "--top", "3")
    assert r.returncode == 0, r.stderr
    sixteen, eight = [json.loads(line) for line in r.stdout.splitlines()]
    assert sixteen["top"] == eight["top"]
    # A float image (TIFF) says nothing of its range: one line.
    Image.fromarray(values.astype(np.float32)).save(tmp_path / "float.tif")
    line = one_line(tool("predict", "--params", save, tmp_path / "float.tif"))
    assert "float.tif: a floating-point image, whose range of values the file does not say" in line


def test_an_image_past_pillows_bomb_size_is_one_warning_line(trained_once, tmp_path):
    _, save, _ = trained_once
    Image.new("L", (9500, 9500)).save(tmp_path / "big.png")
    r = tool("predict", "--params", save, tmp_path / "big.png")
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [f"hpctrain: warning: 1 image over 89 megapixels, where Pillow warns of "
                                     f"decompression bombs (the largest: {tmp_path}/big.png, 9500x9500, 90 "
                                     f"megapixels): decoding each takes about 0.3 GiB of memory"]


def damaged_copy(save, tmp_path, name, change):
    """A copy of save, change(h5py file) applied to it."""
    path = tmp_path / f"{name}.h5"
    shutil.copy(save, path)
    with h5py.File(path, "a") as f:
        change(f)
    return path


def set_record(**fields):
    def change(f):
        rec = json.loads(f.attrs["inference"])
        f.attrs["inference"] = json.dumps(dict(rec, **fields) if fields.get("_whole") is None else fields["_whole"])
    return change


def replace_tensor(make):
    def change(f):
        new = make(f)
        del f["layer0/W"]
        f["layer0/W"] = new
    return change


def without_shape(f):
    rec = json.loads(f.attrs["inference"])
    del rec["input_shape"]
    f.attrs["inference"] = json.dumps(rec)


def soft_link(f):
    f["elsewhere"] = f["layer0/W"][()]
    return h5py.SoftLink("/elsewhere")


DAMAGED = {
    "a list": (set_record(_whole=[1, 2]), "damaged 'inference' record (a JSON list, not an object)"),
    "no input_shape": (without_shape, "damaged 'inference' record ('input_shape' is null, not the shape of an image"),
    "an absurd input_shape": (set_record(input_shape=[100000, 100000, 3]),
                              "('input_shape' is [100000, 100000, 3], not the shape of an image"),
    "a negative input_shape": (set_record(input_shape=[-10, 8, 3]), "('input_shape' is [-10, 8, 3], not the shape"),
    "classes as text": (set_record(classes="three"), "('classes' is \"three\", not a class count"),
    "classes a fraction": (set_record(classes=3.5), "('classes' is 3.5, not a class count"),
    "hidden as text": (set_record(hidden="32"), "('hidden' is \"32\", not a list of layer widths)"),
    "a model that is a number": (set_record(model=5), "('model' is 5, not a model of the zoo nor FILE.py:FUNCTION)"),
    "an unknown model": (set_record(model="vgg"), "('model' is \"vgg\", not a model of the zoo"),
    "class names not text": (set_record(class_names=[1, 2, 3]), "('class_names' is not a list of names)"),
    "step as text": (lambda f: f.attrs.__setitem__("step", "sixty"), "attribute step is \"sixty\", not a step number"),
    "a tensor of strings": (replace_tensor(lambda f: np.full((240, 32), "x", dtype="S1")),
                            "layer0/W holds |S1 values, not floating-point numbers"),
    "an external link": (replace_tensor(lambda f: h5py.ExternalLink(f.filename + ".other", "layer0/W")),
                         "layer0/W is an external link, not a dataset stored in the file; hpctrain writes no such "
                         "--save file"),
    "a soft link": (replace_tensor(soft_link), "layer0/W is a soft link, not a dataset stored in the file"),
    "a record of bytes that are not UTF-8": (lambda f: f.attrs.__setitem__("inference", np.bytes_(b"\xff{")),
                                             "damaged 'inference' attribute; save the model again"),
    "a record nested past what json parses": (lambda f: f.attrs.__setitem__("inference", "[" * 10**5 + "]" * 10**5),
                                              "damaged 'inference' attribute; save the model again"),
    "step an array": (lambda f: f.attrs.__setitem__("step", np.arange(3)), "attribute step is \"[0 1 2]\", not a "
                                                                           "step number"),
    "a chunked tensor": (replace_tensor(lambda f: h5py.Dataset(f.create_dataset(
        "chunked", data=np.zeros((240, 32), np.float32), chunks=(10, 32)).id)),
        "dataset layer0/W is not stored contiguously in the file (chunked, virtual or external storage)"),
    "a model larger than the file": (set_record(input_shape=[16384, 16384, 1]),
                                     "model mlp of 16384x16384x1 inputs has 8,589,934,723 parameters, more than "
                                     "the file's"),
    "a non-finite parameter": (lambda f: f["layer0/W"].__setitem__((0, 0), np.nan),
                               "1 of its 7,811 parameters are not finite (nan or inf): saved from a run that "
                               "diverged, or damaged"),
    "an infinite parameter": (lambda f: f["layer1/b"].__setitem__(1, -np.inf), "1 of its 7,811 parameters are "
                                                                               "not finite"),
}


@pytest.mark.parametrize("damage", list(DAMAGED))
def test_a_damaged_save_file_is_one_line_for_predict_and_evaluate(trained_once, photos, tmp_path, capsys, damage):
    _, save, _ = trained_once
    change, says = DAMAGED[damage]
    path = damaged_copy(save, tmp_path, "damaged", change)
    for name, *args in (("predict", photos[0] / "test/red/001.png"), ("evaluate", "--data", photos[1], "--json")):
        code, out, err = in_process(capsys, name, "--params", path, *args)
        assert code == 2 and out == "" and err.startswith(f"hpctrain: error: {path}: ") and says in err, (name, err)
        assert err.count("\n") == 1


def test_a_model_too_large_for_memory_is_refused_before_it_is_built(trained_once, tmp_path):
    _, save, _ = trained_once
    # 2^40 parameters in a (sparse) file that could hold them: 8 TiB to build, more than any test machine has.
    path = damaged_copy(save, tmp_path, "huge", set_record(input_shape=[16384, 16384, 1], hidden=[4096]))
    try:
        os.truncate(path, 2 ** 42 + 2 ** 30)
    except OSError as e:
        pytest.skip(f"this file system takes no sparse 4 TiB file ({e.strerror})")
    line = one_line(tool("predict", "--params", path, tmp_path / "any.png"))
    assert "model mlp needs 8192.0 GiB of memory to rebuild, this machine has" in line


def test_a_class_name_with_control_characters_keeps_the_table_one_row_per_class(trained_once, photos):
    from hpctrain import evaluate
    from hpctrain.checkpoints import trained
    _, save, _ = trained_once
    model = trained.load(params=save)
    model.class_names = ["blue", "gre\nen", "red\x1b[0m"]
    x, y = data.load_test(photos[1], raw=True)
    table = evaluate.lines(dict(evaluate.evaluate(model, x, y), split="test"), "test")
    assert len(table) == 12 and all(line.isprintable() for line in table)
    assert table[4].startswith("gre\\nen  ") and table[-1].startswith("red\\x1b[0m") and table[-1].endswith("(2)")


def test_a_checkpoint_folder_of_corrupt_files_says_why_each_was_skipped(trained_once, photos, tmp_path):
    tmp, _, final = trained_once
    # old flat files (one file to corrupt, copy, rename), of the run's newest checkpoint
    newest = flat_from_named(copy_checkpoint(checkpoint.list_checkpoints(tmp / "ckpt1")[0][1], tmp_path))
    name = newest.name
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(newest, folder / name)
    older = folder / "ckpt-00000030.h5"
    shutil.copy(newest, older)   # a renamed copy, skipped
    with open(folder / name, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        f.write(b"\0" * 10)
    line = one_line(tool("evaluate", "--checkpoint", folder, "--data", photos[1]))
    assert line == (f"hpctrain: error: {folder}: none of its 2 checkpoint files is valid: {name}: corrupt (checksum "
                    f"mismatch); ckpt-00000030.h5: its name says step 30 but it holds step 60 (a renamed copy?), "
                    f"skipped")
    # With a valid one behind the corrupt one: a warning, and the valid one evaluated.
    older.unlink()
    (folder / name).rename(folder / "ckpt-00000090.h5")
    shutil.copy(newest, folder / name)
    r = tool("evaluate", "--checkpoint", folder, "--data", photos[1], "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["loss"] == final["test_loss"]
    assert r.stderr == "hpctrain: warning: ckpt-00000090.h5: corrupt (checksum mismatch), trying the previous one\n"
