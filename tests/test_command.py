"""The `hpctrain` console command: installed with the package (pyproject's
[project.scripts]), one subcommand per `python -m hpctrain.*` program, each
the same program (a training job through it writes the same bits).

    .venv/bin/python -m pytest -q tests/test_command.py
"""
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import MPIRUN, REPO, same_bytes
from hpctrain.run.cluster import child_env
from hpctrain.command import COMMANDS

SCRIPT = Path(sys.executable).parent / "hpctrain"


def run(*args, cwd=REPO):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=180, cwd=cwd,
                          env=child_env())


def test_the_command_is_installed_from_pyproject():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["scripts"] == {"hpctrain": "hpctrain.command:main"}
    assert SCRIPT.is_file() and os.access(SCRIPT, os.X_OK), "make .venv/.installed installs it"
    assert set(COMMANDS) == {"train", "data", "predict", "evaluate", "generate", "bench", "plot", "checkpoint", "export"}


# Each subcommand's --help as the console command runs it (command.main, what
# SCRIPT calls) and as `python -m` runs its module (runpy, what -m calls),
# all in one process: a process each was most of the test's time. JSON out:
# {name: [[exit code, stdout] of the command, [exit code, stdout] of -m]}.
HELPS = """
import contextlib, io, json, runpy, sys
from hpctrain import command

def answer(call):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = call()
        except SystemExit as e:
            code = e.code
    return [code or 0, out.getvalue()]

def as_m(module):
    sys.argv = [module, "--help"]
    runpy.run_module(module, run_name="__main__", alter_sys=True)

print(json.dumps({name: [answer(lambda: command.main([name, "--help"])),
                         answer(lambda: as_m(module.removesuffix(".__main__")))]
                  for name, (module, _) in command.COMMANDS.items()}))
"""


