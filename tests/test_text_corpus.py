"""`prepare --text` at corpus scale (issue 57 §3): JSON Lines (plain, gzip,
xz), compressed text and folders of them read as documents, --eot between
documents, a bad record named by file and line (or skipped and counted), a
file cut into units at line ends, the same shards and manifest on 1 and 2
ranks, and memory that does not grow with the corpus.

Serial (the 2-rank prepare is an mpirun job launched from here), tiny
corpora written here:

    .venv/bin/python -m pytest -q tests/test_text_corpus.py
"""

import gzip
import json
import lzma
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpctrain import data
from hpctrain.data import text as text_source
from hpctrain.data.__main__ import main as data_main
from hpctrain.data.vocab import EOT, load_vocabulary

REPO = Path(__file__).resolve().parent.parent
DOCS = [f"Document {i}: " + "to be or not to be, that is the question; " * (i % 5 + 1) + "naïve café.\n"
        for i in range(48)]


def quiet(*args, **kwargs):
    return None


def all_tokens(folder):
    return np.concatenate([data.read_tokens(folder, "train"), data.read_tokens(folder, "test")])


def write_jsonl(path, docs, opener=open, **extra):
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d, **extra}) + "\n")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A folder of the 48 documents as JSON Lines (plain and gzip), xz text
    and plain text; and the same documents as one text file."""
    root = tmp_path_factory.mktemp("corpus")
    folder = root / "mixed"
    (folder / "sub").mkdir(parents=True)
    write_jsonl(folder / "a.jsonl", DOCS[:16], id=7)
    write_jsonl(folder / "b.jsonl.gz", DOCS[16:32], opener=gzip.open)
    with lzma.open(folder / "sub" / "c.txt.xz", "wt", encoding="utf-8") as f:
        f.write("".join(DOCS[32:40]))
    (folder / "sub" / "d.txt").write_text("".join(DOCS[40:]), encoding="utf-8")
    (folder / "notes.md").write_text("not read\n")
    (root / "whole.txt").write_text("".join(DOCS), encoding="utf-8")
    return folder, root / "whole.txt"


def test_every_format_gives_the_documents_tokens(corpus, tmp_path):
    folder, whole = corpus
    mixed = data.prepare_text(folder, tmp_path / "mixed", "chars", log=quiet)
    one = data.prepare_text(whole, tmp_path / "one", "chars", log=quiet)
    assert [f["name"] for f in mixed["source"]["files"]] == ["a.jsonl", "b.jsonl.gz", "sub/c.txt.xz", "sub/d.txt"]
    assert mixed["text_field"] == "text" and "text_field" not in one
    assert np.array_equal(all_tokens(tmp_path / "mixed"), all_tokens(tmp_path / "one"))
    assert load_vocabulary(tmp_path / "mixed").decode(all_tokens(tmp_path / "mixed")) == "".join(DOCS)


def test_eot_ends_every_document_holds_out_whole_ones_and_bytes_refuse_it(corpus, tmp_path, capsys):
    folder, _ = corpus
    manifest = data.prepare_text(folder, tmp_path / "bpe", "bpe:300", eot=True, log=quiet)
    vocab = load_vocabulary(tmp_path / "bpe")
    ids = all_tokens(tmp_path / "bpe")
    eot = manifest["eot"]
    assert vocab.tokenizer.id_to_token(eot) == EOT
    # 32 records, and each of the two text files is one document
    ends = np.flatnonzero(ids == eot)
    assert len(ends) == 34 and ends[-1] == len(ids) - 1
    assert vocab.decode(ids) == "".join(DOCS)   # the token decodes to nothing
    # whole documents held out: from the first document start at or past the last 10% of the tokens,
    # or, the last document holding that point (a text file, here), the last start before it
    starts, cut = ends + 1, len(ids) - int(np.floor(len(ids) * 0.1 + 0.5))
    after, before = starts[(starts >= cut) & (starts < len(ids) - 1)], starts[starts < cut]
    assert len(after) == 0 and len(data.read_tokens(tmp_path / "bpe", "train")) == before[-1]
    # 16 records: the first start past the point
    data.prepare_text(folder / "b.jsonl.gz", tmp_path / "records", "bpe:300", eot=True, log=quiet)
    ids = all_tokens(tmp_path / "records")
    starts, cut = np.flatnonzero(ids == eot) + 1, len(ids) - int(np.floor(len(ids) * 0.1 + 0.5))
    assert len(data.read_tokens(tmp_path / "records", "train")) == starts[starts >= cut][0] < len(ids) - 1
    assert data_main(["prepare", "--source", folder, "--out", tmp_path / "b", "--text", "bytes", "--eot"]) == 2
    assert capsys.readouterr().err == ("hpctrain: error: --eot: --text bytes has no end-of-text token (every id is a "
                                       "byte); use bpe:N or a tokenizer with <|endoftext|>\n")


@pytest.mark.parametrize("line, problem", [
    (b'{"text": "fine"', "not JSON (Expecting ',' delimiter)"),
    (b'{"body": "no text"}', 'no "text" field (--text-field)'),
    (b'{"text": 42}', '"text" is int, not a string'),
    (b'{"text": "caf\xe9"}', "not UTF-8"),
], ids=["not-json", "no-field", "not-a-string", "not-utf8"])
def test_a_bad_record_is_one_line_naming_file_and_line_or_is_skipped(tmp_path, capsys, line, problem):
    src = tmp_path / "in"
    src.mkdir()
    good = [json.dumps({"text": d}).encode() for d in DOCS[:6]]
    (src / "r.jsonl").write_bytes(b"\n".join(good[:3] + [line] + good[3:]) + b"\n")
    assert data_main(["prepare", "--source", src, "--out", tmp_path / "out", "--text", "chars"]) == 2
    assert capsys.readouterr().err == (f"hpctrain: error: {src}/r.jsonl, line 4: {problem}; --skip-bad-records "
                                       f"skips such records\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]
    assert data_main(["prepare", "--source", src, "--out", tmp_path / "out", "--text", "chars",
                      "--skip-bad-records"]) == 0
    assert "; skipped 1 bad records (--skip-bad-records)" in capsys.readouterr().out
    assert data.load_manifest(tmp_path / "out")["skipped_records"] == 1
    assert load_vocabulary(tmp_path / "out").decode(all_tokens(tmp_path / "out")) == "".join(DOCS[:6])


def test_a_zstd_file_without_its_library_is_one_line(tmp_path, capsys):
    try:
        import zstandard
    except ImportError:
        zstandard = None
    src = tmp_path / "t.txt.zst"
    if zstandard is None:
        src.write_bytes(b"\x28\xb5\x2f\xfd not really")
        assert data_main(["prepare", "--source", src, "--out", tmp_path / "o", "--text", "bytes"]) == 2
        assert capsys.readouterr().err == (f"hpctrain: error: {src}: zstd-compressed; reading it needs the "
                                           f"zstandard package (pip install zstandard)\n")
        return
    src.write_bytes(zstandard.ZstdCompressor().compress("".join(DOCS).encode()))
    data.prepare_text(src, tmp_path / "o", "chars", log=quiet)
    assert load_vocabulary(tmp_path / "o").decode(all_tokens(tmp_path / "o")) == "".join(DOCS)


def test_parquet_rows_are_documents(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": DOCS[:10]}), tmp_path / "t.parquet")
    data.prepare_text(tmp_path / "t.parquet", tmp_path / "o", "chars", text_field="body", log=quiet)
    assert load_vocabulary(tmp_path / "o").decode(all_tokens(tmp_path / "o")) == "".join(DOCS[:10])


def test_a_large_file_is_cut_into_units_at_line_ends(corpus, tmp_path, monkeypatch):
    """--shard-mb 0.001: a 4 KB file in pieces of a line past each KB, one
    shard each; blocks of 64 bytes (a line longer is cut before a character):
    the tokens are the whole file's, the held-out tail too."""
    _, whole = corpus
    one = data.prepare_text(whole, tmp_path / "one", "chars", log=quiet)
    monkeypatch.setattr(text_source, "BLOCK", 64)
    cut = data.prepare_text(whole, tmp_path / "cut", "chars", shard_mb=0.001, log=quiet)
    assert len(cut["train"]["shards"]) > 3 and len(cut["test"]["shards"]) >= 1
    assert np.array_equal(all_tokens(tmp_path / "cut"), all_tokens(tmp_path / "one"))
    assert cut["test"]["num_tokens"] == one["test"]["num_tokens"]
    parts = cut["source"]["files"][0]["parts"]
    raw = whole.read_bytes()
    assert parts[0]["start"] == 0 and parts[-1]["stop"] == len(raw)
    assert all(raw[p["stop"] - 1:p["stop"]] == b"\n" for p in parts[:-1])


