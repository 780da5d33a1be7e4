"""Faults: data whose manifest points outside the data directory or is malformed.

The manifest is input like any other file: whatever it says, training opens
only files inside --data, and a malformed one is one line and exit 2.

    .venv/bin/python -m pytest tests/faults/test_untrusted_data.py
"""
import json
import re
import shutil
import time

import pytest

from hpctrain import data
from hpctrain.base.errors import HpctrainError


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "mnist"
    data.prepare(data.bundled_sample_dir(), out, shards=2, log=None)
    return out


def edited(shards, dst, edit):
    """A copy of the shard directory whose manifest `edit` changed in place."""
    shutil.copytree(shards, dst)
    manifest = json.loads((dst / data.MANIFEST).read_text())
    edit(manifest)
    (dst / data.MANIFEST).write_text(json.dumps(manifest))
    return dst


def test_shard_names_that_leave_the_data_directory_are_refused(shards, tmp_path, job):
    # A real shard outside --data: the manifest may name it, but it is not read.
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(shards / "train-00000-of-00002.h5", outside / "train.h5")
    names = ["../elsewhere/train.h5", str(outside / "train.h5"), "../../../../../../etc/passwd",
             "..", "sub/train-00000-of-00002.h5"]
    for i, name in enumerate(names):
        d = edited(shards, tmp_path / f"d{i}", lambda m: m["train"]["shards"][0].update(file=name))
        with pytest.raises(HpctrainError) as e:
            data.ShardReader(d, 0, 1, 8, seed=0)
        assert str(e.value) == (f"{d / data.MANIFEST}: bad manifest: shard file {name!r} is not a "
                                f"plain file name in the data directory; prepare again with --force")
    # End to end: one line on the whole job, exit 2, no parameters written.
    t0 = time.monotonic()
    r = job(2, "--data", tmp_path / "d0", "--steps", "5", "--save", tmp_path / "p.h5", timeout=60)
    assert r.returncode == 2, r.stderr
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert lines == [f"hpctrain: error: {tmp_path / 'd0' / data.MANIFEST}: bad manifest: shard file "
                     f"'../elsewhere/train.h5' is not a plain file name in the data directory; "
                     f"prepare again with --force"], r.stderr
    assert time.monotonic() - t0 < 60 and not (tmp_path / "p.h5").exists()


@pytest.mark.parametrize("edit, problem", [
    (lambda m: m.pop("image_shape"), "image_shape must be a list of positive integers, got None"),
    (lambda m: m.update(image_shape=[28, "28"]), "image_shape must be a list of positive integers"),
    (lambda m: m.update(num_classes=0), "num_classes must be a positive integer, got 0"),
    (lambda m: m.pop("test"), "'test' must hold a list of shards"),
    (lambda m: m["train"].update(shards={}), "'train' must hold a list of shards"),
    (lambda m: m["train"].update(shards=[], num_samples=0), "no training shards"),
    (lambda m: m["train"]["shards"].__setitem__(0, "train.h5"), "a train shard entry is str, not an object"),
    (lambda m: m["train"]["shards"][0].update(num_samples=-1), "num_samples must be a non-negative integer"),
    (lambda m: m["train"]["shards"][0].update(num_samples=True), "num_samples must be a non-negative integer"),
    (lambda m: m["test"]["shards"][0].pop("sha256"), "sha256 missing"),
    (lambda m: m["train"].update(num_samples=7), "train num_samples 7, its shards hold"),
])
def test_malformed_manifest_is_one_line(shards, tmp_path, edit, problem):
    d = edited(shards, tmp_path / "d", edit)
    for read in (lambda: data.ShardReader(d, 0, 1, 8, seed=0), lambda: data.load_test(d)):
        with pytest.raises(HpctrainError) as e:
            read()
        assert f"{d / data.MANIFEST}: bad manifest: " in str(e.value) and problem in str(e.value)
        assert "\n" not in str(e.value)


def test_manifest_that_is_not_an_object(shards, tmp_path):
    d = tmp_path / "d"
    shutil.copytree(shards, d)
    for text in ("[]", "null", "42", "{\"format\": 1}"):
        (d / data.MANIFEST).write_text(text)
        with pytest.raises(HpctrainError, match="not an hpctrain shard manifest"):
            data.load_manifest(d)


