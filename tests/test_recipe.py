"""The training recipe: --lr-schedule, --weight-decay, --epochs.

Unit tests of the schedule's values and the epochs arithmetic, then real
mpirun jobs (the `job` fixture): defaults that change nothing, weight decay
the same sharded or not and in ps sync as in ring, each option resumed bit for
bit, and bad values as one line and exit 2.

    .venv/bin/python -m pytest tests/test_recipe.py
"""
import numpy as np
import pytest

from conftest import checkpoint_path, remove_checkpoint, same_bytes, saved
from hpctrain.run.plan import steps_for_epochs
from hpctrain.optim.optimizers import make_optimizer
from hpctrain.optim.lr_schedule import learning_rate, schedule_line

SMALL = ["--hidden", "64", "--log-every", "1000"]


def ok(r):
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


# --- units ------------------------------------------------------------------

def test_constant_is_todays_schedule():
    for step in (0, 3, 9, 10, 500):
        assert learning_rate(step, 0.1, 4, True, 10, schedule="constant") == \
            learning_rate(step, 0.1, 4, True, 10)


def test_step_schedule_decays_every_n_steps_under_the_warm_up():
    lr = [learning_rate(s, 1.0, schedule="step", decay=0.5, decay_steps=3) for s in range(7)]
    assert lr == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25]
    # the warm-up ramps whatever the schedule gives
    assert learning_rate(3, 1.0, warmup_steps=5, schedule="step", decay=0.5, decay_steps=3) == 0.5 * 4 / 5


def test_cosine_starts_after_the_warm_up_and_ends_at_lr_min_on_the_last_step():
    def lr(s):
        return learning_rate(s, 2.0, warmup_steps=4, schedule="cosine", lr_min=0.5, total_steps=25)
    assert lr(0) == pytest.approx(0.5) and lr(3) == 2.0 and lr(4) == 2.0
    assert lr(14) == pytest.approx(0.5 + 1.5 * 0.5)       # half way: the mean of base and lr_min
    assert lr(24) == pytest.approx(0.5) and lr(1000) == pytest.approx(0.5)
    assert all(lr(s) >= lr(s + 1) for s in range(4, 30))
    assert learning_rate(0, 1.0, 4, True, schedule="cosine", total_steps=1) == 4.0   # one step: no decay


def test_schedule_line_names_the_key_points():
    assert schedule_line(1e-4, warmup_steps=100, schedule="cosine", total_steps=2000) == \
        "lr: cosine from 0.0001 (after 100 warm-up steps) to 0 at step 2000"
    assert schedule_line(0.1, schedule="step", decay=0.1, decay_steps=500) == \
        "lr: step from 0.1, times 0.1 every 500 steps"


def test_epochs_round_up_to_whole_steps():
    assert steps_for_epochs(1, 4500, 2 * 32) == 71          # 70.3 -> 71
    assert steps_for_epochs(0.5, 4500, 2 * 32) == 36
    assert steps_for_epochs(2, 64, 2 * 32) == 2
    assert steps_for_epochs(1e-9, 4500, 2 * 32) == 1


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_weight_decay_is_decoupled_and_zero_changes_nothing(name):
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(1000).astype(np.float32)
    g = rng.standard_normal(1000).astype(np.float32)
    plain, zero, wd, slices = (p0.copy() for _ in range(4))
    make_optimizer(name, 1000).step(plain, g, 0.1)
    make_optimizer(name, 1000, weight_decay=0.0).step(zero, g, 0.1)
    make_optimizer(name, 1000, weight_decay=0.3).step(wd, g, 0.1)
    assert zero.tobytes() == plain.tobytes()
    # first step: p * (1 - lr * wd), then the same update as without decay
    expect = p0 * np.float32(1 - 0.1 * 0.3) + (plain - p0)
    np.testing.assert_allclose(wd, expect, rtol=1e-5, atol=1e-6)
    opt = make_optimizer(name, 1000, weight_decay=0.3, owned=[(0, 300), (300, 1000)])
    opt.begin(0.1)
    opt.update(slices, g, 300, 1000)
    opt.update(slices, g, 0, 300)
    assert slices.tobytes() == wd.tobytes()


# --- jobs -------------------------------------------------------------------

def test_defaults_are_bit_identical_to_no_new_flags(job, tmp_path):
    common = ["--steps", 30, *SMALL]
    ok(job(2, *common, "--save", tmp_path / "plain.h5"))
    ok(job(2, *common, "--lr-schedule", "constant", "--weight-decay", 0, "--lr-min", 0, "--lr-decay", 0.1,
           "--save", tmp_path / "explicit.h5"))
    assert same_bytes(tmp_path / "plain.h5", tmp_path / "explicit.h5")


