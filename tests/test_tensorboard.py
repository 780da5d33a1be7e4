"""--tensorboard DIR: the --metrics records as TensorBoard scalars, read back
here from the event files themselves (TFRecord framing, tensorboardX's
protobuf classes); a resumed run appends a file that marks the restart, so
the run reads as one; a disk that fills is a warning, never a lost run.

    .venv/bin/python -m pytest -q tests/test_tensorboard.py
"""
import json
import os
import re
import shutil
import struct
import subprocess

import pytest
from tensorboardX.proto.event_pb2 import Event

from conftest import REPO, checkpoint_path, remove_checkpoint

COMMON = ["--steps", "30", "--hidden", "16", "--log-every", "5", "--eval-every", "10", "--batch-size", "16",
          "--lr", "0.002"]


def events(path):
    """Every Event in one event file, in order (TFRecord: length, crc, data, crc)."""
    raw = path.read_bytes()
    out, at = [], 0
    while at < len(raw):
        (n,) = struct.unpack("<Q", raw[at:at + 8])
        out.append(Event.FromString(raw[at + 12:at + 12 + n]))
        at += 12 + n + 4
    assert at == len(raw)
    return out


def scalars(logdir):
    """{tag: {step: value}} as TensorBoard shows the run: the files in name
    order, a SessionLog START at step S dropping what earlier files hold at S or later."""
    seen = {}
    files = sorted(p for p in logdir.iterdir() if "tfevents" in p.name)
    for path in files:
        for e in events(path):
            if e.HasField("session_log") and e.session_log.status == e.session_log.START:
                for by_step in seen.values():
                    for s in [s for s in by_step if s >= e.step]:
                        del by_step[s]
            for v in e.summary.value:
                seen.setdefault(v.tag, {})[e.step] = v.simple_value
    return seen


def records(metrics):
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def test_each_record_is_on_disk_when_written_and_each_run_has_a_file_in_order(tmp_path):
    from hpctrain.report.tensorboard import Board
    first = Board(str(tmp_path), lr=lambda step: 0.5)
    first.resume_at(None)
    first.write({"step": 3, "loss": 1.25, "samples_per_s": 10.0})
    # Read while the writer is open, as TensorBoard follows a live run.
    assert scalars(tmp_path) == {"train/loss": {3: 1.25}, "train/samples_per_s": {3: 10.0}, "train/lr": {3: 0.5}}
    second = Board(str(tmp_path))
    second.resume_at(3)   # a resumed run, at once: a file of its own, sorted after the first
    second.write({"event": "eval", "step": 4, "test_accuracy": 0.75, "test_loss": 0.5})
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and [e.step for e in events(tmp_path / files[1]) if e.HasField("session_log")] == [4]
    assert scalars(tmp_path)["eval/test_accuracy"] == {4: 0.75}
    first.close()
    second.close()


def test_scalars_are_the_metrics_records(job, tmp_path):
    board, metrics = tmp_path / "tb", tmp_path / "m.jsonl"
    r = job(2, *COMMON, "--warmup-steps", "20", "--tensorboard", board, "--metrics", metrics)
    assert r.returncode == 0, r.stderr
    got = scalars(board)
    recs = records(metrics)
    steps = [rec for rec in recs if "event" not in rec]
    assert got["train/loss"] == {rec["step"]: f32(rec["loss"]) for rec in steps}
    assert got["train/samples_per_s"] == {rec["step"]: f32(rec["samples_per_s"]) for rec in steps}
    # The lr of each logged step (step s is 0-based step s - 1: the ramp's (s / 20) share of --lr).
    assert got["train/lr"] == {rec["step"]: f32(0.002 * min(rec["step"], 20) / 20) for rec in steps}
    evals = {rec.get("step", rec.get("steps")): rec for rec in recs if rec.get("event") in ("eval", "final")}
    assert sorted(evals) == [10, 20, 30]
    assert got["eval/test_accuracy"] == {s: f32(rec["test_accuracy"]) for s, rec in evals.items()}
    assert got["eval/test_loss"] == {s: f32(rec["test_loss"]) for s, rec in evals.items()}
    [name] = os.listdir(board)
    assert name.startswith("events.out.tfevents.")


