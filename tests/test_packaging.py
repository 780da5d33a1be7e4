"""pyproject.toml and environment.yml name the same packages; the README
shows the two commands a user starts with; CI runs the README's test command;
the quick tier names tests that exist."""
import os
import re
import shutil
import subprocess
import tomllib

import pytest

from conftest import REPO

# pip name -> conda-forge name, where they differ in more than version pins.
PIP_TO_CONDA = {"mpich": "openmpi", "cupy-cuda12x": "cupy", "torch": "pytorch"}


def _name(spec):
    return re.split(r"[<>=!\[ ;]", spec.strip(), maxsplit=1)[0].lower()


def test_environment_yml_names_the_same_packages_as_pyproject():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    pip = {_name(d) for d in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        pip |= {_name(d) for d in extra}
    expected = {PIP_TO_CONDA.get(n, n) for n in pip}
    conda = set()
    for line in open(os.path.join(REPO, "environment.yml")):
        m = re.match(r"\s*#?\s*-\s+([A-Za-z0-9_.-]+)", line)
        if m and m.group(1) not in ("conda-forge",):
            conda.add(_name(m.group(1)))
    conda.discard("python")
    assert expected == conda, (expected ^ conda)


def test_readme_quick_start_and_ci():
    readme = open(os.path.join(REPO, "README.md")).read()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^\s*(make [\w-]+)\s*$", quick, re.M)
    assert commands[:3] == ["make run", "make test-quick", "make test"]
    # issue 54, N5: `make test` stood under "no root needed" with neither its time nor what it does as root
    assert re.search(r"make test\n\nabout \d+ minutes", quick), "make test's time"
    for words in ("as root", "SLURM and munge", "/etc/slurm", "network namespaces", "171 tests"):
        assert words in quick, words
    assert "make test" in open(os.path.join(REPO, ".ci", "run")).read()


def _make_list(makefile, name):
    """The words of `NAME := ...` in the Makefile (continuation lines joined)."""
    text = makefile.replace("\\\n", " ")
    value = re.search(rf"^{name}\s*:=(.*)$", text, re.M).group(1)
    return [word.strip('"') for word in value.split()]


def test_quick_tier_names_tests_that_exist_and_leaves_make_test_alone():
    makefile = open(os.path.join(REPO, "Makefile")).read()
    quick = _make_list(makefile, "QUICK_TESTS") + _make_list(makefile, "QUICK_MPI_TESTS")
    assert quick
    for entry in quick:
        path, _, test = entry.partition("::")
        source = open(os.path.join(REPO, path)).read()
        assert not test or re.search(rf"^def {test}\(", source, re.M), entry
    assert re.search(r"^test: test-serial test-mpi$", makefile, re.M)
    assert re.search(r"^test-quick: ", makefile, re.M)
    assert "make test-quick" in open(os.path.join(REPO, "README.md")).read()


def test_gitignore_ignores_what_users_put_in_data_but_not_the_bundled_files():
    # issue 54, N7: only data/shakespeare-* and data/prepared* were ignored: a
    # user's data/mytext-chars/ showed in `git status`
    if not shutil.which("git") or not os.path.exists(os.path.join(REPO, ".git")):
        pytest.skip("not a git checkout")

    def ignored(*paths):
        r = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=REPO, capture_output=True, text=True)
        return set(r.stdout.split())
    users = ["data/mytext-chars/manifest.json", "data/mytext-chars/train-00000-of-00001.h5", "data/mnist/x.h5",
             "data/shakespeare-bpe/manifest.json", "data/notes.txt"]
    assert ignored(*users) == set(users)
    bundled = ["data/README.md", "data/mnist-5k/README.md", "data/mnist-5k/images-idx3-ubyte.gz",
               "data/shakespeare/input.txt", "data/shakespeare/README.md"]
    assert ignored(*bundled) == set()
