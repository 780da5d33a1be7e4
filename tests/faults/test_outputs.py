"""Faults: outputs that cannot be written. Checked before the first step, and
a result that still fails to be written at the end is kept somewhere named.

    .venv/bin/python -m pytest tests/faults/test_outputs.py
"""
import argparse
import json
import os
import re
import stat
import subprocess
import sys
import time

import h5py
import pytest

from conftest import checkpoint_file, checkpoint_path, checkpoint_steps

FAULTS = os.path.dirname(os.path.abspath(__file__))


def one_error_line(r):
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert len(lines) == 1 and lines[0].startswith("hpctrain: error: "), r.stderr
    return lines[0][len("hpctrain: error: "):]


@pytest.mark.parametrize("case", ["save is a directory", "save in a missing directory",
                                  "save and metrics the same file", "metrics is a directory",
                                  "checkpoint dir is a file", "timeline is the checkpoint dir"])
def test_bad_outputs_fail_before_training(job, tmp_path, case):
    out = tmp_path / "out"
    out.mkdir()
    a_file = out / "file"
    a_file.write_text("kept")
    flags, expect = {
        "save is a directory": (["--save", out], f"--save {out}: is a directory; name a file in it"),
        "save in a missing directory": (["--save", out / "no" / "p.h5"],
                                        f"--save {out / 'no' / 'p.h5'}: directory {out / 'no'} does not exist"),
        "save and metrics the same file": (["--save", out / "x", "--metrics", out / "x"],
                                           f"--metrics and --save both name {out / 'x'}: give each its own file"),
        "metrics is a directory": (["--metrics", out], f"--metrics {out}: is a directory; name a file in it"),
        "checkpoint dir is a file": (["--checkpoint-dir", a_file],
                                     f"--checkpoint-dir {a_file}: exists and is not a directory"),
        "timeline is the checkpoint dir": (["--timeline", out / "c", "--checkpoint-dir", out / "c"],
                                           f"--checkpoint-dir and --timeline both name {out / 'c'}"),
    }[case]
    t0 = time.monotonic()
    # 100000 steps: a run that got past start-up would not end within the timeout.
    r = job(2, "--steps", "100000", *flags, timeout=60)
    assert r.returncode == 2 and one_error_line(r) == expect, r.stderr
    assert time.monotonic() - t0 < 60
    assert "step " not in r.stdout
    assert sorted(os.listdir(out)) == ["file"] and a_file.read_text() == "kept"


@pytest.mark.parametrize("with_checkpoint, mode", [(True, "ring"), (False, "ps")])
def test_save_failing_at_the_end_keeps_the_parameters(job, tmp_path, with_checkpoint, mode):
    save, metrics, ckpt = tmp_path / "p.h5", tmp_path / "m.jsonl", tmp_path / "ckpt"
    rescue_dir = tmp_path / "tmp"
    rescue_dir.mkdir()
    flags = ["--mode", mode, "--steps", "20", "--log-every", "10", "--save", save, "--metrics", metrics]
    if with_checkpoint:
        flags += ["--checkpoint-dir", ckpt]
    env = {"PYTHONPATH": FAULTS, "TMPDIR": str(rescue_dir)}
    r = job(2 if mode == "ring" else 3, *flags, module="disk_full_on_save", env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    line = one_error_line(r)
    failed = f"--save {save}: cannot write (No space left on device); the parameters of step 20 "
    if with_checkpoint:
        kept = checkpoint_path(ckpt, 20)
        assert line == failed + f"are in checkpoint {kept}"
        assert os.listdir(rescue_dir) == []
        with h5py.File(checkpoint_file(kept)) as f:
            assert f.attrs["step"] == 20
    else:
        [name] = os.listdir(rescue_dir)
        kept = rescue_dir / name
        assert line == failed + f"are kept in {kept}"
        with h5py.File(kept) as f:
            assert f.attrs["step"] == 20 and f["layer0/W"].shape == (784, 500)
    # The run itself finished: its final record is written, nothing half-written is left.
    final = json.loads(metrics.read_text().splitlines()[-1])
    assert final["event"] == "final" and final["steps"] == 20
    assert sorted(os.listdir(tmp_path)) == sorted(["m.jsonl", "tmp"] + (["ckpt"] if with_checkpoint else []))


def not_a_regular_file(tmp_path, kind):
    """A FIFO, a character device (/dev/null's numbers: root only), or symlinks
    to them and to a directory, made in tmp_path; returns its path."""
    path = tmp_path / kind.replace(" ", "-")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "char device":
        if os.geteuid() != 0:
            pytest.skip("mknod of a character device needs root")
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    elif kind == "symlink to a fifo":
        os.mkfifo(tmp_path / "f")
        path.symlink_to(tmp_path / "f")
    elif kind == "symlink to a directory":
        (tmp_path / "d").mkdir()
        path.symlink_to(tmp_path / "d")
    return path


@pytest.mark.parametrize("flag", ["save", "timeline", "keep_best", "metrics"])
@pytest.mark.parametrize("kind, says", [("fifo", "exists and is a FIFO, not a regular file; name a file"),
                                        ("char device", "exists and is a character device, not a regular file; "
                                                        "name a file"),
                                        ("symlink to a fifo", None),
                                        ("symlink to a directory", "is a directory; name a file in it")])
def test_an_output_that_is_not_a_regular_file_is_refused_and_left_alone(tmp_path, flag, kind, says):
    from hpctrain.run import outputs
    from hpctrain.base.errors import HpctrainError
    path = not_a_regular_file(tmp_path, kind)
    before = os.lstat(path)
    args = argparse.Namespace(save=None, metrics=None, timeline=None, keep_best=None, checkpoint_dir=None)
    setattr(args, flag, str(path))
    with pytest.raises(HpctrainError) as e:
        outputs.check_outputs(args)
    if kind == "symlink to a fifo" and flag == "metrics":
        says = ("is a symbolic link (the metrics file is written in place and does not follow links); "
                "name the file itself")
    elif kind == "symlink to a fifo":
        says = "exists and is a FIFO, not a regular file; name a file"
    assert str(e.value) == f"--{flag.replace('_', '-')} {path}: {says}"
    after = os.lstat(path)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)


