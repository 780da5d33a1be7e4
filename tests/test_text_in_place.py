"""Tests for text read in place (data/tokens.py) and `hpctrain data verify`
(data/verify.py): a start that checks sizes and headers and reads no
tokens, windows read from the shards as they are needed (read at their
file offset, or through h5py where a shard is chunked and compressed) equal to the windows
of the whole stream, ids checked where they are read, --eval-tokens reading
only its sample, and verify naming a flipped shard at 1 rank in-process
and in a 2-rank job.

    .venv/bin/python -m pytest -q tests/test_text_in_place.py
"""
import json
import os
import shutil

import h5py
import numpy as np
import pytest

from hpctrain import data
from hpctrain.base.errors import HpctrainError
from hpctrain.data.__main__ import main as data_main
from hpctrain.data.manifest import _sha256
from hpctrain.data.tokens import TokenShards, _InFile, _InHDF5

from conftest import prepared_plays

TRAIN = "train-00000-of-00001.h5"
TEST = "test-00000-of-00001.h5"


@pytest.fixture(scope="module")
def plays(tmp_path_factory):
    return prepared_plays(tmp_path_factory, 20_000)


def copy_of(src, dst):
    shutil.copytree(src, dst)
    return dst


def token_offset(path):
    """Where a contiguous shard's tokens start in its file."""
    with h5py.File(path, "r") as f:
        return f["tokens"].id.get_offset()


def write_manifest(folder, manifest):
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))


def reshard(src, dst, cuts, compressed):
    """src's training tokens as several shards, cut at `cuts`, shard i gzip
    chunked where compressed[i] (the h5py path), else contiguous (read at its file offset)."""
    dst = copy_of(src, dst)
    manifest = json.loads((src / "manifest.json").read_text())
    ids = data.read_tokens(src, "train")
    pieces = np.split(ids, cuts)
    (dst / TRAIN).unlink()
    shards = []
    for i, (piece, gz) in enumerate(zip(pieces, compressed)):
        name = data.shard_name("train", i, len(pieces))
        with h5py.File(dst / name, "w") as f:
            f.create_dataset("tokens", data=piece, **({"chunks": (1000,), "compression": "gzip"} if gz else {}))
        shards.append({"file": name, "num_tokens": len(piece), "bytes": (dst / name).stat().st_size,
                       "sha256": _sha256(dst / name)})
    manifest["train"] = {"num_tokens": len(ids), "shards": shards}
    write_manifest(dst, manifest)
    return dst


def batches(data_dir, steps, block=16, workers=1):
    readers = [data.TokenReader(data_dir, w, workers, 4, 3, block) for w in range(workers)]
    out = []
    for _ in range(steps):
        pairs = [tuple(a.copy() for a in r.next_batch()) for r in readers]
        out.append((np.concatenate([x for x, _ in pairs]), np.concatenate([y for _, y in pairs]),
                    np.concatenate([r.last_ids for r in readers])))
    return out


# ---------------------------------------------------------------------------
# Windows read in place

def test_prepared_shards_are_read_at_their_file_offset_a_batchs_windows_only(plays, monkeypatch):
    whole = data.read_tokens(plays, "train")
    read = []
    preadv = os.preadv

    def counted(fd, buffers, offset):
        read.append(sum(memoryview(b).nbytes for b in buffers))
        return preadv(fd, buffers, offset)
    monkeypatch.setattr(os, "preadv", counted)
    shards = TokenShards(plays, "train")
    assert all(isinstance(ids, _InFile) for _, ids in shards._shards) and read == []   # the start reads no token
    for x, y, ids in batches(plays, 5):
        at = ids[:, None] + np.arange(16)
        assert np.array_equal(x, whole[at]) and np.array_equal(y, whole[at + 1])
    assert read == [17] * 5 * 4   # each batch's 4 windows of T + 1 tokens, nothing more


