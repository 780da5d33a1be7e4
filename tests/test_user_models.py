"""--model FILE.py:FUNCTION: a user's own model file trains (examples/), and
every way it can be wrong is one `hpctrain: error:` line naming the file
and the problem, exit 2, on the whole job, no hang; resume refuses a
checkpoint of another model with one line naming both.

    .venv/bin/python -m pytest -q tests/test_user_models.py
"""
import json
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
    "not a list": ("def build(shape, classes):\n    return None\n", None, "returned NoneType, not a list of layers"),
    "an empty list": ("def build(shape, classes):\n    return []\n", None,
                      "build returned an empty list: a model needs at least one layer"),
    "sys.exit at import": ("import sys\nsys.exit(0)\n", None, "called sys.exit(0): a model file must not end"),
    "its own argparse at import": ("import argparse\nargparse.ArgumentParser().parse_args(['--bogus'])\n", None,
                                   "called sys.exit(2): a model file must not end the process"),
    "a layer that writes into its input undeclared": (
        "from hpctrain.nn import Dense, Flatten, Layer\n\n\nclass Leaky(Layer):\n"
        "    def forward(self, ctx, x, train):\n        x *= 0.5\n        return x\n\n\n"
        "def build(shape, classes):\n    return [Flatten(), Dense(8), Leaky(), Dense(classes)]\n", None,
        "layer 2 (Leaky): forward wrote into its input but the layer does not declare inplace = True"),
    "a layer whose init raises": (
        "from hpctrain.nn import Dense, Flatten\n\n\nclass Mine(Dense):\n"
        "    def init(self, rng, params, dtype):\n        raise ValueError('no init')\n\n\n"
        "def build(shape, classes):\n    return [Flatten(), Mine(classes)]\n", None,
        "layer 1 (Dense(10)): init raised ValueError: no init"),
    "not a layer": ("def build(shape, classes):\n    return [3]\n", None, "item 0 is a int, not a layer"),
    "a Dense on an image": ("from hpctrain.nn import Dense\n\ndef build(shape, classes):\n"
                            "    return [Dense(classes)]\n", None,
                            "gives 28x10 outputs per sample, the data has 10 classes: put Flatten()"),
    "the wrong class count": ("from hpctrain.nn import Dense, Flatten\n\ndef build(shape, classes):\n"
                              "    return [Flatten(), Dense(7)]\n", None, "gives 7 outputs per sample, the data has 10"),
    "a loss that is not a loss": ("from hpctrain.nn import Dense, Flatten\n\ndef build(shape, classes):\n"
                                  "    return [Flatten(), Dense(classes)], 'mse'\n", None,
                                  "build returned (layers, str): the second item is not a loss"),
    "a loss whose forward_backward raises": (
        "from hpctrain.nn import ClassCrossEntropy, Dense, Flatten\n\n\nclass Mine(ClassCrossEntropy):\n"
        "    def forward_backward(self, ctx, logits, targets):\n        raise ValueError('no loss')\n\n\n"
        "def build(shape, classes):\n    return [Flatten(), Dense(classes)], Mine()\n", None,
        "the loss (Mine): forward_backward raised ValueError: no loss"),
    "a first layer that takes tokens": (
        "from hpctrain.nn import Dense, Flatten\n\n\nclass Tokens(Flatten):\n    input_kind = 'tokens'\n\n\n"
        "def build(shape, classes):\n    return [Tokens(), Dense(classes)]\n", None,
        "is a language model and --data "),
}


# The whole job for a refusal of each kind (a file that is not there, a
# user's file that ends the process, the user's own traceback, a layer's
# contract, a model that does not fit the data, a model for other data);
# the rest in-process below, through start-up's own model_spec.
ON_THE_JOB = ("no such file", "the user's code raises", "sys.exit at import", "its own argparse at import",
              "a layer that writes into its input undeclared", "a layer whose init raises", "the wrong class count",
              "a first layer that takes tokens")


def user_model(tmp_path, case):
    """The --model value of BAD's `case` (its file written under tmp_path)."""
    source, value, _ = BAD[case]
    if value is None:
        (tmp_path / "mine.py").write_text(source)
        return f"{tmp_path / 'mine.py'}:build"
    return str(tmp_path / value)


