"""--model FILE.py:FUNCTION: a user's own model file trains (examples/), and
every way it can be wrong is one `hpctrain: error:` line naming the file
and the problem, exit 2, on the whole job, no hang; resume refuses a
checkpoint of another model with one line naming both.

    .venv/bin/python -m pytest -q tests/test_user_models.py
"""
import os

import h5py
import pytest

from conftest import REPO

EXAMPLE = os.path.join(REPO, "examples", "custom_model.py")


def test_the_example_model_trains_and_is_saved_with_its_identity(job, tmp_path):
    r = job(2, "--model", f"{EXAMPLE}:build", "--steps", "30", "--log-every", "15", "--save", tmp_path / "p.h5")
    assert r.returncode == 0, r.stderr
    assert "model " in r.stdout and "LeakyReLU(0.1)" in r.stdout and "109,386 parameters" in r.stdout
    with h5py.File(tmp_path / "p.h5", "r") as f:
        assert sorted(f) == ["layer0", "layer1", "layer2"]
        assert f.attrs["model"].startswith("custom_model.py:build ")


BAD = {
    "no such file": ("", "nowhere.py:build", "nowhere.py is not a file"),
    "no such function": ("def other(shape, classes):\n    return []\n", None, "defines no function 'build'"),
    "the user's code raises": ("def build(shape, classes):\n    return helper(shape)\n\n"
                               "def helper(shape):\n    raise RuntimeError('my bug')\n", None,
                               "raised RuntimeError: my bug"),
    "the import raises": ("import no_such_module_here\n", None, "raised ModuleNotFoundError"),
    "not a list": ("def build(shape, classes):\n    return None\n", None, "returned NoneType, not a non-empty list"),
    "not a layer": ("def build(shape, classes):\n    return [3]\n", None, "item 0 is a int, not a layer"),
    "a Dense on an image": ("from hpctrain.nn import Dense\n\ndef build(shape, classes):\n"
                            "    return [Dense(classes)]\n", None, "takes a flat input, not 28x28: put Flatten()"),
    "the wrong class count": ("from hpctrain.nn import Dense, Flatten\n\ndef build(shape, classes):\n"
                              "    return [Flatten(), Dense(7)]\n", None, "gives 7 outputs per sample, the data has 10"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_user_model_is_one_line_and_exit_2(job, tmp_path, case):
    source, value, expect = BAD[case]
    if value is None:
        (tmp_path / "mine.py").write_text(source)
        value = f"{tmp_path / 'mine.py'}:build"
    else:
        value = str(tmp_path / value)
    r = job(2, "--model", value, "--steps", "5", "--save", tmp_path / "p.h5", timeout=60)
    errors = [line for line in r.stderr.splitlines() if line.startswith("hpctrain: error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr
    assert expect in errors[0] and (value in errors[0] or "--model" in errors[0]), errors
    assert not (tmp_path / "p.h5").exists()
    if case == "the user's code raises":
        # their bug to fix: their traceback, once (the chief's), above the line
        assert r.stderr.count("Traceback (most recent call last)") == 1 and "in helper" in r.stderr, r.stderr


def test_a_bad_model_name_is_a_flag_error(job):
    r = job(1, "--model", "resnet152", "--steps", "5", timeout=60)
    assert r.returncode == 2 and "--model" in r.stderr and "FILE.py:FUNCTION" in r.stderr, r.stderr


def test_resume_refuses_a_checkpoint_of_another_model_naming_both(job, tmp_path):
    ckpt = ["--checkpoint-dir", tmp_path / "ckpt", "--hidden", "32", "--log-every", "10"]
    assert job(2, "--steps", "10", *ckpt).returncode == 0
    r = job(2, "--steps", "20", "--model", f"{EXAMPLE}:build", *ckpt, timeout=60)
    errors = [line for line in r.stderr.splitlines() if line.startswith("hpctrain: error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr
    assert "--model mlp" in errors[0] and "custom_model.py:build" in errors[0], errors


def test_the_flag_names_every_model_of_the_zoo():
    from hpctrain import cli
    from hpctrain.nn import zoo
    assert list(cli.MODELS) == list(zoo.MODELS)