def test_one_and_two_ranks_write_the_same_shards_and_manifest(corpus, tmp_path, job):
    folder, _ = corpus
    flags = ["--text", "bpe:300", "--eot", "--shard-mb", "0.001"]
    assert data_main(["prepare", "--source", folder, "--out", tmp_path / "one", *flags]) == 0
    r = job(2, "prepare", "--source", folder, "--out", tmp_path / "two", *flags, module="hpctrain.data",
            timeout=120)
    assert r.returncode == 0, r.stderr
    one, two = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("one", "two"))
    assert len(one["train"]["shards"]) >= 4 and one == two
    # a bad record in the 4th unit, rank 1's: its one line for the job, nothing left behind on any rank
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "r.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:24]) + '{"text": 5}\n')
    r = job(2, "prepare", "--source", bad, "--out", tmp_path / "three", *flags, module="hpctrain.data", timeout=120)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (f'hpctrain: error: {bad}/r.jsonl, line 25: "text" is int, not a string; --skip-bad-records '
                        f'skips such records\n')
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "one", "two"]


STREAMED = """
import resource, sys
from hpctrain.data.prepare_text import prepare_text
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
prepare_text(sys.argv[1], sys.argv[2], "bytes", log=None)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_memory_does_not_grow_with_the_corpus(tmp_path):
    """48 MB of text prepared with at most 40 MB more resident memory
    (blocks of 4 MB read, encoded and copied): before the corpus was
    streamed it was read whole (+48 MB) and its ids copied (+48 MB)."""
    line = (b"".join(d.encode() for d in DOCS) * 16)[:64 << 10]
    (tmp_path / "big.txt").write_bytes(line * 768)
    r = subprocess.run([sys.executable, "-c", STREAMED, tmp_path / "big.txt", tmp_path / "o"], capture_output=True,
                       text=True, timeout=120, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) < 40, r.stdout
    assert data.load_manifest(tmp_path / "o")["train"]["num_tokens"] > 43 << 20, r.stdout