def test_windows_across_shards_and_through_h5py_are_the_same(plays, tmp_path):
    # Three shards, the middle one gzip-chunked: windows that straddle a cut
    # and windows read through h5py are the one-shard set's windows.
    n = data.load_manifest(plays)["train"]["num_tokens"]
    split = reshard(plays, tmp_path / "split", [n // 3, 2 * n // 3], [False, True, False])
    assert isinstance(TokenShards(split, "train")._shards[1][1], _InHDF5)
    for a, b in zip(batches(plays, 40), batches(split, 40)):
        assert all(np.array_equal(u, v) for u, v in zip(a, b))
    straddling = np.array([n // 3 - 5, 2 * n // 3 - 1])
    rows = TokenShards(split, "train").windows(straddling, 17)
    whole = data.read_tokens(plays, "train")
    assert np.array_equal(rows, whole[straddling[:, None] + np.arange(17)])


# ---------------------------------------------------------------------------
# The start reads headers; ids are checked where they are read

def test_a_start_reads_no_tokens_and_a_bad_id_is_named_where_it_is_read(plays, tmp_path):
    folder = copy_of(plays, tmp_path / "d")
    n = data.load_manifest(folder)["train"]["num_tokens"]
    vocab = data.load_manifest(folder)["vocab_size"]
    at = token_offset(folder / TRAIN)
    with open(folder / TRAIN, "r+b") as f:   # the last id past the vocabulary, the file's size kept
        f.seek(at + n - 1)
        f.write(bytes([255]))
    reader = data.TokenReader(folder, 0, 1, 4, 3, 16)   # starts: no token read
    for _ in range(3):
        reader.next_batch()
    message = f"{folder / TRAIN}: token 255 at {n - 1} is not below the manifest's vocab_size {vocab}"
    with pytest.raises(HpctrainError, match=message):
        reader.shards.windows([n - 17], 17)
    with pytest.raises(HpctrainError, match=message):
        data.read_tokens(folder, "train")


def test_a_cut_or_reshaped_shard_is_refused_at_the_start(plays, tmp_path):
    folder = copy_of(plays, tmp_path / "d")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["train"]["shards"][0]["num_tokens"] += 1
    manifest["train"]["num_tokens"] += 1
    write_manifest(folder, manifest)
    with pytest.raises(HpctrainError, match=f"{TRAIN}: bad shard: expected uint8 tokens"):
        data.TokenReader(folder, 0, 1, 4, 3, 16)
    raw = (folder / TRAIN).read_bytes()
    (folder / TRAIN).write_bytes(raw[:-10])
    with pytest.raises(HpctrainError, match=f"{TRAIN}: corrupt shard \\({len(raw) - 10} bytes, manifest says"):
        data.TokenReader(folder, 0, 1, 4, 3, 16)


def test_eval_tokens_read_only_their_sample(plays, tmp_path):
    folder = copy_of(plays, tmp_path / "d")
    count = (data.load_manifest(folder)["test"]["num_tokens"] - 1) // 16
    sample = data.load_test_windows(folder, 16, eval_tokens=64)[0]   # windows 0, c/4, c/2, 3c/4
    bad = (count // 4) * 16 + 16 * 2   # a token inside window c/4 + 2, which the sample skips
    with open(folder / TEST, "r+b") as f:
        f.seek(token_offset(folder / TEST) + bad)
        f.write(bytes([255]))
    assert np.array_equal(data.load_test_windows(folder, 16, eval_tokens=64)[0], sample)
    with pytest.raises(HpctrainError, match=f"{TEST}: token 255 at {bad} is not below"):
        data.load_test_windows(folder, 16)


# ---------------------------------------------------------------------------
# hpctrain data verify

def flip(path, at=-1):
    raw = bytearray(path.read_bytes())
    raw[at] ^= 1
    path.write_bytes(raw)


def test_verify_passes_a_good_set_and_names_a_flipped_shard(plays, tmp_path, capsys):
    assert data_main(["verify", plays]) == 0
    out, err = capsys.readouterr()
    assert out == f"verified {plays}: 2 files match manifest.json's sha256\n"
    assert "verify: rank 0 hashed " in err
    folder = copy_of(plays, tmp_path / "d")
    flip(folder / TEST)
    data.TokenReader(folder, 0, 1, 4, 3, 16)   # a start does not hash: verify's job
    assert data_main(["verify", folder]) == 2
    out, err = capsys.readouterr()
    bad = [line for line in err.splitlines() if line.startswith("hpctrain: error:")]
    assert out == "" and len(bad) == 1 and bad[0].startswith(f"hpctrain: error: {folder}/{TEST}: corrupt (sha256 ")
    assert data_main(["verify", tmp_path / "nothing"]) == 2
    assert "no such directory" in capsys.readouterr().err


def test_verify_deals_the_files_over_two_ranks(plays, tmp_path, job):
    folder = reshard(plays, tmp_path / "d", [5000, 10000], [False, False, False])
    flip(folder / data.shard_name("train", 1, 3), at=-2)
    r = job(2, "verify", folder, module="hpctrain.data", timeout=120)
    assert r.returncode == 2, r.stderr
    bad = [line for line in r.stderr.splitlines() if line.startswith("hpctrain: error:")]
    assert bad == [f"hpctrain: error: {folder}/train-00001-of-00003.h5: corrupt (sha256 " + bad[0].split("sha256 ")[1]]
    assert "4 files over 2 ranks" in r.stderr and r.stdout == ""


STALLED_RANK = """
import time, numpy as np
from mpi4py import MPI
from hpctrain.data.__main__ import _meet
comm = MPI.COMM_WORLD
if comm.Get_rank() == 2:
    time.sleep(30)   # a rank stuck in its share
_meet(comm, np.zeros(3, np.int8), 1.0)
"""


def test_verify_names_a_rank_that_never_reports_within_the_timeout(job):
    """verify's one collective is bounded: rank 0 names the rank it waited
    for (the others wait longer, so theirs is not the first line)."""
    import subprocess
    import sys
    from conftest import MPIRUN
    from hpctrain.run.cluster import child_env
    r = subprocess.run([MPIRUN, "-n", "3", sys.executable, "-c", STALLED_RANK], capture_output=True, text=True,
                       timeout=60, env=child_env())
    assert r.returncode != 0
    first = [line for line in r.stderr.splitlines() if line.startswith("hpctrain: error:")][0]
    assert first == "hpctrain: error: verify: rank 2 sent no findings within --timeout 1 s of rank 0's own share; " \
                    "the job ends", r.stderr


def test_an_epochs_order_is_computed_per_batch_never_held(plays, monkeypatch):
    """reader.permuted: a bijection of 0..n-1 for any n, another per key;
    entries of a permutation of 10^12 windows in milliseconds; and the
    training reader takes its batches without materialising a permutation."""
    from hpctrain.data.reader import permuted
    for n in (1, 2, 3, 17, 1000, 4097):
        assert sorted(permuted(n, (5, 0), np.arange(n)).tolist()) == list(range(n))
    assert not np.array_equal(permuted(1000, (5, 0), np.arange(1000)), permuted(1000, (5, 1), np.arange(1000)))
    far = permuted(10**12, (0, 0), np.arange(10**12 - 1000, 10**12))
    assert len(np.unique(far)) == 1000 and far.max() < 10**12

    def held(*args, **kwargs):
        raise AssertionError("a permutation of every window materialised")
    monkeypatch.setattr("hpctrain.data.reader.deal", held)   # images' dealing: a permutation of every sample
    reader = data.TokenReader(plays, 1, 2, 4, 0, 16)
    ids = [reader.next_batch() and reader.last_ids.copy() for _ in range(3)]
    assert all(len(np.unique(i)) == 4 and i.max() < reader.num_samples for i in ids)
