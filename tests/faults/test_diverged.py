"""Faults: a loss that becomes inf/nan stops the run with one line naming the
step and exit 4 (EXIT_DIVERGED), and no checkpoint of those parameters.

    .venv/bin/python -m pytest tests/faults/test_diverged.py
"""
import os

import pytest

from hpctrain.errors import EXIT_DIVERGED


@pytest.mark.parametrize("ranks, mode", [(2, "ring"), (3, "ps")])
def test_a_diverging_run_stops_with_one_line_and_exit_4(job, tmp_path, ranks, mode):
    ckpt = tmp_path / "ckpt"
    r = job(ranks, "--mode", mode, "--optimizer", "sgd", "--lr", "1e30", "--steps", "50", "--hidden", "32",
            "--checkpoint-dir", ckpt, "--checkpoint-every", "1", "--save", tmp_path / "p.h5", timeout=120)
    assert r.returncode == EXIT_DIVERGED == 4, r.stderr
    lines = [s for s in r.stderr.splitlines() if s.strip() and not s.startswith("Abort(")]
    assert len(lines) == 1 and "training diverged" in lines[0] and " at step " in lines[0], r.stderr
    assert "Warning" not in r.stderr and "Traceback" not in r.stderr
    # What is in the checkpoint directory is finite (written before the loss went bad).
    import h5py
    import numpy as np
    for name in os.listdir(ckpt):
        with h5py.File(ckpt / name) as f:
            assert np.isfinite(f["params"][()]).all(), name
    assert not (tmp_path / "p.h5").exists()