def test_weight_decay_sharded_equals_unsharded_ring(job, tmp_path):
    # small buckets: several per step, each rank owning part of each
    common = ["--steps", 30, *SMALL, "--lr", 1e-3, "--fusion-mb", 0.05]
    ok(job(2, *common, "--weight-decay", 0.5, "--shard-optimizer", "off", "--save", tmp_path / "off.h5"))
    ok(job(2, *common, "--weight-decay", 0.5, "--shard-optimizer", "on", "--save", tmp_path / "on.h5"))
    ok(job(2, *common, "--save", tmp_path / "nowd.h5"))
    assert same_bytes(tmp_path / "off.h5", tmp_path / "on.h5")
    assert not same_bytes(tmp_path / "off.h5", tmp_path / "nowd.h5")   # the decay did something


def test_weight_decay_and_cosine_in_sync_ps_equal_ring_under_sgd(job, tmp_path):
    common = ["--optimizer", "sgd", "--lr", 0.05, "--steps", 20, *SMALL, "--weight-decay", 0.1,
              "--lr-schedule", "cosine", "--warmup-steps", 3]
    ok(job(3, "--mode", "ps", "--num-ps", 1, "--sync", *common, "--save", tmp_path / "ps.h5"))
    ok(job(2, "--mode", "ring", *common, "--save", tmp_path / "ring.h5"))
    a, b = saved(tmp_path / "ps.h5"), saved(tmp_path / "ring.h5")
    assert set(a) == set(b)
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) < 1e-6


@pytest.mark.parametrize("mode", ["ring", "ps"])
def test_recipe_survives_checkpoint_and_resume_bit_exact(job, tmp_path, mode):
    ranks = ["--mode", "ps", "--num-ps", 1] if mode == "ps" else []
    n = 3 if mode == "ps" else 2
    ckpt = tmp_path / "ckpt"
    recipe = [*ranks, *SMALL, "--lr-schedule", "cosine", "--lr-min", 1e-5, "--warmup-steps", 4,
             "--weight-decay", 0.05, "--checkpoint-dir", ckpt, "--checkpoint-every", 10]
    flags = ["--epochs", 0.5, *recipe]
    r = ok(job(n, *flags, "--save", tmp_path / "full.h5"))
    # 0.5 epochs of the bundled sample's 4500 training images at 2 workers x 32
    assert "= 36 steps" in r.stdout and "lr: cosine from 0.0001 (after 4 warm-up steps) to 1e-05 at step 36" \
        in r.stdout
    remove_checkpoint(checkpoint_path(ckpt, 36))
    r = ok(job(n, *flags, "--save", tmp_path / "resumed.h5"))
    assert "at step 30" in r.stdout
    assert same_bytes(tmp_path / "full.h5", tmp_path / "resumed.h5")
    if mode == "ring":
        # a cosine that would end elsewhere takes another path: refused
        remove_checkpoint(checkpoint_path(ckpt, 36))
        r = job(n, "--steps", 50, *recipe)
        lines = [s for s in r.stderr.splitlines() if s.strip()]
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert "written with --lr-schedule cosine to 1e-05 at step 36, this run has --lr-schedule " \
               "cosine to 1e-05 at step 50" in lines[0]


def test_step_schedule_resumes_bit_exact(job, tmp_path):
    ckpt = tmp_path / "ckpt"
    flags = ["--steps", 25, *SMALL, "--optimizer", "momentum", "--lr", 0.01, "--lr-schedule", "step",
             "--lr-decay", 0.5, "--lr-decay-steps", 7, "--checkpoint-dir", ckpt, "--checkpoint-every", 10]
    ok(job(2, *flags, "--save", tmp_path / "full.h5"))
    remove_checkpoint(checkpoint_path(ckpt, 25))
    r = ok(job(2, *flags, "--save", tmp_path / "resumed.h5"))
    assert "at step 20" in r.stdout
    assert same_bytes(tmp_path / "full.h5", tmp_path / "resumed.h5")


@pytest.mark.parametrize("flags, expect", [
    (["--weight-decay", "-0.1"], "argument --weight-decay: must be >= 0, got -0.1"),
    (["--lr-schedule", "step"], "--lr-schedule step needs --lr-decay-steps N (N > 0)"),
    (["--epochs", "1", "--steps", "5"], "argument --steps: not allowed with argument --epochs"),
])
def test_bad_recipe_flags_are_one_line_and_exit_2(job, tmp_path, flags, expect):
    # The start-up checks in this process, as run/startup.py runs them (the
    # parser, then cli.validate at 2 ranks); the first on the whole job too
    # (a refused flag is one line and exit 2 the same way for every flag:
    # tests/faults/test_bad_flags.py)
    from hpctrain.base.errors import HpctrainError
    from hpctrain.flags import cli
    with pytest.raises(HpctrainError) as refused:
        cli.validate(cli.parse([*map(str, flags)], quiet=True), 2)
    assert expect in str(refused.value) and "\n" not in str(refused.value)
    if flags[0] != "--weight-decay":
        return
    r = job(2, *flags, "--save", tmp_path / "p.h5", timeout=60)
    lines = [s for s in r.stderr.splitlines() if s.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("hpctrain: error: ") and expect in lines[0], lines
    assert not (tmp_path / "p.h5").exists()

