"""No output of a run overwrites one of its inputs, however the path is spelt
(hpctrain/base/overwrites.py, the one check; training's lists in run/outputs.py):
the check's cases on a small tree of files, and one training job refused
before its first step with nothing changed.

    .venv/bin/python -m pytest -q tests/test_overwrites.py
"""
import argparse
import os

import pytest

from hpctrain.base.errors import HpctrainError
from hpctrain.base.overwrites import Input, Output, check_not_inputs
from hpctrain.run.outputs import run_inputs, run_outputs

SHARD = "train-00000-of-00001.h5"


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A user's model file, a prepared set (manifest, shards), a checkpoint
    folder with two checkpoints (a file, a folder), and links to them; the
    working directory."""
    (tmp_path / "model.py").write_text("def net(shape, classes): return []\n")
    data = tmp_path / "data"
    data.mkdir()
    for name in ("manifest.json", SHARD, "test-00000-of-00001.h5"):
        (data / name).write_text(name)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "ckpt-00000010.h5").write_text("step 10")
    (tmp_path / "ckpt" / "ckpt-00000030").mkdir()   # a checkpoint of named tensors is a folder
    (tmp_path / "ckpt" / "ckpt-00000030" / "rank-00000.h5").write_text("rank 0 at step 30")
    (tmp_path / "sub").mkdir()
    (tmp_path / "datalink").symlink_to("data")
    (tmp_path / "model-link.py").symlink_to("model.py")
    os.link(data / SHARD, tmp_path / "hard.h5")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def train_args(**given):
    flags = dict(model="model.py:net", checkpoint_dir="ckpt", save=None, metrics=None, timeline=None,
                 keep_best=None, tensorboard=None)
    return argparse.Namespace(**dict(flags, **given))


def refusal(args, data="data"):
    try:
        check_not_inputs(run_outputs(args), run_inputs(args, data))
    except HpctrainError as e:
        return str(e)
    return None


@pytest.mark.parametrize("flags, says", [
    (dict(save="model.py"), "--save model.py would overwrite the run's input model.py (the --model file)"),
    (dict(metrics="./sub/../model.py"), "--metrics ./sub/../model.py would overwrite the run's input model.py "
                                        "(the --model file)"),
    (dict(save="model-link.py"), "--save model-link.py would overwrite the run's input model.py (the --model file)"),
    (dict(save=f"data/{SHARD}"), f"--save data/{SHARD} would overwrite the run's input data/{SHARD} (a file of "
                                 f"the --data folder data)"),
    (dict(metrics="datalink/manifest.json"), "--metrics datalink/manifest.json would overwrite the run's input "
                                             "datalink/manifest.json (a file of the --data folder data)"),
    (dict(timeline="./data/test-00000-of-00001.h5"), "--timeline ./data/test-00000-of-00001.h5 would overwrite"),
    (dict(keep_best="hard.h5"), f"--keep-best hard.h5 would overwrite the run's input data/{SHARD} (a file of the "
                                f"--data folder data; hard.h5 is a hard link of it)"),
    (dict(save="data/p.h5"), "--save data/p.h5 would write inside the run's input data (the --data folder)"),
    (dict(save="ckpt/ckpt-00000010.h5"), "--save ckpt/ckpt-00000010.h5 would overwrite the run's input "
                                         "ckpt/ckpt-00000010.h5 (a file of the --checkpoint-dir folder ckpt)"),
    (dict(save="ckpt/ckpt-00000020.h5"), "--save ckpt/ckpt-00000020.h5 would write inside the run's input ckpt (the "
                                         "--checkpoint-dir folder) under one of its own names; name another file"),
    (dict(save="ckpt/ckpt-00000030/rank-00000.h5"), "--save ckpt/ckpt-00000030/rank-00000.h5 would overwrite the "
                                                    "run's input ckpt/ckpt-00000030/rank-00000.h5 (a file of the "
                                                    "--checkpoint-dir folder ckpt)"),
    (dict(save="ckpt/ckpt-00000040"), "--save ckpt/ckpt-00000040 would write inside the run's input ckpt (the "
                                      "--checkpoint-dir folder) under one of its own names; name another file"),
    (dict(checkpoint_dir="data/c"), "--checkpoint-dir data/c would write inside the run's input data"),
    (dict(tensorboard="datalink"), "--tensorboard datalink would write into the run's input data (the --data folder)"),
    (dict(tensorboard="."), "--tensorboard . would write over the run's input data (the --data folder), which it "
                            "holds"),
    (dict(save="ckpt/p.h5", metrics="m.jsonl", tensorboard="runs", checkpoint_dir="."), None),
    (dict(save="p.h5", model="mlp"), None),
])
def test_every_training_output_against_every_input(tree, flags, says):
    line = refusal(train_args(**flags))
    assert (line is None) if says is None else line.startswith(says), line
    assert (tree / "model.py").read_text().startswith("def net") and (tree / "data" / SHARD).read_text() == SHARD


def test_a_folder_output_replaced_whole_holds_no_input_and_a_source_folder_may_hold_it(tree):
    def check(out, source):
        check_not_inputs([Output(out, "--out", folder=True)], [Input(source, "the --source folder", inside=False)])
    with pytest.raises(HpctrainError, match=r"^--out \. would write over the run's input data "):
        check(".", "data")
    with pytest.raises(HpctrainError, match=r"^--out datalink would write into the run's input data "):
        check("datalink", "data")
    check("data/prepared", "data")   # a folder inside a raw source harms none of its files


@pytest.mark.parametrize("case", ["metrics onto the manifest", "save onto the model file"])
def test_training_onto_its_own_input_is_one_line_before_the_first_step(job, bundled_shards, tmp_path, case):
    # Before: rc 0, the prepared set's manifest or the user's code replaced by the run's output.
    model = tmp_path / "net.py"
    model.write_text(open(os.path.join(os.path.dirname(__file__), "models", "tiny_cnn.py")).read())
    if case == "metrics onto the manifest":
        victim = os.path.join(bundled_shards, "manifest.json")
        spelt = os.path.join(bundled_shards, "..", os.path.basename(bundled_shards), "manifest.json")
        flags, says = ["--metrics", spelt], f"--metrics {spelt} would overwrite the run's input {spelt} (a file of " \
                                             f"the --data folder {bundled_shards})"
    else:
        victim, spelt = str(model), f"{tmp_path}/./net.py"
        flags = ["--model", f"{model}:build", "--save", spelt]
        says = f"--save {spelt} would overwrite the run's input {model} (the --model file)"
    text = open(victim).read()
    r = job(2, "--data", bundled_shards, "--steps", "100000", *flags, timeout=120)
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert r.returncode == 2 and lines == [f"hpctrain: error: {says}"], r.stderr   # one line for both ranks
    assert "step " not in r.stdout and open(victim).read() == text