@pytest.mark.parametrize("case", [case for case in BAD if case not in ON_THE_JOB])
def test_a_bad_user_model_is_refused_by_the_start_up_checks(tmp_path, case):
    """The line run/startup.py's model_spec gives every rank for the data's shape."""
    from hpctrain.base.errors import HpctrainError
    from hpctrain.flags import cli
    from hpctrain.run.startup import model_spec
    value, expect = user_model(tmp_path, case), BAD[case][2]
    with pytest.raises(HpctrainError) as refused:
        model_spec(cli.parse(["--model", value, "--steps", "5"], quiet=True), ((28, 28), 10))
    line = str(refused.value)
    assert expect in line and (value in line or "--model" in line) and "\n" not in line, line


@pytest.mark.parametrize("case", ON_THE_JOB)
def test_a_bad_user_model_is_one_line_and_exit_2(job, tmp_path, case):
    value, expect = user_model(tmp_path, case), BAD[case][2]
    r = job(2, "--model", value, "--steps", "5", "--save", tmp_path / "p.h5", "--metrics", tmp_path / "m.jsonl",
            "--checkpoint-dir", tmp_path / "ckpt", timeout=60)
    errors = [line for line in r.stderr.splitlines() if line.startswith("hpctrain: error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr
    assert expect in errors[0] and (value in errors[0] or "--model" in errors[0]), errors
    assert not (tmp_path / "p.h5").exists()
    if case.startswith("a layer"):
        assert "--metrics" not in r.stderr
    if case in ("the user's code raises", "a layer whose init raises"):
        # their bug to fix: their traceback, once (the chief's), above the line
        assert r.stderr.count("Traceback (most recent call last)") == 1, r.stderr
        assert "in helper" in r.stderr or "in init" in r.stderr, r.stderr
    # outputs are checked (and made) only once the model is: nothing is left behind
    assert not (tmp_path / "m.jsonl").exists() and not (tmp_path / "ckpt").exists()


LOSS_MODEL = ("from hpctrain.nn import ClassCrossEntropy, Dense, Flatten, ReLU\n\n\n"
              "class Doubled(ClassCrossEntropy):\n"
              "    def sums(self, ctx, logits, targets):\n"
              "        sums = super().sums(ctx, logits, targets)\n"
              "        return dict(sums, loss=2 * sums['loss'])\n\n"
              "    def describe(self):\n        return 'doubled cross-entropy'\n\n\n"
              "def build(shape, classes):\n    return [Flatten(), Dense(16), ReLU(), Dense(classes)]{loss}\n")


def test_a_model_file_naming_its_loss_trains_and_evaluates_with_it(job, tmp_path):
    """(layers, loss) from FUNCTION: the loss is the model's, shown in the
    summary; its training arithmetic (inherited) is the default's to the bit,
    and evaluation reports its own sums (here the loss doubled)."""
    finals = {}
    for name, loss in (("plain", ""), ("own", ", Doubled()")):
        (tmp_path / f"{name}.py").write_text(LOSS_MODEL.format(loss=loss))
        r = job(2, "--model", f"{tmp_path / name}.py:build", "--steps", "12", "--save", tmp_path / f"{name}.h5",
                "--metrics", tmp_path / f"{name}.jsonl")
        assert r.returncode == 0, r.stderr
        assert ("loss doubled cross-entropy" in r.stdout) == (name == "own"), r.stdout
        with open(tmp_path / f"{name}.jsonl") as f:
            finals[name] = [json.loads(line) for line in f if '"final"' in line][-1]
    with h5py.File(tmp_path / "plain.h5", "r") as a, h5py.File(tmp_path / "own.h5", "r") as b:
        for group in a:
            for tensor in a[group]:
                assert a[group][tensor][()].tobytes() == b[group][tensor][()].tobytes(), (group, tensor)
    assert finals["own"]["test_accuracy"] == finals["plain"]["test_accuracy"]
    assert finals["own"]["test_loss"] == pytest.approx(2 * finals["plain"]["test_loss"], rel=1e-6)


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
    from hpctrain.flags import cli
    from hpctrain.nn import zoo
    assert list(cli.MODELS) == list(zoo.MODELS)


# --- the same model on every rank (issue 27, 1) ----------------------------------------

MODEL = ("from hpctrain.nn import Dense, Flatten, ReLU\n\n\ndef build(shape, classes):\n"
         "    return [Flatten(), Dense({width}), ReLU(), Dense(classes)]\n")
SCALED = ("import numpy as np\nfrom hpctrain.nn import Dense, Flatten, Layer\n\n\nclass Scale(Layer):\n"
          "    keeps_output = False\n\n    def forward(self, ctx, x, train):\n        return x * np.float32({k})\n\n"
          "    def backward(self, ctx, dy, need_dx):\n        return dy * np.float32({k})\n\n\n"
          "def build(shape, classes):\n    return [Flatten(), Dense(16), Scale(), Dense(classes)]\n")


def mpmd(folders, value, *flags, timeout=60):
    """One rank per folder, each started there (-wdir), with --model value."""
    from conftest import MPIRUN, REPO
    import subprocess
    import sys
    from hpctrain.run.cluster import child_env
    cmd = [MPIRUN]
    for i, folder in enumerate(folders):
        cmd += ([":"] if i else []) + ["-n", "1", "-wdir", str(folder), sys.executable, "-m", "hpctrain.mnist",
                                       "--model", value, "--timeout", "20", *map(str, flags)]
    env = child_env()
    env["PYTHONPATH"] = REPO
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def folders(tmp_path, *sources, name="m.py"):
    out = []
    for i, source in enumerate(sources):
        d = tmp_path / f"rank{i}"
        d.mkdir(parents=True)
        for file, text in (source.items() if isinstance(source, dict) else [(name, source)]):
            (d / file).write_text(text)
        out.append(d)
    return out


@pytest.mark.parametrize("a, b, differs", [
    # the same layers, describe() alike: only the code tells them apart (trained two functions, rc 0)
    (SCALED.format(k=2), SCALED.format(k=3), "model code (the file and the modules it imports beside it)"),
    # other parameter counts (ring mode: an MPI 'Message truncated' traceback)
    (MODEL.format(width=16), MODEL.format(width=17), "model (layers, tensors and their shapes)"),
], ids=["a constant", "a width"])
def test_a_model_file_that_differs_between_ranks_is_one_line(job, tmp_path, a, b, differs):
    r = mpmd(folders(tmp_path, a, b), "m.py:build", "--steps", "5", "--save", tmp_path / "p.h5")
    errors = [line for line in r.stderr.splitlines() if line.startswith("hpctrain: error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr
    assert errors[0].startswith("hpctrain: error: ranks disagree on the job: ") and differs in errors[0], errors
    assert not (tmp_path / "p.h5").exists()


def test_a_module_beside_the_model_file_is_imported_and_compared(job, tmp_path):
    layers = "from hpctrain.nn import Dense\n\nWIDTH = {w}\n\n\ndef hidden():\n    return Dense(WIDTH)\n"
    model = ("from hpctrain.nn import Dense, Flatten, ReLU\nfrom mylayers import hidden\n\n\n"
             "def build(shape, classes):\n    return [Flatten(), hidden(), ReLU(), Dense(classes)]\n")
    same = folders(tmp_path / "same", {"m.py": model, "mylayers.py": layers.format(w=12)},
                   {"m.py": model, "mylayers.py": layers.format(w=12)})
    r = mpmd(same, "m.py:build", "--steps", "5", "--log-every", "5")
    assert r.returncode == 0, r.stderr
    # the sibling differs in a constant the layer list also shows ... and in one it does not
    other = layers.format(w=12).replace("WIDTH = 12", "WIDTH = 12  # tuned")
    odd = folders(tmp_path / "odd", {"m.py": model, "mylayers.py": layers.format(w=12)},
                  {"m.py": model, "mylayers.py": other})
    r = mpmd(odd, "m.py:build", "--steps", "5")
    assert r.returncode == 2 and "model code (the file and the modules it imports beside it)" in r.stderr, r.stderr


def test_a_relative_and_an_absolute_path_to_one_file_are_one_model(job, tmp_path):
    (tmp_path / "m.py").write_text(MODEL.format(width=8))
    r = mpmd([tmp_path, tmp_path], "m.py:build", "--steps", "5", "--log-every", "5")
    assert r.returncode == 0, r.stderr
    from conftest import MPIRUN, REPO
    import subprocess
    import sys
    from hpctrain.run.cluster import child_env
    base = [sys.executable, "-m", "hpctrain.mnist", "--steps", "5", "--log-every", "5", "--timeout", "20"]
    env = child_env()
    env["PYTHONPATH"] = REPO
    r = subprocess.run([MPIRUN, "-n", "1", "-wdir", str(tmp_path), *base, "--model", "m.py:build", ":",
                        "-n", "1", "-wdir", str(tmp_path), *base, "--model", f"{tmp_path / 'm.py'}:build"],
                       capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr


def test_a_failure_on_one_rank_only_shows_that_ranks_traceback(job, tmp_path):
    (tmp_path / "m.py").write_text("import os\nfrom hpctrain.nn import Dense, Flatten\n\n\n"
                                   "def build(shape, classes):\n    if os.environ.get('PMI_RANK') == '1':\n"
                                   "        return odd_one_out()\n    return [Flatten(), Dense(classes)]\n\n\n"
                                   "def odd_one_out():\n    raise RuntimeError('rank 1 only')\n")
    r = job(2, "--model", f"{tmp_path / 'm.py'}:build", "--steps", "5", timeout=60)
    errors = [line for line in r.stderr.splitlines() if line.startswith("hpctrain: error:")]
    assert r.returncode == 2 and len(errors) == 1 and "raised RuntimeError: rank 1 only" in errors[0], r.stderr
    assert r.stderr.count("Traceback (most recent call last)") == 1 and "in odd_one_out" in r.stderr, r.stderr


def test_sys_exit_in_training_is_a_failure_not_a_finished_run(job, tmp_path):
    # issue 27, 6: SystemExit passes `except Exception`: every rank ended 0, no result
    (tmp_path / "m.py").write_text(
        "import sys\nfrom hpctrain.nn import Dense, Flatten, Layer\n\n\nclass Quits(Layer):\n"
        "    keeps_output = False\n    calls = 0\n\n    def forward(self, ctx, x, train):\n        Quits.calls += 1\n"
        "        if Quits.calls > 30:\n            sys.exit(0)\n        return x * 1\n\n"
        "    def backward(self, ctx, dy, need_dx):\n        return dy\n\n\n"
        "def build(shape, classes):\n    return [Flatten(), Dense(16), Quits(), Dense(classes)]\n")
    r = job(2, "--model", f"{tmp_path / 'm.py'}:build", "--steps", "100", "--save", tmp_path / "p.h5", timeout=60)
    assert r.returncode == 1, r.stderr
    assert "hpctrain: error: sys.exit(0) was called during the run (by the model's code?), before it finished: " \
           "no result; exit 1" in r.stderr, r.stderr
    assert not (tmp_path / "p.h5").exists()


def test_batch_norm_over_one_sample_is_refused(job, tmp_path):
    # issue 27, 14: BatchNorm1d at batch 1 trained a constant
    (tmp_path / "m.py").write_text("from hpctrain.nn import BatchNorm1d, Dense, Flatten, ReLU\n\n\n"
                                   "def build(shape, classes):\n"
                                   "    return [Flatten(), Dense(8), BatchNorm1d(), ReLU(), Dense(classes)]\n")
    r = job(2, "--model", f"{tmp_path / 'm.py'}:build", "--steps", "5", "--batch-size", "1", timeout=60)
    errors = [line for line in r.stderr.splitlines() if line.startswith("hpctrain: error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr
    assert "needs at least 2 samples per rank and step" in errors[0] and "--batch-size 1" in errors[0], errors
    assert job(2, "--model", f"{tmp_path / 'm.py'}:build", "--steps", "5", "--batch-size", "2",
               timeout=60).returncode == 0


def test_hidden_does_not_pin_a_model_it_does_not_size(job, tmp_path):
    # issue 27, 12: a lenet checkpoint was refused over --hidden ("written with
    # --hidden 500,500, this run has --hidden 64"), which has no effect on it;
    # its --save recorded a hidden it does not have
    ckpt = ["--model", "lenet", "--checkpoint-dir", tmp_path / "ckpt", "--log-every", "4", "--batch-size", "8"]
    assert job(2, "--steps", "4", *ckpt, "--save", tmp_path / "p.h5").returncode == 0
    r = job(2, "--steps", "8", *ckpt, "--hidden", "64", timeout=120)
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr
    with h5py.File(tmp_path / "p.h5", "r") as f:
        assert "hidden" not in f.attrs and f.attrs["model"].startswith("lenet ")
