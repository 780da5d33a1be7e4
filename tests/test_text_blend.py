"""Blends of prepared text sets (issue 57 §5, data/blend.py): each set drawn
at its weight's share, the same windows on 1 and 4 workers, a resume at
another number of workers continuing the same samples, and the sets held
to one vocabulary. In process, two tiny byte-level sets:

    .venv/bin/python -m pytest -q tests/test_text_blend.py
"""

import numpy as np
import pytest

from hpctrain import data
from hpctrain.base.errors import HpctrainError
from hpctrain.data.blend import BlendReader, describe_blend, parse_blend, schedule
from hpctrain.data.tokens import TokenShards

T = 8


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """Two byte-level sets: lower-case and upper-case letters (a window
    tells which set it came from), and a character-level one."""
    root = tmp_path_factory.mktemp("blend")
    for name, text in (("lower", "abcdefghij" * 300), ("upper", "KLMNOPQRSTUVWXYZ" * 90)):
        (root / f"{name}.txt").write_text(text)
        data.prepare_text(root / f"{name}.txt", root / name, "bytes", log=None)
    data.prepare_text(root / "lower.txt", root / "chars", "chars", log=None)
    return root


def test_each_set_is_drawn_at_its_share_over_1000_steps(sets):
    blend = parse_blend(f"{sets / 'lower'}:0.7,{sets / 'upper'}:0.3")
    reader = BlendReader(blend, 0, 1, 8, seed=3, block_size=T)
    lower = 0
    for _ in range(1000):
        x, _ = reader.next_batch()
        assert ((x >= ord("a")).all(axis=1) | (x < ord("a")).all(axis=1)).all()   # one set a window
        lower += int((x[:, 0] >= ord("a")).sum())
    assert abs(lower / 8000 - 0.7) < 0.01
    # and a set's windows come once per its own epoch: its first n samples are n distinct windows
    sets_, offsets = reader.locate(np.arange(20_000))
    upper = offsets[sets_ == 1]
    n = reader.windows[1]
    assert len(np.unique(upper[:n])) == n


def test_one_and_four_workers_take_the_same_windows_and_resume_anywhere(sets):
    blend = parse_blend(f"{sets / 'lower'}:2,{sets / 'upper'}:1")
    one = BlendReader(blend, 0, 1, 12, seed=0, block_size=T)
    four = [BlendReader(blend, w, 4, 3, seed=0, block_size=T) for w in range(4)]
    for _ in range(30):
        x1, y1 = one.next_batch()
        rows = [r.next_batch() for r in four]
        assert np.array_equal(x1, np.concatenate([x for x, _ in rows]))
        assert np.array_equal(y1, np.concatenate([y for _, y in rows]))
    assert four[0].position == one.position == (0, 360)
    # a resume at 3 workers goes on with the samples one worker takes next
    three = [BlendReader(blend, w, 3, 4, seed=0, block_size=T) for w in range(3)]
    for r in three:
        r.seek(*four[0].position)
    x1, _ = one.next_batch()
    assert np.array_equal(x1, np.concatenate([r.next_batch()[0] for r in three]))
    # the windows are the sets' own: rows read from the set directly
    sets_, offsets = one.locate(one.last_ids)
    for row, i, at in zip(x1, sets_, offsets):
        assert np.array_equal(row, TokenShards(blend[i][0]).read(at, at + T))


def test_the_schedule_gives_each_set_its_quota_each_period():
    slots, nth, quotas = schedule([0.5, 0.3, 0.2], period=100)
    assert quotas.tolist() == [50, 30, 20] and np.bincount(slots).tolist() == [50, 30, 20]
    for i in range(3):   # nth counts the set's earlier slots
        assert nth[slots == i].tolist() == list(range(quotas[i]))
    lag = np.abs(np.cumsum(slots[:, None] == np.arange(3), axis=0) - np.outer(np.arange(1, 101), [0.5, 0.3, 0.2]))
    assert lag.max() < 1


def test_a_bad_blend_is_one_line(sets):
    with pytest.raises(HpctrainError, match=r"its vocabulary, chars:10 \(digest \w+\), is not .*lower's, "
                                            r"bytes:256 .*: a blend's sets must be encoded with one tokenizer"):
        BlendReader(parse_blend(f"{sets / 'lower'}:1,{sets / 'chars'}:1"), 0, 1, 4, 0, T)
    for spec, line in ((f"{sets / 'lower'}:0.5,{sets / 'upper'}", "a blend is DIR:WEIGHT,DIR:WEIGHT"),
                       (f"{sets / 'lower'}:0,{sets / 'upper'}:1", "a positive weight each"),
                       (f"{sets / 'lower'}:1,{sets / 'lower'}:2", "a directory given twice")):
        with pytest.raises(HpctrainError, match=line):
            parse_blend(spec)
    assert parse_blend(str(sets / "lower")) is None
    assert describe_blend(parse_blend(f"{sets / 'lower'}:3,{sets / 'upper'}:1"), T).startswith(
        f"{sets / 'lower'} 75.0% (2692 windows), {sets / 'upper'} 25.0% (")


def test_a_gpt_trains_on_a_blend_and_resumes_it_at_another_world_size(sets, tmp_path, job):
    """The mix in the start line; a checkpoint of 2 ranks resumed at 1 at
    another global batch (the blend's position: its samples taken);
    another mix is other data, refused."""
    spec = f"{sets / 'lower'}:0.7,{sets / 'upper'}:0.3"
    flags = ["--model", "gpt:layers=1,heads=2,width=32", "--block-size", T, "--eval-tokens", 64,
             "--checkpoint-dir", tmp_path / "ckpt", "--checkpoint-every", 2, "--timeout", 60]
    r = job(2, "--data", spec, "--steps", 2, "--batch-size", 4, *flags, module="hpctrain.train", timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"blend: {sets / 'lower'} 70.0% (2692 windows), {sets / 'upper'} 30.0% (1288 windows)" in r.stdout
    r = job(1, "--data", spec, "--steps", 4, "--batch-size", 4, *flags, "--resume", "yes",
            module="hpctrain.train", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "resum" in r.stdout, r.stdout
    r = job(1, "--data", f"{sets / 'lower'}:0.5,{sets / 'upper'}:0.5", "--steps", 6, "--batch-size", 4, *flags,
            "--resume", "yes", module="hpctrain.train", timeout=120)
    assert r.returncode == 2 and "other data" in r.stderr, r.stderr