def test_a_resumed_run_appends_and_reads_as_one(job, tmp_path):
    board, ckpt = tmp_path / "tb", tmp_path / "ckpt"
    flags = [*COMMON, "--tensorboard", board, "--checkpoint-dir", ckpt, "--checkpoint-every", "10"]
    assert job(2, *flags).returncode == 0
    # The first run goes through to step 30: its board, as it stands now, is
    # the uninterrupted run the resumed one must read as (one job fewer than
    # a run of its own; that checkpoints change no bit is test_checkpoint's).
    through = tmp_path / "through"
    shutil.copytree(board, through)
    remove_checkpoint(checkpoint_path(ckpt, 30))
    remove_checkpoint(checkpoint_path(ckpt, 20))
    r = job(2, *flags)
    assert r.returncode == 0 and "at step 10" in r.stdout, r.stderr
    assert len(os.listdir(board)) == 2
    last = events(sorted(board.iterdir())[-1])
    assert [(e.step, e.session_log.status) for e in last if e.HasField("session_log")] == [(11, 1)]   # START
    want = scalars(through)
    got = scalars(board)
    assert set(got) == set(want)
    for tag in ("train/loss", "eval/test_accuracy", "eval/test_loss", "train/lr"):
        assert got[tag] == want[tag], tag   # resume is bit-exact: the same values at the same steps


@pytest.fixture
def tiny_disk(tmp_path):
    """A directory on a real 8 KB file system (tmpfs; CI runs as root), unmounted after."""
    where = tmp_path / "tiny"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(where)], capture_output=True, text=True)
    assert r.returncode == 0, f"cannot mount a tmpfs (needs root): {r.stderr}"
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_disk_that_fills_is_a_warning_and_the_run_keeps_its_results(job, tmp_path, tiny_disk):
    save = tmp_path / "p.h5"
    r = job(2, "--steps", "400", "--log-every", "1", "--hidden", "16", "--tensorboard", tiny_disk / "tb",
            "--save", save, timeout=180)
    assert r.returncode == 0, r.stderr
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert len(lines) == 1 and re.fullmatch(rf"hpctrain: warning: --tensorboard {re.escape(str(tiny_disk / 'tb'))}: "
                                            r"cannot write \(No space left on device\); events from step \d+ on are "
                                            r"not in it, training goes on", lines[0]), r.stderr
    assert save.exists() and "test accuracy" in r.stdout


def test_without_tensorboardx_or_with_a_file_for_dir_it_is_one_line_at_start(job, tmp_path):
    stub = tmp_path / "stub" / "tensorboardX"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('no tensorboardX here')\n")
    r = job(2, "--steps", "2", "--tensorboard", tmp_path / "tb", "--checkpoint-dir", tmp_path / "ckpt",
            env={"PYTHONPATH": f"{stub.parent}{os.pathsep}{REPO}"})
    errors = [s for s in r.stderr.splitlines() if s.startswith("hpctrain:")]
    assert r.returncode == 2 and errors == ["hpctrain: error: --tensorboard needs tensorboardX, an optional "
                                            "dependency: pip install 'hpctrain[tensorboard]'"], r.stderr
    assert not (tmp_path / "tb").exists() and not (tmp_path / "ckpt").exists()
    (tmp_path / "file").write_text("")
    r = job(2, "--steps", "2", "--tensorboard", tmp_path / "file")
    assert r.returncode == 2 and f"--tensorboard {tmp_path / 'file'}: exists and is not a directory" in r.stderr


@pytest.mark.parametrize("mode", [0o644, 0o755])
def test_a_dir_under_a_file_is_one_line_at_start_whatever_the_files_mode(job, tmp_path, mode):
    # issue 41, 23: under an executable FILE, FILE/sub passed the start-up check
    # (os.access X_OK) and became a warning at the first write; otherwise an error.
    (tmp_path / "file").write_text("")
    os.chmod(tmp_path / "file", mode)
    r = job(2, "--steps", "2", "--tensorboard", tmp_path / "file" / "sub", "--save", tmp_path / "p.h5")
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert r.returncode == 2 and lines == [f"hpctrain: error: --tensorboard {tmp_path / 'file' / 'sub'}: is under "
                                           f"{tmp_path / 'file'}, which is a file, not a directory"], r.stderr
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_the_end_line_says_how_to_get_the_viewer_where_it_is_not_installed(monkeypatch):
    """tensorboardX writes the files but brings no viewer: `tensorboard
    --logdir DIR` alone where it is installed, how to get it where not (issue 54 N3)."""
    import importlib.util
    import shutil
    from hpctrain.report.report import tensorboard_view
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert tensorboard_view("runs/a") == "to view them: pip install tensorboard, then tensorboard --logdir runs/a"
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    assert tensorboard_view("runs/a") == "tensorboard --logdir runs/a"