def test_labels_beyond_the_manifests_classes_end_the_job_with_one_line(shards, tmp_path, job):
    # Shards with labels 0..9 under a manifest that says 4 classes: before any
    # step, one line naming a shard on the whole job, exit 2.
    d = edited(shards, tmp_path / "d", lambda m: m.update(num_classes=4))
    r = job(2, "--data", d, "--steps", "5", "--save", tmp_path / "p.h5", timeout=60)
    assert r.returncode == 2, r.stderr
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"hpctrain: error: {d}/train-0000") and (
        "is not below the manifest's num_classes 4; prepare again with --force" in lines[0])
    assert not (tmp_path / "p.h5").exists()


def test_the_model_follows_the_manifests_classes(shards, tmp_path, job):
    # A manifest with 47 classes (EMNIST balanced) over labels 0..9: the model
    # is built from the manifest (47 outputs), so it trains; before, a
    # 10-output model refused it. Labels past the manifest's count are
    # refused by the test above.
    import h5py
    d = edited(shards, tmp_path / "d", lambda m: m.update(num_classes=47))
    r = job(2, "--data", d, "--steps", "3", "--hidden", "16", "--save", tmp_path / "p.h5", timeout=60)
    assert r.returncode == 0, r.stderr
    with h5py.File(tmp_path / "p.h5") as f:
        assert f["layer0/W"].shape == (784, 16) and f["layer1/W"].shape == (16, 47)


def test_ranks_on_different_data_or_checkpoint_dirs_are_refused(shards, tmp_path):
    # Same content under another path is fine; other content is named, and so
    # is a --checkpoint-dir that differs on one rank (before: a hang until the timeout).
    import subprocess
    import sys
    from conftest import MPIRUN, REPO
    from hpctrain.run.cluster import child_env
    copy = tmp_path / "copy"
    shutil.copytree(shards, copy)
    other = edited(shards, tmp_path / "other", lambda m: m.update(seed=99))
    py = [sys.executable, "-m", "hpctrain.mnist", "--steps", "3", "--hidden", "16", "--timeout", "20"]

    def run(flags0, flags1):
        return subprocess.run([MPIRUN, "-n", "1", *py, *flags0, ":", "-n", "1", *py, *flags1],
                              capture_output=True, text=True, timeout=120, env=child_env(), cwd=REPO)
    r = run(["--data", shards], ["--data", copy])
    assert r.returncode == 0, r.stderr
    r = run(["--data", shards], ["--data", other])
    assert r.returncode == 2 and "ranks disagree on the job: data (manifest digest): rank 0 has" in r.stderr
    r = run(["--data", shards, "--checkpoint-dir", tmp_path / "c0"],
            ["--data", shards, "--checkpoint-dir", tmp_path / "c1"])
    assert r.returncode == 2 and "checkpoint_dir: rank 0 has" in r.stderr, r.stderr


def test_output_flags_given_to_one_rank_only_are_refused(shards, tmp_path):
    # Only the chief writes outputs: --save or --metrics on another rank alone
    # was ignored (exit 0, no file). Now every rank compares them.
    import subprocess
    import sys
    from conftest import MPIRUN, REPO
    from hpctrain.run.cluster import child_env
    py = [sys.executable, "-m", "hpctrain.mnist", "--data", str(shards), "--steps", "3", "--hidden", "16",
          "--timeout", "20"]
    r = subprocess.run([MPIRUN, "-n", "1", *py, ":", "-n", "1", *py, "--save", "s.h5", "--metrics", "m.jsonl"],
                       capture_output=True, text=True, timeout=120, env=child_env(), cwd=tmp_path)
    lines = [line for line in r.stderr.splitlines() if line.startswith("hpctrain: error")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    # (a long path is compared as its end and a hash of the whole)
    assert re.fullmatch(r"hpctrain: error: ranks disagree on the job: metrics: rank 0 has -, rank 1 has "
                        r"\S+/m\.jsonl; save: rank 0 has -, rank 1 has \S+/s\.h5", lines[0]), lines
    assert not list(tmp_path.iterdir())


def test_a_refused_start_leaves_no_checkpoint_directory(shards, tmp_path, job):
    # A manifest whose images make a model too big for memory (the estimate
    # follows the manifest, not MNIST) is refused before the outputs are created.
    d = edited(shards, tmp_path / "d", lambda m: m.update(image_shape=[100000, 100000]))
    r = job(2, "--data", d, "--steps", "5", "--checkpoint-dir", tmp_path / "ckpt", timeout=60)
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert r.returncode == 2 and not (tmp_path / "ckpt").exists(), r.stderr
    assert len(lines) == 1 and "--hidden 500,500 with --batch-size 32 needs at least" in lines[0], lines
