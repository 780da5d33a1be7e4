"""Faults: a loss that becomes inf/nan stops the run with one line naming the
step and exit 4 (EXIT_DIVERGED), and no checkpoint of those parameters.

    .venv/bin/python -m pytest tests/faults/test_diverged.py
"""

import pytest

from conftest import checkpoint_floats, checkpoint_steps, checkpoints
from hpctrain.base.errors import EXIT_DIVERGED


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
    import numpy as np
    for _, path in checkpoints(ckpt):
        floats = checkpoint_floats(path)
        assert floats and all(np.isfinite(a).all() for a in floats.values()), path
    assert not (tmp_path / "p.h5").exists()


# A layer whose gradient is NaN from its {first}-th training forward on (the
# spec check runs it once first): with one forward per step, the last step's
# loss (computed before its update) is finite, the parameters after it not.
NAN_AT = ("import numpy as np\nfrom hpctrain.nn import Dense, Flatten, Layer\n\nCALLS = [0]\n\n\n"
          "class NaNAt(Layer):\n    def forward(self, ctx, x, train):\n        CALLS[0] += train\n"
          "        return x * 1\n\n    def backward(self, ctx, dy, need_dx):\n"
          "        return dy * np.float32('nan') if CALLS[0] >= {first} else dy\n\n\n"
          "def build(shape, classes):\n    return [Flatten(), Dense(16), NaNAt(), Dense(classes)]\n")


@pytest.mark.parametrize("flags", [["--mode", "ring"], ["--pipeline-stages", "2"], ["--mode", "ps"],
                                   ["--compression", "fp16"]],   # a NaN gradient is no fp16 overflow
                         ids=["ring", "pipeline", "ps", "ring-fp16"])
def test_a_nan_gradient_in_the_last_step_is_no_result(job, tmp_path, flags):
    # Issue 27, 2: the divergence check read the loss, and the parameters were
    # checked only for a checkpoint: --save was all NaN, "test loss nan", rc 0.
    # (The pipeline, one micro-batch a step: stage 0 holds the layer.)
    model = tmp_path / "m.py"
    model.write_text(NAN_AT.format(first=1 + 8))
    ranks = 3 if "ps" in flags else 2
    r = job(ranks, *flags, "--model", f"{model}:build", "--steps", "8", "--log-every", "4", "--optimizer", "sgd",
            "--save", tmp_path / "p.h5", "--metrics", tmp_path / "m.jsonl", timeout=120)
    assert r.returncode == EXIT_DIVERGED, r.stderr
    lines = [s for s in r.stderr.splitlines() if s.startswith("hpctrain: error:")]
    assert lines == ["hpctrain: error: the parameters after step 8 are not finite: training diverged in its last "
                     "step (try a lower --lr or --warmup-steps); no --save, no final record"], r.stderr
    assert not (tmp_path / "p.h5").exists()
    assert '"final"' not in (tmp_path / "m.jsonl").read_text()


def test_a_nan_step_is_never_the_best(job, tmp_path):
    # --keep-best at the step whose update made the parameters NaN: not written
    data = tmp_path / "data"
    from hpctrain import data as data_mod
    data_mod.prepare(data_mod.bundled_sample_dir(), data, val_fraction=0.1, log=None)
    model = tmp_path / "m.py"
    model.write_text(NAN_AT.format(first=1 + 4))
    r = job(2, "--model", f"{model}:build", "--data", data, "--steps", "5", "--eval-every", "4", "--optimizer",
            "sgd", "--keep-best", tmp_path / "best.h5", timeout=120)
    assert r.returncode == EXIT_DIVERGED and "training diverged" in r.stderr, r.stderr
    if (tmp_path / "best.h5").exists():
        import h5py
        import numpy as np
        with h5py.File(tmp_path / "best.h5") as f:
            assert all(np.isfinite(f[g][k][()]).all() for g in f for k in f[g])


# A layer that multiplies its gradient by 1e9 on rank {rank} from its third
# training forward (the spec check runs it once first), so that the
# first layer's gradient there holds values far past fp16's 65504 (x 2
# ranks), all finite in float32; a learning rate that keeps the parameters
# finite there.
BOOST_ON_RANK = ("import os\nfrom hpctrain.nn import Dense, Flatten, Layer\n\nCALLS = [0]\n\n\n"
                   "class Boost(Layer):\n    def forward(self, ctx, x, train):\n        CALLS[0] += train\n"
                   "        return x * 1\n\n    def backward(self, ctx, dy, need_dx):\n"
                   "        big = CALLS[0] >= 3 and os.environ.get('PMI_RANK') == '{rank}'\n"
                   "        return dy * 1e9 if big else dy\n\n\n"
                   "def build(shape, classes):\n    return [Flatten(), Dense(16), Boost(), Dense(classes)]\n")


@pytest.mark.parametrize("ranks, boost, layout", [
    (2, 1, ["--shard-optimizer", "on"]), (2, 1, ["--shard-optimizer", "off"]),
    (4, 3, ["--pipeline-stages", "2"]),   # the layer on stage 1 (ranks 2, 3): rank 1's gradient, stage 0's wire
], ids=["sharded", "unsharded", "pipeline"])
def test_an_fp16_wire_overflow_is_named_as_such_not_as_divergence(job, tmp_path, ranks, boost, layout):
    # Issue 41, 21: it said "training diverged (try a lower --lr)" where bf16 and none train.
    model = tmp_path / "m.py"
    model.write_text(BOOST_ON_RANK.format(rank=boost))
    flags = ["--model", f"{model}:build", "--steps", "5", "--log-every", "5", "--optimizer", "sgd", "--lr", "1e-12",
             *layout, "--checkpoint-dir", tmp_path / "ckpt", "--checkpoint-every", "1"]
    r = job(ranks, *flags, "--compression", "fp16", "--save", tmp_path / "p.h5", timeout=120)
    assert r.returncode == EXIT_DIVERGED, r.stderr
    lines = [s for s in r.stderr.splitlines() if s.startswith("hpctrain: error:")]
    assert lines == ["hpctrain: error: the gradients' sum at step 2 overflowed the 16-bit wire of --compression "
                     "fp16 (a value past fp16's largest, 65504, after dividing by the ranks) though every rank's "
                     "gradient was finite: use --compression bf16 (float32's range, the same bytes) or none; no "
                     "checkpoint of these parameters is written"], r.stderr
    assert not (tmp_path / "p.h5").exists() and 2 not in checkpoint_steps(tmp_path / "ckpt")
    r = job(ranks, *flags[:-4], "--compression", "bf16", "--save", tmp_path / "p.h5", timeout=120)
    assert r.returncode == 0, r.stderr
