"""Tests for text data: `prepare --text chars|bytes|bpe:N`, its token shards
and manifest, the vocabularies' round trip, the held-out tail, the training
windows dealt over workers, the held-out windows, and bad input refused.

Serial, no MPI, real files (small corpora written here); bad input through
the command line in a subprocess:

    .venv/bin/python -m pytest -q tests/test_text_data.py
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hpctrain import data
from hpctrain.data.vocab import load_vocabulary
from hpctrain.base.errors import HpctrainError

REPO = Path(__file__).resolve().parent.parent

# ~3 KB of text, a few non-ASCII characters among them.
CORPUS = "".join(f"Line {i}: to be, or not to be — that is the question; naïve café {i * i}.\n"
                 for i in range(40))


def quiet(*args):
    return None


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(CORPUS, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def chars_dir(corpus_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "chars"
    data.prepare_text(corpus_file, out, text="chars", val_fraction=0.25, log=quiet)
    return out


def all_tokens(data_dir):
    return np.concatenate([data.read_tokens(data_dir, "train"), data.read_tokens(data_dir, "test")])


# ---------------------------------------------------------------------------
# Preparing: chars, bytes, bpe:N

def test_chars_vocabulary_is_the_sorted_characters_and_round_trips(chars_dir):
    manifest = data.load_manifest(chars_dir)
    assert data.input_kind(manifest) == "tokens"
    assert manifest["kind"] == "tokens" and manifest["text"] == "chars"
    assert manifest["vocabulary"] == sorted(set(CORPUS))
    assert manifest["vocab_size"] == len(set(CORPUS)) and manifest["dtype"] == "uint8"
    assert manifest["train"]["num_tokens"] + manifest["test"]["num_tokens"] == len(CORPUS)
    assert manifest["source"]["files"][0]["name"] == "corpus.txt"
    vocab = load_vocabulary(chars_dir)
    assert vocab.decode(all_tokens(chars_dir)) == CORPUS
    assert vocab.decode(vocab.encode("to be or not")) == "to be or not"
    with pytest.raises(HpctrainError, match="'Z' is not in this"):
        vocab.encode("Zebra")


def test_bytes_take_any_bytes_and_round_trip(tmp_path):
    raw = CORPUS.encode() + b"\xff\xfe latin-1: caf\xe9\n"   # not UTF-8: bytes take it as it is
    (tmp_path / "in.txt").write_bytes(raw)
    manifest = data.prepare_text(tmp_path / "in.txt", tmp_path / "out", text="bytes", log=quiet)
    assert manifest["vocab_size"] == 256 and manifest["dtype"] == "uint8" and "vocabulary" not in manifest
    assert all_tokens(tmp_path / "out").tobytes() == raw
    vocab = load_vocabulary(tmp_path / "out")
    assert vocab.decode(vocab.encode(CORPUS)) == CORPUS


def test_bpe_is_trained_offline_saved_with_the_data_and_round_trips(corpus_file, tmp_path):
    manifest = data.prepare_text(corpus_file, tmp_path / "bpe", text="bpe:300", log=quiet)
    assert manifest["text"] == "bpe" and manifest["vocab_size"] == 300 and manifest["dtype"] == "uint16"
    assert manifest["tokenizer"]["file"] == "tokenizer.json" and (tmp_path / "bpe" / "tokenizer.json").is_file()
    vocab = load_vocabulary(tmp_path / "bpe")
    assert vocab.vocab_size == 300
    ids = all_tokens(tmp_path / "bpe")
    assert len(ids) < len(CORPUS.encode())   # merges learned
    assert vocab.decode(ids) == CORPUS
    unseen = "Ünseen text ☃ 日本\r\n\ttabs  and  spaces "
    assert vocab.decode(vocab.encode(unseen)) == unseen
    # The same corpus trains the same tokenizer.
    again = data.prepare_text(corpus_file, tmp_path / "bpe2", text="bpe:300", log=quiet)
    assert again["tokenizer"]["sha256"] == manifest["tokenizer"]["sha256"]
    assert again["train"] == {**manifest["train"], "shards": again["train"]["shards"]}


def test_a_folder_is_its_txt_files_joined_in_path_order(tmp_path):
    (tmp_path / "src" / "b").mkdir(parents=True)
    (tmp_path / "src" / "b" / "2.txt").write_text("second\n")
    (tmp_path / "src" / "a.txt").write_text("first\n")
    (tmp_path / "src" / "notes.md").write_text("not read\n")
    manifest = data.prepare_text(tmp_path / "src", tmp_path / "out", text="chars", val_fraction=0.3, log=quiet)
    assert [f["name"] for f in manifest["source"]["files"]] == ["a.txt", "b/2.txt"]
    assert load_vocabulary(tmp_path / "out").decode(all_tokens(tmp_path / "out")) == "first\nsecond\n"


def test_the_held_out_split_is_the_tail_of_the_token_stream(chars_dir):
    manifest = data.load_manifest(chars_dir)
    ids = load_vocabulary(chars_dir).encode(CORPUS)
    held = int(np.floor(len(ids) * 0.25 + 0.5))
    assert np.array_equal(data.read_tokens(chars_dir, "train"), ids[:len(ids) - held])
    assert np.array_equal(data.read_tokens(chars_dir, "test"), ids[len(ids) - held:])
    assert manifest["val"] == manifest["test"] and data.has_val(chars_dir)


# ---------------------------------------------------------------------------
# Validation on read

def test_a_corrupt_shard_or_tokenizer_is_refused(corpus_file, tmp_path):
    # A start checks sizes and headers, not hashes (tests/test_text_in_place.py):
    # a flipped byte of a shard is `data verify`'s to name, a cut one the start's.
    data.prepare_text(corpus_file, tmp_path / "d", text="bpe:280", log=quiet)
    shard = tmp_path / "d" / "train-00000-of-00001.h5"
    raw = bytearray(shard.read_bytes())
    shard.write_bytes(raw[:-1])
    with pytest.raises(HpctrainError, match="train-00000-of-00001.h5: corrupt shard"):
        data.TokenReader(tmp_path / "d", 0, 1, 2, 0, 8)
    with open(tmp_path / "d" / "tokenizer.json", "a") as f:
        f.write(" ")
    with pytest.raises(HpctrainError, match="tokenizer.json: corrupt tokenizer"):
        load_vocabulary(tmp_path / "d")


@pytest.mark.parametrize("change, problem", [
    ({"dtype": "uint16"}, "dtype must be uint8"),
    ({"vocab_size": 1 << 33}, "vocab_size must be an integer in 1..4294967296"),
    ({"vocabulary": ["b", "a"]}, "vocabulary must list"),
    ({"text": "words"}, "text must be one of"),
])
def test_a_bad_token_manifest_is_refused(chars_dir, tmp_path, change, problem):
    manifest = json.loads((chars_dir / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, **change}))
    with pytest.raises(HpctrainError, match=f"bad manifest: {problem}"):
        data.load_manifest(tmp_path)


# ---------------------------------------------------------------------------
# Training windows and held-out windows

def epoch_batches(data_dir, workers, batch, block, steps):
    """Per step, the workers' (x, y, window offsets) in worker order, stacked."""
    readers = [data.TokenReader(data_dir, w, workers, batch, 5, block) for w in range(workers)]
    out = []
    for _ in range(steps):
        pairs = [tuple(a.copy() for a in r.next_batch()) for r in readers]
        ids = np.concatenate([r.last_ids for r in readers])
        out.append((np.concatenate([x for x, _ in pairs]), np.concatenate([y for _, y in pairs]), ids))
    return out, readers


