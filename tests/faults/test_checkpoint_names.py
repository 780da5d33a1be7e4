"""Faults: a checkpoint whose name lies about its step (a copy renamed
`ckpt-99999999`). Before, it pinned every later run to its old step and
pruning by name deleted the real newest checkpoints.

    .venv/bin/python -m pytest tests/faults/test_checkpoint_names.py
"""
import os
import shutil


def test_a_renamed_copy_is_reported_and_skipped_and_never_pruned_for(job, tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = ["--hidden", "64", "--log-every", "10", "--checkpoint-dir", ckpt, "--checkpoint-every", "10"]
    r = job(2, "--steps", "20", *flags, timeout=120)
    assert r.returncode == 0, r.stderr
    shutil.copytree(ckpt / "ckpt-00000010", ckpt / "ckpt-99999999")

    r = job(2, "--steps", "40", *flags, "--save", tmp_path / "p.h5", timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert lines == ["hpctrain: warning: ckpt-99999999: its name says step 99999999 but it holds step 10 "
                     "(a renamed copy?), skipped; trying the previous one"], r.stderr
    assert f"resumed from {ckpt / 'ckpt-00000020'} at step 20" in r.stdout
    # the newest 3 up to the last one written, and the liar left alone
    assert sorted(os.listdir(ckpt)) == ["ckpt-00000020", "ckpt-00000030", "ckpt-00000040", "ckpt-99999999"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "p.h5"]