def test_save_naming_a_device_fails_before_training_and_the_device_stays(job, tmp_path):
    dev = not_a_regular_file(tmp_path, "char device")
    r = job(2, "--steps", "100000", "--hidden", "64", "--save", dev, timeout=60)
    assert r.returncode == 2, r.stderr
    assert one_error_line(r) == f"--save {dev}: exists and is a character device, not a regular file; name a file"
    assert "step " not in r.stdout and stat.S_ISCHR(os.lstat(dev).st_mode)


def test_metrics_symlink_planted_in_a_shared_directory_is_refused(job, tmp_path):
    shared, victim = tmp_path / "shared", tmp_path / "victim"
    shared.mkdir()
    shared.chmod(0o1777)
    victim.write_text("precious\n")
    (shared / "run.jsonl").symlink_to(victim)
    r = job(2, "--steps", "100000", "--hidden", "64", "--metrics", shared / "run.jsonl", timeout=60)
    assert r.returncode == 2, r.stderr
    assert one_error_line(r) == (f"--metrics {shared / 'run.jsonl'}: is a symbolic link (the metrics file is "
                                 f"written in place and does not follow links); name the file itself")
    assert victim.read_text() == "precious\n" and os.listdir(shared) == ["run.jsonl"]


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_metrics_planted_after_the_check_is_not_followed_nor_blocks(tmp_path, planted):
    """What check_outputs saw can change before the file is opened: the open
    itself refuses a symlink (O_NOFOLLOW) and a FIFO (without blocking)."""
    from hpctrain.base.errors import HpctrainError
    from hpctrain.report.report import Metrics
    path, victim = tmp_path / "run.jsonl", tmp_path / "victim"
    victim.write_text("precious\n")
    if planted == "symlink":
        path.symlink_to(victim)
        says = "is a symbolic link (the metrics file is written in place and does not follow links)"
    else:
        os.mkfifo(path)
        says = "is not a regular file; name a file"
    for resume in (None, 10):
        with pytest.raises(HpctrainError, match=re.escape(f"--metrics {path}: {says}")):
            metrics = Metrics(str(path))
            metrics.resume_at(resume)
            metrics.write({"step": 1})
    assert victim.read_text() == "precious\n"