def test_windows_dealt_over_1_2_3_workers_are_the_same_batches(chars_dir):
    block, per_step = 4, 6
    tokens = data.read_tokens(chars_dir, "train")
    windows = len(tokens) - block
    steps = windows // per_step                   # one epoch ...
    dealt = {}
    for workers in (1, 2, 3):
        dealt[workers], readers = epoch_batches(chars_dir, workers, per_step // workers, block, steps + 2)
        assert readers[0].num_samples == windows
        assert readers[0].position == (1, 2 * per_step)          # ... and two steps into the next
    for one, two, three in zip(dealt[1], dealt[2], dealt[3]):
        for a, b, c in zip(one, two, three):
            assert np.array_equal(a, b) and np.array_equal(a, c)
    first_epoch = np.concatenate([ids for _, _, ids in dealt[1][:steps]])
    assert len(set(first_epoch.tolist())) == steps * per_step and first_epoch.max() < windows
    for x, y, ids in dealt[3]:
        assert np.array_equal(x, tokens[ids[:, None] + np.arange(block)])
        assert np.array_equal(y, tokens[ids[:, None] + np.arange(block) + 1])
    x, y = data.TokenReader(chars_dir, 1, 3, 2, 5, block, arrays=("labels",)).next_batch()
    assert x is None and np.array_equal(y, dealt[3][0][1][2:4])   # a pipeline's last stage: the targets


def test_a_position_resumes_on_another_number_of_workers(chars_dir):
    two = [data.TokenReader(chars_dir, w, 2, 3, 5, 4) for w in range(2)]
    for _ in range(3):
        for r in two:
            r.next_batch()
    after, _ = epoch_batches(chars_dir, 1, 6, 4, 4)
    three = [data.TokenReader(chars_dir, w, 3, 2, 5, 4) for w in range(3)]
    for r in three:
        r.seek(*two[0].position)
    for step in range(3, 4):
        for r in three:
            r.next_batch()
        assert np.array_equal(np.concatenate([r.last_ids for r in three]), after[step][2])


def test_held_out_windows_are_consecutive_and_split_over_parts(chars_dir):
    block = 5
    test = data.read_tokens(chars_dir, "test")
    count = (len(test) - 1) // block
    x, y = data.load_test_windows(chars_dir, block)
    assert x.shape == y.shape == (count, block)
    assert np.array_equal(x.reshape(-1), test[:count * block])
    assert np.array_equal(y.reshape(-1), test[1:count * block + 1])
    for parts in (2, 3):
        pieces = [data.load_test_windows(chars_dir, block, part, parts) for part in range(parts)]
        assert np.array_equal(np.concatenate([p[0] for p in pieces]), x)
        assert np.array_equal(np.concatenate([p[1] for p in pieces]), y)
    with pytest.raises(HpctrainError, match="hold no window of --block-size"):
        data.load_test_windows(chars_dir, len(test))


def test_eval_tokens_take_the_same_evenly_spaced_windows_on_any_number_of_parts(chars_dir):
    """--eval-tokens N: N // T windows evenly spaced over the held-out split
    (window floor(i * count / k)), a pure function of (count, T, N): the
    parts of 1, 2 and 3 ranks together are the one sample, and
    held_out_count / held_out_tokens say the same from the manifest alone."""
    from hpctrain.data.splits import held_out, held_out_count, held_out_tokens
    block = 5
    test = data.read_tokens(chars_dir, "test")
    count = (len(test) - 1) // block
    whole_x, _ = data.load_test_windows(chars_dir, block)
    x, y = data.load_test_windows(chars_dir, block, eval_tokens=52)
    k = 52 // block
    assert x.shape == (k, block) and 2 * k < count
    assert np.array_equal(x, whole_x[np.arange(k) * count // k])
    assert np.array_equal(y[:, :-1], x[:, 1:])
    manifest = data.load_manifest(chars_dir)
    for parts in (2, 3):
        pieces = [held_out(chars_dir, part, parts, block, eval_tokens=52) for part in range(parts)]
        assert np.array_equal(np.concatenate([p[0] for p in pieces]), x)
        assert [len(p[0]) for p in pieces] == [held_out_count(manifest, part, parts, block, eval_tokens=52)
                                               for part in range(parts)]
    assert held_out_tokens(manifest, block, 52) == k * block and held_out_tokens(manifest, block) == count * block
    # a cap at or past the windows' tokens takes them all; one below a window takes one
    assert np.array_equal(data.load_test_windows(chars_dir, block, eval_tokens=count * block)[0], whole_x)
    assert np.array_equal(data.load_test_windows(chars_dir, block, eval_tokens=1)[0], whole_x[:1])


def test_too_few_windows_for_a_step_is_one_line(chars_dir):
    with pytest.raises(HpctrainError, match="fewer than one step takes"):
        data.TokenReader(chars_dir, 0, 1, 10_000, 0, 8)


def test_images_are_refused_by_the_token_reader(bundled_shards):
    with pytest.raises(HpctrainError, match="holds images, not text"):
        data.TokenReader(bundled_shards, 0, 1, 2, 0, 8)


# ---------------------------------------------------------------------------
# Bad input: one line, exit 2, nothing written

def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "hpctrain.data", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=60)


@pytest.mark.parametrize("content, text, message", [
    (b"some text\0with a NUL", "bytes", "{src}: a binary file (a NUL byte at offset 9), not text"),
    (b"", "chars", "{src}: empty, no text to learn from"),
    (b"caf\xe9 au lait\n", "chars", "{src}: not UTF-8 text (byte 0xe9 at offset 3); --text bytes takes any bytes"),
    (b"caf\xe9 au lait\n", "bpe:300", "{src}: not UTF-8 text (byte 0xe9 at offset 3); --text bytes takes any bytes"),
    (b"plain text\n", "bpe:5000000000", "--text bpe:5000000000: N must be in 256..4294967296 (the 256 bytes "
                                        "at least; token ids are stored as uint32 at most)"),
    (b"ab", "chars", "{src}: 2 tokens, too few to hold out --val-fraction 0.1 (2 to train on, 0 held out; "
                     "each needs 2 at least)"),
], ids=["binary", "empty", "not-utf8-chars", "not-utf8-bpe", "bpe-too-big", "too-short"])
def test_bad_text_is_one_line_exit_2_and_nothing_written(tmp_path, content, text, message):
    src = tmp_path / "in.txt"
    src.write_bytes(content)
    r = run_cli("prepare", "--source", src, "--out", tmp_path / "out", "--text", text)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == f"hpctrain: error: {message.format(src=src)}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_image_flags_with_text_and_text_without_out_are_refused(corpus_file, tmp_path):
    r = run_cli("prepare", "--source", corpus_file, "--out", tmp_path / "out", "--text", "chars", "--shards", 2)
    assert (r.returncode, r.stderr) == (2, "hpctrain: error: --shards: for images, not --text\n")
    r = run_cli("prepare", "--source", corpus_file, "--text", "chars")
    assert (r.returncode, r.stderr) == (2, "hpctrain: error: --text needs --out DIR (where the token shards go)\n")
    assert not (tmp_path / "out").exists()


def test_cli_prepares_the_bundled_shakespeare_by_default(tmp_path):
    r = run_cli("prepare", "--out", tmp_path / "shakespeare", "--text", "chars")
    assert r.returncode == 0, r.stderr
    assert "932846 training tokens, 103650 held out (the last 0.1), 76 tokens of --text chars" in r.stdout
    manifest = data.load_manifest(tmp_path / "shakespeare")
    assert manifest["source"]["files"][0]["sha256"] == \
        "a8b05f68ed1ac577ad7908b3c2c04dd0eea7952ba486a9b1f6828f1dd8d46653"


def test_token_data_is_refused_by_the_image_readers(chars_dir):
    for read in (lambda: data.ShardReader(chars_dir, 0, 1, 2, 0), lambda: data.load_test(chars_dir),
                 lambda: data.model_shape(data.load_manifest(chars_dir)),
                 lambda: data.check_augment("flip", chars_dir)):
        with pytest.raises(HpctrainError, match="holds text as tokens"):
            read()


def test_a_text_folders_shards_may_lie_inside_it(tmp_path):
    # Issue 54, 10: refused as "inside the image folder --source" (a text folder with a subfolder);
    # a later prepare of the folder reads its .txt files, none of the shards'.
    source = tmp_path / "texts"
    (source / "act2").mkdir(parents=True)
    (source / "act1.txt").write_text("to be or not to be\n")
    (source / "act2" / "scene1.txt").write_text("that is the question\n")
    first = data.prepare_text(str(source), str(source / "chars"), "chars", log=None)
    again = data.prepare_text(str(source), str(tmp_path / "again"), "chars", log=None)
    assert [f["name"] for f in again["source"]["files"]] == ["act1.txt", "act2/scene1.txt"]
    assert again["source"] == first["source"]


def test_a_stopped_text_prepare_removes_its_temporary_folder(tmp_path):
    # Random bytes (no NUL) compress slowly: writing the shards takes a while, time to stop it half-way.
    corpus = np.random.default_rng(0).integers(1, 256, 24 << 20, dtype=np.uint8)
    (tmp_path / "in.txt").write_bytes(corpus.tobytes())
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "hpctrain.data", "prepare", "--source", tmp_path / "in.txt",
                             "--out", out, "--text", "bytes"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".out.tmp-*")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert proc.poll() is None, "prepare ended before it could be stopped"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 75, err
    assert err == ("hpctrain: error: prepare stopped by SIGTERM: nothing written (--out as it was, the "
                   "temporary folder removed); run the same command again\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]
