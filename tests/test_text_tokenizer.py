"""`hpctrain data prepare --text tokenizer:PATH` (issue 56 §2, data/vocab.py
load_tokenizer): a Hugging Face tokenizer.json, or a folder holding one,
as the data's vocabulary. A GPT-2-like byte-level BPE trained here by
`tokenizers` on the bundled plays stands in for GPT-2's: the shards hold
`Tokenizer.from_file(PATH).encode(text).ids`, the vocabulary is its size,
kept as bpe:N's is; a GPT (act=gelu_tanh, eps=1e-6) trains on it and
`hpctrain generate` decodes with it from the --save file alone; bad
tokenizers are one line, exit 2, nothing written.

    .venv/bin/python -m pytest -q tests/test_text_tokenizer.py
"""
import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import run_job, under_mpirun
from hpctrain import data, generate
from hpctrain.checkpoints.model_record import recorded_text
from hpctrain.data.__main__ import main as data_main
from hpctrain.data.tokens import TokenShards
from hpctrain.data.vocab import Bpe, from_record, load_vocabulary, same

tokenizers = pytest.importorskip("tokenizers")
CHARS = 30_000   # of the plays: 0.1 s to train the tokenizer, some 9,000 tokens
SIZE = 400


def quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="module")
def plays(tmp_path_factory):
    """(the corpus file, its text, a folder holding tokenizer.json): GPT-2's
    kind of tokenizer (byte-level, its <|endoftext|> special token), trained
    on the corpus by tokenizers itself."""
    root = tmp_path_factory.mktemp("tokenizer")
    text = Path(data.bundled_text_path()).read_bytes()[:CHARS].decode()
    source = root / "plays.txt"
    source.write_text(text, encoding="utf-8")
    tk = tokenizers
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    tokenizer.train_from_iterator([text], tk.trainers.BpeTrainer(
        vocab_size=SIZE, show_progress=False, special_tokens=["<|endoftext|>"],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()))
    folder = root / "gpt2-like"
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    return source, text, folder


def all_tokens(out):
    return np.concatenate([h5py.File(Path(out) / f"{split}-00000-of-00001.h5")["tokens"][()]
                           for split in ("train", "test")])


@pytest.mark.parametrize("given", ["file", "folder"])
def test_prepare_encodes_with_the_tokenizer_and_keeps_it_with_the_data(plays, tmp_path, given):
    source, text, folder = plays
    path = folder / "tokenizer.json" if given == "file" else folder
    reference = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    manifest = data.prepare_text(source, tmp_path / "out", text=f"tokenizer:{path}", log=quiet)
    assert all_tokens(tmp_path / "out").tolist() == reference.encode(text).ids
    assert (manifest["text"], manifest["vocab_size"]) == ("bpe", reference.get_vocab_size())
    assert manifest["tokenizer"]["from"] == str(path.resolve())
    vocab = load_vocabulary(tmp_path / "out")
    assert same(vocab, Bpe(reference)) and vocab.decode(reference.encode(text).ids) == text


def test_a_vocabulary_over_65536_tokens_is_stored_as_uint32_and_read_back(plays, tmp_path):
    """Llama 3's 128k tokens do not fit uint16: the shards take uint32 and the
    windows a rank reads hold the ids above 65,535 as they were encoded."""
    source, text, _ = plays
    words = sorted(set(text.split()))
    vocab = {f"filler{i}": i for i in range(70_000 - len(words) - 1)}
    vocab.update({"[UNK]": len(vocab)}, **{w: len(vocab) + 1 + i for i, w in enumerate(words)})
    tk = tokenizers
    tokenizer = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "wide.json"))
    manifest = data.prepare_text(source, tmp_path / "out", text=f"tokenizer:{tmp_path / 'wide.json'}", log=quiet)
    ids = tokenizer.encode(text).ids
    assert (manifest["vocab_size"], manifest["dtype"]) == (70_000, "uint32") and min(ids) > 65_535
    assert all_tokens(tmp_path / "out").tolist() == ids
    shards = TokenShards(tmp_path / "out", "train")
    assert shards.windows([0, 7], 50).tolist() == [ids[:50], ids[7:57]]


@pytest.mark.parametrize("make, line", [
    (lambda root: root / "nowhere", "tokenizer:{root}/nowhere: no such file or folder"),
    (lambda root: root, "tokenizer:{root}: no tokenizer.json in this folder"),
    (lambda root: (root / "vocab.json").write_text("{}") and root,
     "tokenizer:{root}: no tokenizer.json in this folder (vocab.json and merges.txt are a slow tokenizer's"),
    (lambda root: (root / "t.json").write_text('{"model": 3}') and root / "t.json",
     "tokenizer:{root}/t.json: t.json is not a Hugging Face tokenizer ("),
    (lambda root: "", "--text tokenizer:PATH needs the path of a tokenizer.json or of a folder holding one"),
])
def test_a_tokenizer_that_is_not_there_or_does_not_load_is_one_line(plays, tmp_path, capsys, make, line):
    root = tmp_path / "given"
    root.mkdir()
    path = make(root)
    out = tmp_path / "out"
    code = data_main(["prepare", "--source", plays[0], "--out", out, "--text", f"tokenizer:{path}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("hpctrain: error: "), err
    assert line.format(root=root) in err, err
    assert not out.exists()


def test_a_gpt_trains_on_it_and_generate_decodes_with_it(plays, tmp_path, capsys):
    """One job: the GPT's vocabulary is the tokenizer's size; the --save
    file's record carries the tokenizer, so generate needs no --data."""
    if under_mpirun():
        pytest.skip("launches its own mpirun job: runs in the plain pytest pass")
    source, _, folder = plays
    assert data_main(["prepare", "--source", source, "--out", tmp_path / "data",
                      "--text", f"tokenizer:{folder}"]) == 0
    model = "gpt:layers=2,heads=2,width=32,act=gelu_tanh,eps=1e-6"
    save = tmp_path / "gpt.h5"
    r = run_job(1, "--data", tmp_path / "data", "--model", model, "--block-size", 16, "--batch-size", 4,
                "--steps", 3, "--eval-tokens", 256, "--save", save)
    assert r.returncode == 0, r.stderr
    assert f"model {model.replace('1e-6', '1e-06')}: input 16 (tokens), a vocabulary of {SIZE}," in r.stdout, r.stdout
    assert "Block(32, heads=2, act=gelu_tanh, eps=1e-06)" in r.stdout, r.stdout
    reference = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    with h5py.File(save, "r") as f:
        assert json.loads(f.attrs["inference"])["classes"] == SIZE
        assert same(from_record(recorded_text(f.attrs, save), save), Bpe(reference))
    capsys.readouterr()
    assert generate.main(["--params", str(save), "--prompt", "ROMEO:", "--tokens", "12", "--top-k", "1",
                          "--stream", "off"]) == 0
    out = capsys.readouterr().out
    ids = reference.encode(out.rstrip("\n")).ids   # the tokenizer's own text: it encodes back to its ids
    assert out.startswith("ROMEO:") and reference.decode(ids) == out.rstrip("\n") and len(ids) >= 12, out
