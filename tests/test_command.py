"""The `hpctrain` console command: installed with the package (pyproject's
[project.scripts]), one subcommand per `python -m hpctrain.*` program, each
the same program (a training job through it writes the same bits).

    .venv/bin/python -m pytest -q tests/test_command.py
"""
import os
import subprocess
import sys
import tomllib
from pathlib import Path

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
    assert set(COMMANDS) == {"train", "data", "predict", "evaluate", "bench", "plot", "checkpoint"}


def test_every_subcommand_answers_help_under_its_own_name(tmp_path):
    r = run(SCRIPT, "--help")
    assert r.returncode == 0 and all(f"  {name}" in r.stdout for name in COMMANDS), r.stdout
    for name in COMMANDS:
        r = run(SCRIPT, name, "--help", cwd=tmp_path)
        assert r.returncode == 0, (name, r.stderr)
        assert r.stdout.startswith("usage: "), (name, r.stdout)
        if name in ("train", "data", "predict", "evaluate"):
            assert r.stdout.startswith(f"usage: hpctrain {name}"), (name, r.stdout[:80])
    r = run(SCRIPT)
    assert r.returncode == 2 and r.stderr.startswith("usage: hpctrain COMMAND")
    r = run(SCRIPT, "fly")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "hpctrain: error: unknown command 'fly'; one of train, data, predict, evaluate, bench, plot, checkpoint "
        "(hpctrain --help)"]
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
            "hpctrain.predict, hpctrain.evaluate, hpctrain.trained, hpctrain.report.tensorboard, hpctrain.command, "
            "hpctrain.checkpoint\nprint(sorted(m for m in sys.modules if m.startswith('mpi4py')))")
    r = run(sys.executable, "-c", code)
    assert r.returncode == 0 and r.stdout == "[]\n", (r.stdout, r.stderr)
