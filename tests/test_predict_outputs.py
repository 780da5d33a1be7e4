"""What predict and evaluate write: never one of their inputs (the model's
file, an image, anything in --data or a checkpoint folder, however the path
is spelt), never a device or FIFO put in its place, always whole (a
temporary file renamed), one line where it cannot be written, and one line
that says what was written.

    .venv/bin/python -m pytest -q tests/test_predict_outputs.py
"""
import hashlib
import os
import shutil
import stat

import pytest

from test_predict import in_process, one_line, photos, tool, trained_once   # noqa: F401 (fixtures)


def snapshot(folder):
    """Every name under folder: its kind and, for a file, its content's digest."""
    found = {}
    for top, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(top, name)
            st = os.lstat(path)
            digest = hashlib.sha256(open(path, "rb").read()).hexdigest() if stat.S_ISREG(st.st_mode) else None
            found[os.path.relpath(path, folder)] = (stat.S_IFMT(st.st_mode), digest)
    return found


@pytest.fixture
def inputs(trained_once, photos, tmp_path):   # noqa: F811
    """Copies an output could be pointed at: the --save file p.h5, a
    checkpoint folder, the prepared data, an image; links to them."""
    tmp, save, _ = trained_once
    shutil.copy(save, tmp_path / "p.h5")
    shutil.copytree(tmp / "ckpt1", tmp_path / "ckpt")
    shutil.copytree(photos[1], tmp_path / "data")
    shutil.copy(photos[0] / "test/red/001.png", tmp_path / "red.png")
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.h5").symlink_to(tmp_path / "p.h5")
    (tmp_path / "datalink").symlink_to("data")
    os.link(tmp_path / "p.h5", tmp_path / "hard.h5")
    os.link(tmp_path / "data" / "manifest.json", tmp_path / "m.json")
    return tmp_path


def test_an_output_that_is_one_of_the_inputs_is_refused_however_it_is_spelt(inputs, capsys, monkeypatch):
    ckpt = os.path.basename(sorted(os.listdir(inputs / "ckpt"))[-1])
    evaluate = ("evaluate", "--params", "p.h5", "--data", "data", "--plot")
    predict = ("predict", "--params", "p.h5", "red.png", "--out")
    the_params = "would overwrite the run's input p.h5 (the --params file)"

    def in_data(out, folder="data", what="the --data folder"):
        return f"would overwrite the run's input {out} (a file of {what} {folder})"
    cases = [(evaluate, "./p.h5", the_params), (evaluate, "sub/../p.h5", the_params),
             (evaluate, "link.h5", the_params), (evaluate, "hard.h5", the_params),
             (evaluate, inputs / "p.h5", the_params),
             (evaluate, "data/manifest.json", in_data("data/manifest.json")),
             (evaluate, "data/confusion.png",
              "would write inside the run's input data (the --data folder); name a path elsewhere"),
             (evaluate, "datalink/manifest.json", in_data("datalink/manifest.json")),
             (evaluate, "m.json", "would overwrite the run's input data/manifest.json (a file of the --data folder "
                                  "data; m.json is a hard link of it)"),
             # a checkpoint is a folder (the named default): an output inside --checkpoint's folder
             (("evaluate", "--checkpoint", "ckpt", "--data", "data", "--plot"), f"ckpt/{ckpt}",
              "would write inside the run's input ckpt (the --checkpoint folder); name a path elsewhere"),
             (("evaluate", "--checkpoint", f"ckpt/{ckpt}", "--data", "data", "--plot"), f"./ckpt/{ckpt}",
              f"would write into the run's input ckpt/{ckpt} (the --checkpoint folder)"),
             (predict, "p.h5", the_params), (predict, "hard.h5", the_params),
             (predict, "./red.png", "would overwrite the run's input red.png (an IMAGE to classify)"),
             (("predict", "--params", "p.h5", "--data", "data", "--out"), "data/manifest.json",
              in_data("data/manifest.json"))]
    monkeypatch.chdir(inputs)
    before = snapshot(inputs)
    for (name, *args, flag), out, says in cases:
        assert in_process(capsys, name, *args, flag, out) == (2, "", f"hpctrain: error: {flag} {out} {says}\n")
        assert snapshot(inputs) == before, (name, out)   # nothing replaced, nothing left behind


@pytest.mark.parametrize("kind", ["fifo", "char device", "symlink to a fifo"])
def test_an_output_onto_a_device_or_fifo_is_refused_and_left_in_place(trained_once, photos, tmp_path, kind):  # noqa: F811
    _, save, _ = trained_once
    path = tmp_path / kind.replace(" ", "-")
    if kind == "char device":
        if os.geteuid() != 0:
            pytest.skip("mknod of a character device needs root")
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))   # /dev/null's numbers, made here
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        os.mkfifo(tmp_path / "f")
        path.symlink_to(tmp_path / "f")
    what = "a character device" if kind == "char device" else "a FIFO"
    before = snapshot(tmp_path)
    for name, args, flag in (("predict", [photos[0] / "test/red/001.png"], "--out"),
                             ("evaluate", ["--data", photos[1]], "--plot")):
        line = one_line(tool(name, "--params", save, *args, flag, path))
        assert line == f"hpctrain: error: {flag} {path}: exists and is {what}, not a regular file; name a file"
        assert snapshot(tmp_path) == before


def test_an_output_where_nothing_can_be_written_is_one_line(trained_once, photos, tmp_path):  # noqa: F811
    _, save, _ = trained_once
    image = photos[0] / "test/red/001.png"
    line = one_line(tool("predict", "--params", save, image, "--out", "/proc/x.csv"))
    assert line.startswith("hpctrain: error: --out /proc/x.csv: cannot write in /proc (")
    line = one_line(tool("evaluate", "--params", save, "--data", photos[1], "--plot", "/proc/x.png"))
    assert line.startswith("hpctrain: error: --plot /proc/x.png: cannot write in /proc (")
    if os.geteuid() != 0:   # root writes in a folder without write permission
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        line = one_line(tool("predict", "--params", save, image, "--out", locked / "x.csv"))
        assert line.startswith(f"hpctrain: error: --out {locked / 'x.csv'}: cannot write in {locked} (")


def test_each_file_written_is_named_and_written_whole(trained_once, photos, tmp_path):  # noqa: F811
    _, save, _ = trained_once
    out, picture = tmp_path / "pred.csv", tmp_path / "confusion.png"
    out.write_text("an old prediction\n")
    os.chmod(out, 0o640)
    r = tool("predict", "--params", save, "--data", photos[1], "--out", out)
    assert r.returncode == 0 and r.stdout == f"wrote 24 predictions to {out}\n", r.stderr
    assert len(out.read_text().splitlines()) == 25 and stat.S_IMODE(os.stat(out).st_mode) == 0o640
    r = tool("evaluate", "--params", save, "--data", photos[1], "--json", "--plot", picture)
    assert r.returncode == 0 and r.stdout.startswith("{") and len(r.stdout.splitlines()) == 1
    assert r.stderr == f"wrote the confusion matrix to {picture}\n"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == ["confusion.png", "pred.csv"]   # no temporary left


def test_write_atomically_leaves_the_old_file_whole_when_writing_fails(tmp_path):
    from hpctrain.base.files import write_atomically
    path = tmp_path / "out.csv"
    path.write_text("old\n")
    os.chmod(path, 0o640)

    def fails(f):
        f.write("half of it")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError):
        write_atomically(path, fails)
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["out.csv"]
    write_atomically(path, lambda f: f.write("new\n"))
    assert path.read_text() == "new\n" and os.listdir(tmp_path) == ["out.csv"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