def test_every_subcommand_answers_help_under_its_own_name(tmp_path):
    r = run(SCRIPT, "--help")
    assert r.returncode == 0 and all(f"  {name}" in r.stdout for name in COMMANDS), r.stdout
    # one subcommand through the installed script and python -m as processes of their own, every one below
    r = run(SCRIPT, "train", "--help", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("usage: hpctrain train"), r.stdout[:80]
    r = run(sys.executable, "-m", "hpctrain.train", "--help", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m hpctrain.train "), r.stdout[:80]
    r = run(sys.executable, "-c", HELPS, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    helps = json.loads(r.stdout.splitlines()[-1])
    assert set(helps) == set(COMMANDS)
    for name, ((code, out), (m_code, m_out)) in helps.items():
        assert code == 0, (name, out)
        assert out.startswith("usage: "), (name, out)
        assert out.startswith(f"usage: hpctrain {name}"), (name, out[:80])   # bench, plot, checkpoint said python -m
        module = COMMANDS[name][0].removesuffix(".__main__")
        assert m_code == 0 and m_out.startswith(f"usage: python -m {module} "), (name, m_out[:80])
    r = run(SCRIPT)
    assert r.returncode == 2 and r.stderr.startswith("usage: hpctrain COMMAND")
    r = run(SCRIPT, "fly")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "hpctrain: error: unknown command 'fly'; one of train, data, predict, evaluate, generate, bench, plot, "
        "checkpoint, export (hpctrain --help)"]
    r = run(sys.executable, "-m", "hpctrain", "checkpoint", tmp_path / "none")
    assert r.returncode == 2 and r.stderr == f"hpctrain: error: {tmp_path / 'none'}: no such directory\n"


def test_a_job_through_the_command_is_the_same_program(tmp_path):
    out = tmp_path / "shards"
    r = run(SCRIPT, "data", "prepare", "--out", out, "--shards", 2)
    assert r.returncode == 0 and "prepared" in r.stdout, r.stderr
    flags = ["--data", out, "--steps", "8", "--hidden", "16", "--log-every", "4"]
    r = run(MPIRUN, "-n", 2, SCRIPT, "train", *flags, "--save", tmp_path / "a.h5")
    assert r.returncode == 0, r.stderr
    r = run(MPIRUN, "-n", 2, sys.executable, "-m", "hpctrain.train", *flags, "--save", tmp_path / "b.h5")
    assert r.returncode == 0, r.stderr
    assert same_bytes(tmp_path / "a.h5", tmp_path / "b.h5")
    r = run(SCRIPT, "evaluate", "--params", tmp_path / "a.h5", "--data", out)
    assert r.returncode == 0 and r.stdout.startswith("test accuracy "), r.stderr
    r = run(SCRIPT, "train", "--steps", "0")
    assert r.returncode == 2 and "hpctrain: error: argument --steps: must be >= 1, got 0" in r.stderr


def test_the_data_predict_evaluate_and_tensorboard_modules_never_import_mpi():
    # House rule: data never imports MPI; predict and evaluate are one process.
    code = ("import sys, hpctrain.data, hpctrain.data.images, hpctrain.data.arrays, hpctrain.data.augment, "
            "hpctrain.predict, hpctrain.evaluate, hpctrain.generate, hpctrain.nn.decode, hpctrain.checkpoints.trained, "
            "hpctrain.report.tensorboard, hpctrain.command, "
            "hpctrain.checkpoint\nprint(sorted(m for m in sys.modules if m.startswith('mpi4py')))")
    r = run(sys.executable, "-c", code)
    assert r.returncode == 0 and r.stdout == "[]\n", (r.stdout, r.stderr)


# issue 41, 30 and 23: argparse took `--epoch 3` as `--epochs 3` (any unique
# prefix was another flag); plot's and checkpoint's bad arguments were
# argparse's usage block, not one line.
@pytest.mark.parametrize("args, unknown, flag", [
    (["train", "--epoch", "3"], "--epoch 3", "--epochs"),
    (["train", "--batch", "8"], "--batch 8", "--batch-size"),
    (["data", "prepare", "--sourc", "x"], "--sourc x", "--source"),
    (["data", "fetch", "--out", "x", "--datset", "mnist"], "--datset mnist", "--dataset"),
    # named before argparse's "one of --params --checkpoint is required"
    (["predict", "--param", "p.h5", "a.png"], "--param", "--params"),
    (["evaluate", "--params", "p.h5", "--dat", "d"], "--dat", "--data"),
    (["generate", "--params", "p.h5", "--top_k", "3"], "--top_k 3", "--top-k"),
    (["bench", "allreduce", "--rank", "3"], "--rank 3", "--ranks"),
    (["plot", "m.jsonl", "-o", "p.png", "--labl", "a"], "--labl a", "--label"),
    (["checkpoint", "ckpt", "--al"], "--al", None),
])
def test_a_prefix_or_a_misspelt_flag_is_one_line_with_the_flag_it_resembles(tmp_path, args, unknown, flag):
    r = run(SCRIPT, *args, cwd=tmp_path)
    hint = f"; did you mean {flag}?" if flag else ""
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr == f"hpctrain: error: unrecognized arguments: {unknown}{hint} (see --help)\n"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("module, args", [("hpctrain.plot", []), ("hpctrain.plot", ["m.jsonl"]),
                                          ("hpctrain.checkpoint", []), ("hpctrain.checkpoint", ["a", "b"]),
                                          ("hpctrain.nn", ["--shape", "x"]), ("hpctrain.pipeline", ["--stage", "3"]),
                                          ("hpctrain.data", ["prepar", "--source", "x"])])
def test_every_entry_points_bad_arguments_are_one_line(tmp_path, module, args):
    r = run(sys.executable, "-m", module, *args, cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and r.stderr.startswith("hpctrain: error: "), r.stderr


def test_every_parser_is_the_shared_one():
    # One class (hpctrain/flags/arguments.py) makes every parser: no prefix
    # matching, one-line errors. A bare argparse.ArgumentParser brings both back.
    bare = [str(path.relative_to(REPO)) for path in Path(REPO, "hpctrain").rglob("*.py")
            if "ArgumentParser(" in path.read_text() and path.name != "arguments.py"]
    assert bare == []


def test_train_help_is_a_screenful_and_help_all_every_flag():
    # issue 41, 32: --help was 324 lines.
    from hpctrain.flags import cli
    short = run(SCRIPT, "train", "--help")
    full = run(SCRIPT, "train", "--help-all")
    assert short.returncode == 0 and full.returncode == 0
    assert len(short.stdout.splitlines()) < 50 and len(full.stdout.splitlines()) > 250
    flags = {o for a in cli.build_parser()._actions for o in a.option_strings if o.startswith("--")}
    listed = set(re.findall(r"^  (--[a-z-]+)", short.stdout, re.M))
    assert listed == set(cli.COMMON_FLAGS) and listed < flags and "--help-all" in short.stdout.splitlines()[0]
    assert flags == set(re.findall(r"^ +(?:-h, )?(--[a-z-]+)", full.stdout, re.M))
    for group in ("training", "ring mode", "ps mode", "checkpoints and output"):
        assert re.search(rf"^  {group}.* \(\d+ flags\)$", short.stdout, re.M), short.stdout


def test_numbas_memory_is_one_figure_in_help_docs_and_code():
    # issue 41, 32: --help said ~110 MB, docs/usage.md and docs/models.md ~140 MB
    # (measured again: resident 30 -> 138 MB across loading numba and the Adam pass).
    from hpctrain.flags import cli
    texts = {"--help": cli.build_parser().format_help()}
    for name in ("docs/usage.md", "docs/models.md", "hpctrain/optim/base.py"):
        texts[name] = Path(REPO, name).read_text()
    # the first memory figure after each mention of numba's cost
    figures = {name: re.search(r"numba[^.]{0,200}?(\d+) MB", re.sub(r"\s+", " ", text))[1]
               for name, text in texts.items()}
    assert set(figures.values()) == {"110"}, figures


@pytest.mark.parametrize("text, message", [
    ("500,x", "argument --hidden: expected comma-separated whole numbers for layer widths, got '500,x'"),
    ("64,0", "argument --hidden: layer widths must be >= 1 each, got '64,0'"),
])
def test_train_and_the_layer_check_parse_comma_separated_numbers_alike(text, message):
    """One parser of comma-separated whole numbers (arguments.positive_ints)
    for train's --hidden and python -m hpctrain.nn's --hidden and --shape."""
    from hpctrain.flags import cli
    from hpctrain.base.errors import HpctrainError
    from hpctrain.nn.__main__ import parser
    assert cli.parse(["--hidden", "64,,32"]).hidden == [64, 32]
    with pytest.raises(HpctrainError, match=re.escape(message)):
        cli.parse(["--hidden", text], quiet=True)
    assert parser().parse_args(["--hidden", "64,,32", "--shape", "8,8,3"]).shape == (8, 8, 3)