@pytest.fixture
def tiny_disk(tmp_path):
    """A directory on a real 8 KB file system (tmpfs: root only), unmounted after."""
    where = tmp_path / "tiny"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_metrics_on_a_disk_that_fills_mid_run_warns_and_the_run_keeps_its_results(job, tmp_path, tiny_disk):
    metrics, save, ckpt = tiny_disk / "m.jsonl", tmp_path / "p.h5", tmp_path / "ckpt"
    # ~90 bytes a record: the 8 KB fill up after about 90 steps of 300.
    r = job(2, "--steps", "300", "--log-every", "1", "--hidden", "16", "--metrics", metrics, "--save", save,
            "--checkpoint-dir", ckpt, "--checkpoint-every", "100", timeout=180)
    assert r.returncode == 0, r.stderr
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert len(lines) == 1 and re.fullmatch(rf"hpctrain: warning: --metrics {re.escape(str(metrics))}: cannot "
                                            r"write \(No space left on device\); records from step \d+ on are "
                                            r"not in it, training goes on", lines[0]), r.stderr
    text = metrics.read_text()
    assert text.endswith("\n")   # no half record left
    steps = [json.loads(line)["step"] for line in text.splitlines()]
    assert 10 < len(steps) < 300 and steps == list(range(1, len(steps) + 1))
    assert f"records from step {len(steps) + 1} on" in lines[0]
    assert "test accuracy" in r.stdout
    with h5py.File(save) as f:
        assert f.attrs["step"] == 300
    assert 300 in checkpoint_steps(ckpt)


def test_save_on_a_full_disk_is_one_line_with_the_systems_reason(job, tmp_path, tiny_disk):
    save, rescue_dir = tiny_disk / "p.h5", tmp_path / "tmp"
    rescue_dir.mkdir()
    r = job(2, "--steps", "20", "--hidden", "64", "--save", save, env={"TMPDIR": str(rescue_dir)}, timeout=120)
    assert r.returncode == 2, r.stderr
    [kept] = os.listdir(rescue_dir)
    assert one_error_line(r) == (f"--save {save}: cannot write (No space left on device); the parameters of "
                                 f"step 20 are kept in {rescue_dir / kept}")
    assert os.listdir(tiny_disk) == []


def test_a_resumed_metrics_file_drops_a_line_nested_past_what_json_parses(tmp_path):
    from hpctrain.report.report import Metrics
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n' + "[" * 100000 + "]" * 100000 + '\n{"step": 2}\n{"step": 9}\n')
    metrics = Metrics(str(path))
    metrics.resume_at(5)
    metrics.write({"step": 6})
    metrics.close()
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 6}\n'


def test_closing_a_metrics_file_keeps_it_and_offers_no_choice(tmp_path):
    from hpctrain.report.report import Metrics
    path = tmp_path / "m.jsonl"
    metrics = Metrics(str(path))
    metrics.write({"step": 1})
    metrics.close()
    assert path.read_text() == '{"step": 1}\n'
    with pytest.raises(TypeError):   # no keep=: a live metrics file is never removed
        metrics.close(keep=False)


def test_checkpoint_command_on_a_file_or_a_missing_directory_is_one_line(tmp_path):
    (tmp_path / "ckpt-00000010.h5").write_bytes(b"not hdf5")
    (tmp_path / "empty").mkdir()
    for target, code, says in [
            (tmp_path / "ckpt-00000010.h5", 2, f"hpctrain: error: {tmp_path / 'ckpt-00000010.h5'}: is a file; "
                                               f"give the checkpoint directory (--checkpoint-dir) that holds it"),
            (tmp_path / "missing", 2, f"hpctrain: error: {tmp_path / 'missing'}: no such directory"),
            (tmp_path / "empty", 0, f"{tmp_path / 'empty'}: no checkpoints (ckpt-NNNNNNNN/ or ckpt-NNNNNNNN.h5) in it")]:
        r = subprocess.run([sys.executable, "-m", "hpctrain.checkpoint", str(target)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == code and (r.stderr + r.stdout).splitlines() == [says], r.stderr + r.stdout


def test_timeline_on_a_disk_that_fills_mid_run_is_a_warning_and_leaves_nothing(job, tiny_disk):
    trace = tiny_disk / "t.json"
    r = job(2, "--steps", "300", "--hidden", "16", "--timeline", trace, timeout=180)
    assert r.returncode == 0, r.stderr
    assert [s for s in r.stderr.splitlines() if s.strip()] == [
        f"hpctrain: warning: --timeline {trace}: cannot write (No space left on device); no timeline is written, "
        f"the run goes on"], r.stderr
    assert "test accuracy" in r.stdout and os.listdir(tiny_disk) == []
