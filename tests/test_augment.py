"""--augment crop,flip: each sample's crop and flip a pure function of
(seed, epoch, sample id), so N workers see what one process sees, bit for
bit, and a resumed run sees what an uninterrupted one does; refused for data
prepared with --no-flip. The transforms against a direct loop, the readers
against each other, and real jobs (tests/record_pixels.py records what each
rank's samples looked like).

    .venv/bin/python -m pytest -q tests/test_augment.py
"""
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from conftest import MPIRUN, REPO, checkpoint_path, remove_checkpoint, same_bytes, saved
from hpctrain import data
from hpctrain.run.cluster import child_env
from hpctrain.data.augment import Augment
from hpctrain.base.errors import HpctrainError
from test_data import make_single_source, quiet

TINY = os.path.join(REPO, "tests", "models", "tiny_cnn.py")


def reference(image, dy, dx, flip, pad):
    """One sample by hand: zero padding, the window at (dy, dx), then the mirror."""
    padded = np.pad(image, [(pad, pad), (pad, pad)] + [(0, 0)] * (image.ndim - 2))
    out = padded[dy:dy + image.shape[0], dx:dx + image.shape[1]]
    return out[:, ::-1] if flip else out


@pytest.mark.parametrize("shape", [(28, 28), (8, 6, 3)])
def test_crop_and_flip_are_what_a_direct_loop_does(shape):
    rng = np.random.default_rng(1)
    batch = rng.integers(0, 256, (64, int(np.prod(shape))), dtype=np.uint8)
    ids = rng.permutation(1000)[:64]
    aug = Augment("crop,flip", shape, seed=5)
    assert aug.pad == max(1, min(shape[:2]) // 8)
    dy, dx, flip = aug.draws(3, ids)
    got = aug.apply(batch.copy(), 3, ids)
    for i in range(64):
        want = reference(batch[i].reshape(shape), dy[i], dx[i], flip[i], aug.pad)
        np.testing.assert_array_equal(got[i].reshape(shape), want)
    # Only the flip, only the crop (with its own padding).
    np.testing.assert_array_equal(Augment("flip", shape, 5).apply(batch.copy(), 3, ids)[0].reshape(shape),
                                  reference(batch[0].reshape(shape), 0, 0, flip[0], 0))
    crop2 = Augment("crop=2", shape, 5)
    dy2, dx2, _ = crop2.draws(3, ids)
    assert crop2.pad == 2 and dy2.max() <= 4 and dx2.max() <= 4
    np.testing.assert_array_equal(crop2.apply(batch.copy(), 3, ids)[7].reshape(shape),
                                  reference(batch[7].reshape(shape), dy2[7], dx2[7], False, 2))


def test_draws_are_a_function_of_seed_epoch_and_sample_id_alone():
    aug = Augment("crop,flip", (32, 32, 3), seed=0)
    ids = np.arange(20000)
    dy, dx, flip = aug.draws(0, ids)
    order = np.random.default_rng(0).permutation(20000)
    for a, b in zip(aug.draws(0, ids[order]), (dy, dx, flip)):
        np.testing.assert_array_equal(a, b[order])   # the same sample, wherever it sits in a batch
    assert Counter(dy.tolist()).keys() == set(range(9)) and Counter(dx.tolist()).keys() == set(range(9))
    assert abs(flip.mean() - 0.5) < 0.02 and abs(dy.mean() - 4) < 0.1 and np.corrcoef(dy, dx)[0, 1] < 0.05
    other_epoch, other_seed = aug.draws(1, ids), Augment("crop,flip", (32, 32, 3), seed=1).draws(0, ids)
    for other in (other_epoch, other_seed):
        assert (other[0] != dy).mean() > 0.8 and (other[2] != flip).mean() > 0.4


@pytest.fixture(scope="module")
def numbered_shards(tmp_path_factory):
    base = tmp_path_factory.mktemp("aug")
    data.prepare(make_single_source(base / "src", n=600), base / "shards", shards=4, log=quiet)
    return base / "shards"


@pytest.mark.parametrize("resident", [True, False])
def test_n_workers_see_bit_for_bit_what_one_process_sees(numbered_shards, resident):
    keep = {} if resident else {"resident_bytes": 0}
    one = data.ShardReader(numbered_shards, 0, 1, 24, seed=7, augment="crop,flip", **keep)
    three = [data.ShardReader(numbered_shards, w, 3, 8, seed=7, augment="crop,flip", **keep) for w in range(3)]
    plain = data.ShardReader(numbered_shards, 0, 1, 24, seed=7)
    changed = 0
    for _ in range(50):   # past the end of the first epoch (22 steps of 24)
        x, _ = one.next_batch()
        parts = np.concatenate([r.next_batch()[0] for r in three])
        assert parts.tobytes() == x.tobytes()
        changed += int((plain.next_batch()[0] != x).any(axis=1).sum())
    assert one.position[0] == 2 and changed > 0.9 * 50 * 24   # a few samples draw no shift and no flip


def test_a_resumed_reader_draws_what_an_uninterrupted_one_does(numbered_shards):
    through = data.ShardReader(numbered_shards, 0, 2, 8, seed=3, augment="crop,flip")
    batches = [through.next_batch()[0].copy() for _ in range(40)]
    resumed = data.ShardReader(numbered_shards, 0, 2, 8, seed=3, augment="crop,flip")
    for _ in range(25):
        resumed.next_batch()
    epoch, pos = resumed.position
    again = data.ShardReader(numbered_shards, 0, 2, 8, seed=3, augment="crop,flip")
    again.seek(epoch, pos)
    for want in batches[25:]:
        assert again.next_batch()[0].tobytes() == want.tobytes()


def test_flip_is_refused_for_data_prepared_with_no_flip(tmp_path):
    data.prepare(make_single_source(tmp_path / "src", n=100), tmp_path / "digits", shards=2, no_flip=True,
                 log=quiet)
    with pytest.raises(HpctrainError, match="--augment flip: .*digits was prepared with --no-flip"):
        data.ShardReader(tmp_path / "digits", 0, 1, 8, 0, augment="crop,flip")
    data.ShardReader(tmp_path / "digits", 0, 1, 8, 0, augment="crop")   # a crop is fine
    env = child_env()
    r = subprocess.run([MPIRUN, "-n", "2", sys.executable, "-m", "hpctrain.train", "--data", tmp_path / "digits",
                        "--augment", "flip", "--steps", "2", "--checkpoint-dir", tmp_path / "ckpt"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    lines = [line for line in r.stderr.splitlines() if line.startswith("hpctrain:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0] == (f"hpctrain: error: --augment flip: {tmp_path / 'digits'} was prepared with --no-flip "
                        f"(a mirrored image is another class there, or none); use --augment crop")
    assert not (tmp_path / "ckpt").exists()   # refused at start-up, before the outputs are made
    r = subprocess.run([sys.executable, "-m", "hpctrain.train", "--augment", "turn"], capture_output=True, text=True,
                       timeout=60, env=env, cwd=REPO)
    assert r.returncode == 2 and "--augment: expected crop, crop=P (P >= 1 pixels) and/or flip" in r.stderr


def test_a_crop_past_the_image_is_refused_at_start_up_and_a_wide_one_warned(tmp_path):
    # crop=P past the image once crashed at the first batch, allocating terabytes for the padded batch.
    data.prepare(make_single_source(tmp_path / "src", n=100), tmp_path / "digits", shards=2, log=quiet)
    with pytest.raises(HpctrainError, match=r"--augment crop=28: the padding must be smaller than the images' "
                                            r"smaller side \(28x28 in .*digits: at most 27\)"):
        data.ShardReader(tmp_path / "digits", 0, 1, 8, 0, augment="crop=28")
    assert data.check_augment("crop=7", tmp_path / "digits") is None   # a quarter of 28: no warning
    env = child_env()
    common = [sys.executable, "-m", "hpctrain.train", "--data", tmp_path / "digits", "--steps", "1",
              "--batch-size", "8"]
    r = subprocess.run([MPIRUN, "-n", "2", *common, "--augment", "crop=100000", "--checkpoint-dir", tmp_path / "ckpt"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    lines = [line for line in r.stderr.splitlines() if line.startswith("hpctrain:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("hpctrain: error: --augment crop=100000: the padding must be smaller"), lines
    assert not (tmp_path / "ckpt").exists()   # refused before the outputs are made
    r = subprocess.run([*common, "--augment", "crop=8"], capture_output=True, text=True, timeout=120, env=env,
                       cwd=REPO)
    warnings = [line for line in r.stderr.splitlines() if "warning" in line]
    assert r.returncode == 0, r.stderr
    assert warnings == ["hpctrain: warning: --augment crop=8: more than a quarter of the images' smaller side "
                        "(28x28); windows may lose much of the image (the default is 3)"], r.stderr


# ---------------------------------------------------------------------------
# Real jobs

def recorded_job(n, out, *args):
    out.mkdir()
    env = dict(child_env(), RECORD_PIXELS=str(out))
    r = subprocess.run([MPIRUN, "-n", str(n), sys.executable, os.path.join(REPO, "tests", "record_pixels.py"),
                        *map(str, args)], capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr
    lines = sorted(line for p in out.iterdir() for line in p.read_text().splitlines())
    return r, lines


def test_augmented_jobs_n_ranks_see_one_process_and_resume_bit_exactly(tmp_path):
    common = ["--model", f"{TINY}:without_batch_norm", "--optimizer", "sgd", "--lr", "0.05", "--steps", "20",
              "--log-every", "10", "--augment", "crop,flip"]
    # (its checkpoints are the ones the resume below starts from: one run, not two)
    ckpt = tmp_path / "ckpt"
    _, two = recorded_job(2, tmp_path / "two", *common, "--batch-size", "8", "--checkpoint-dir", ckpt,
                          "--checkpoint-every", "10", "--save", tmp_path / "two.h5")
    _, one = recorded_job(1, tmp_path / "one", *common, "--batch-size", "16", "--save", tmp_path / "one.h5")
    assert two == one and len(one) == 20 * 16   # every sample, its pixels as augmented, bit for bit
    a, b = saved(tmp_path / "two.h5"), saved(tmp_path / "one.h5")
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) < 1e-5   # the sums' order differs, nothing else
    _, plain = recorded_job(1, tmp_path / "plain", *common[:-2], "--batch-size", "16", "--save", tmp_path / "p.h5")
    assert [line.split()[:2] for line in plain] == [line.split()[:2] for line in one] and plain != one

    # Stopped at a checkpoint and resumed: the bits of the run through.
    resumable = [*common, "--batch-size", "8", "--checkpoint-dir", ckpt, "--checkpoint-every", "10",
                 "--save", tmp_path / "resumed.h5"]
    remove_checkpoint(checkpoint_path(ckpt, 20))
    r, second = recorded_job(2, tmp_path / "second", *resumable)
    assert "at step 10" in r.stdout
    assert same_bytes(tmp_path / "two.h5", tmp_path / "resumed.h5")
    assert set(second) <= set(two) and len(second) == 10 * 16
