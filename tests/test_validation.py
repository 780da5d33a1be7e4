"""A validation part: prepare --val-fraction, --eval-every on it, the final
record's val_accuracy, --keep-best (ring and ps), its resume bit for bit,
and the flags that cannot work together.

    .venv/bin/python -m pytest tests/test_validation.py
"""
import json
import subprocess
import sys

import h5py
import numpy as np
import pytest

from hpctrain.data import bundled_sample_dir, load_test, prepare
from hpctrain.base.errors import HpctrainError

COMMON = ["--steps", "40", "--eval-every", "10", "--log-every", "20", "--hidden", "32", "--lr", "0.3"]


@pytest.fixture(scope="module")
def val_data(tmp_path_factory):
    """The bundled sample with a 10% validation part (prepared once: it takes seconds)."""
    out = tmp_path_factory.mktemp("data") / "mnist-val"
    prepare(bundled_sample_dir(), out, shards=4, log=None, val_fraction=0.1)
    return out


def _records(path):
    return [json.loads(line) for line in open(path)]


def _params(path):
    with h5py.File(path, "r") as f:
        out = {}
        f.visititems(lambda name, obj: out.update({name: obj[...]}) if isinstance(obj, h5py.Dataset) else None)
        return out, dict(f.attrs)


def _comparable(manifest):
    return {k: v for k, v in manifest.items() if k != "source"} | {"files": manifest["source"]["files"]}


# ---------------------------------------------------------------------------
# prepare

def test_val_fraction_splits_each_class_exactly_and_deterministically(tmp_path, val_data):
    base = prepare(bundled_sample_dir(), tmp_path / "base", shards=4, log=None)
    zero = prepare(bundled_sample_dir(), tmp_path / "zero", shards=4, log=None, val_fraction=0.0)
    assert _comparable(zero) == _comparable(base) and "val" not in zero   # 0: today's, shard hashes included
    held = json.load(open(val_data / "manifest.json"))
    again = prepare(bundled_sample_dir(), tmp_path / "again", shards=4, log=None, val_fraction=0.1)
    assert _comparable(again) == _comparable(held)
    for c, n in base["train"]["per_class"].items():
        k = int(np.floor(n * 0.1 + 0.5))
        assert held["val"]["per_class"][c] == k and held["train"]["per_class"][c] == n - k
    assert held["test"] == {**base["test"], "shards": held["test"]["shards"]}
    assert held["val_fraction"] == 0.1 and held["val"]["shards"][0]["file"] == "val-00000-of-00001.h5"
    x, y = load_test(val_data, split="val")
    assert len(x) == len(y) == held["val"]["num_samples"] == 450
    # The val images are training images no shard holds any more.
    train_x = np.concatenate([h5py.File(val_data / e["file"])["images"][...].reshape(-1, 784)
                              for e in held["train"]["shards"]])
    all_x = np.concatenate([h5py.File(tmp_path / "base" / e["file"])["images"][...].reshape(-1, 784)
                            for e in base["train"]["shards"]])
    as_set = lambda a: {r.tobytes() for r in a}   # noqa: E731
    val_px = as_set(np.rint(x * 255).astype(np.uint8))
    assert not val_px & as_set(train_x) and val_px <= as_set(all_x)


@pytest.mark.parametrize("fraction", ["1.0", "-0.1", "0.0001"])
def test_bad_val_fraction_is_one_line_and_exit_2(tmp_path, fraction, capsys):
    argv = ["prepare", "--out", str(tmp_path / "d"), "--val-fraction", fraction]
    if fraction == "1.0":   # the command itself once; the others through its main, in this process (one_line_errors)
        r = subprocess.run([sys.executable, "-m", "hpctrain.data", *argv], capture_output=True, text=True, timeout=60)
        code, err = r.returncode, r.stderr
    else:
        from hpctrain.data.__main__ import main
        code, err = main(argv), capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("hpctrain: error: "), err
    assert "--val-fraction" in lines[0] and not (tmp_path / "d").exists()
    with pytest.raises(HpctrainError):
        prepare(bundled_sample_dir(), tmp_path / "e", val_fraction=float(fraction))


# ---------------------------------------------------------------------------
# training

