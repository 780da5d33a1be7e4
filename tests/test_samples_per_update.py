"""One definition of the samples a step takes (run/plan.py aggregated_workers,
Data.per_update), the one --epochs, the checkpoints' `samples`, samples/s and
the final record's global_batch count by (issue 41 items 5 and 7: async ps
trained E/W epochs for --epochs E and recorded a whole epoch's samples;
global_batch said every worker's batch where an update aggregates fewer).

    python -m pytest -q tests/test_samples_per_update.py
"""
import json

import h5py
import pytest

from conftest import checkpoint_file
from hpctrain.checkpoints import file as checkpoint

TRAIN = 4500   # the bundled sample's training images
SMALL = ["--hidden", "16", "--batch-size", "16", "--log-every", "1000", "--timeout", "60"]


def final_record(path):
    return json.loads(path.read_text().splitlines()[-1])


@pytest.mark.parametrize("ranks, flags, global_batch", [
    (2, ["--mode", "ring"], 2 * 16),
    (4, ["--mode", "ps", "--replicas-to-aggregate", "2"], 2 * 16),   # 3 workers, 2 aggregated: not 48
    (3, ["--mode", "ps", "--async"], 16),                            # each update one worker's batch: not 32
])
def test_the_final_records_global_batch_is_what_an_update_takes(job, tmp_path, ranks, flags, global_batch):
    metrics = tmp_path / "m.jsonl"
    r = job(ranks, *SMALL, *flags, "--steps", 6, "--metrics", metrics)
    assert r.returncode == 0, r.stderr
    record = final_record(metrics)
    assert record["global_batch"] == global_batch and record["steps"] == 6, record


def test_async_epochs_take_that_many_epochs_of_samples(job, tmp_path):
    """--epochs 0.5 at 2 async workers x 16: an update applies one worker's
    16 samples, so 2250 samples are 141 updates (not 71, a quarter epoch),
    and the last checkpoint records the samples those updates took."""
    ckpt = tmp_path / "ckpt"
    metrics = tmp_path / "m.jsonl"
    r = job(3, *SMALL, "--mode", "ps", "--async", "--epochs", 0.5, "--checkpoint-dir", ckpt, "--metrics", metrics)
    assert r.returncode == 0, r.stderr
    steps = -(-TRAIN // 2 // 16)
    assert steps == 141
    assert f"steps: 0.5 epochs of {TRAIN} samples at 1 of 2 workers x 16 (the gradients an update aggregates) " \
           f"= {steps} steps" in r.stdout, r.stdout
    assert final_record(metrics)["steps"] == steps
    (step, path), *_ = checkpoint.list_checkpoints(ckpt)
    with h5py.File(checkpoint_file(path), "r") as f:   # the folder's index
        assert step == steps and f.attrs["samples"] == steps * 16, dict(f.attrs)