@pytest.mark.parametrize("mode, n", [("ring", 2), ("ps", 3)])
def test_val_accuracy_in_eval_and_final_records_and_keep_best(job, tmp_path, val_data, mode, n):
    best, metrics = tmp_path / "best.h5", tmp_path / "m.jsonl"
    r = job(n, "--mode", mode, "--data", val_data, *COMMON, "--keep-best", best, "--metrics", metrics,
            timeout=120)
    assert r.returncode == 0, r.stderr
    records = _records(metrics)
    evals = [m for m in records if m.get("event") == "eval"]
    final = records[-1]
    assert [m["step"] for m in evals] == [10, 20, 30] and final["event"] == "final"
    for m in evals + [final]:
        assert 0 <= m["val_accuracy"] <= 1 and m["val_loss"] > 0 and 0 <= m["test_accuracy"] <= 1
    # The best of every validation (the final one too); a tie keeps the earlier.
    scored = evals + [dict(final, step=final["steps"])]
    want = scored[int(np.argmax([m["val_accuracy"] for m in scored]))]
    params, attrs = _params(best)
    assert attrs["step"] == want["step"] and round(attrs["val_accuracy"], 6) == want["val_accuracy"]
    assert attrs["mode"] == mode and set(params) == {"layer0/W", "layer0/b", "layer1/W", "layer1/b"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no temporary left
    if mode == "ring":
        # The kept parameters are those of that step: a run that stops there saves the same.
        saved = tmp_path / "at.h5"
        r = job(n, "--mode", mode, "--data", val_data, *COMMON[2:], "--steps", want["step"], "--save", saved,
                timeout=120)
        assert r.returncode == 0, r.stderr
        again, _ = _params(saved)
        assert all(np.array_equal(params[k], again[k]) for k in params)


def test_without_a_val_part_records_are_as_before(job, tmp_path):
    metrics = tmp_path / "m.jsonl"
    r = job(2, "--steps", "20", "--eval-every", "10", "--log-every", "20", "--hidden", "32",
            "--metrics", metrics, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not any(k.startswith("val_") for m in _records(metrics) for k in m)


@pytest.mark.parametrize("mode, n", [("ring", 2), ("ps", 3)])
def test_keep_best_resumes_bit_exact(job, tmp_path, val_data, mode, n):
    """40 steps at once, or 20 then resumed to 40 (the final evaluation at 20
    is in the checkpoint's best): the same --keep-best file (ps: sync, 1
    server + 2 workers, whose sums are in worker order: bit-exact too)."""
    flags = ["--data", val_data, *COMMON[2:], "--checkpoint-every", "10", "--mode", mode]
    whole, part = tmp_path / "whole.h5", tmp_path / "part.h5"
    r = job(n, *flags, "--steps", "40", "--checkpoint-dir", tmp_path / "a", "--keep-best", whole, timeout=120)
    assert r.returncode == 0, r.stderr
    for steps in ("20", "40"):
        r = job(n, *flags, "--steps", steps, "--checkpoint-dir", tmp_path / "b", "--keep-best", part, timeout=120)
        assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout
    (p1, a1), (p2, a2) = _params(whole), _params(part)
    assert a1 == a2 and all(np.array_equal(p1[k], p2[k]) for k in p1) and set(p1) == set(p2)


@pytest.mark.parametrize("flags, expect", [
    (["--keep-best", "{tmp}/b.h5"], "--keep-best needs --eval-every"),
    (["--keep-best", "{tmp}/b.h5", "--eval-every", "5", "--data", "{plain}"], "--keep-best needs a validation part"),
    (["--keep-best", "{tmp}/nodir/b.h5", "--eval-every", "5"], "--keep-best {tmp}/nodir/b.h5: directory"),
    (["--keep-best", "{tmp}/m.jsonl", "--eval-every", "5", "--metrics", "{tmp}/m.jsonl"], "both name"),
])
def test_bad_keep_best_is_one_line_and_exit_2(job, tmp_path, val_data, flags, expect):
    plain = tmp_path.parent / "plain"
    if not plain.exists():
        prepare(bundled_sample_dir(), plain, shards=4, log=None)
    fill = lambda s: s.format(tmp=tmp_path, plain=plain)   # noqa: E731
    flags = [fill(f) for f in flags]
    if "--data" not in flags:
        flags += ["--data", str(val_data)]
    r = job(2, "--steps", "10", *flags, timeout=60)
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("hpctrain: error: ") and fill(expect) in lines[0], lines
    assert not any(p.suffix == ".h5" for p in tmp_path.iterdir())
