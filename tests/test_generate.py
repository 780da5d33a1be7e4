"""Generation from a GPT (hpctrain/generate.py, nn/decode.py) and a GPT's
perplexity (hpctrain/evaluate.py): the key/value cache's logits against a
full forward, inside and past the context length; sampling that repeats
for a seed; the vocabulary carried by the --save file and checkpoints;
bad flags in one line; evaluate's perplexity against the training run's
final record.

    .venv/bin/python -m pytest -q tests/test_generate.py
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import run_job, under_mpirun
from hpctrain import data, evaluate, generate, trained
from hpctrain.checkpoints.model_record import ATTR
from hpctrain.data.vocab import Bpe, Bytes, Chars, from_record
from hpctrain.errors import HpctrainError
from hpctrain.nn.decode import Decoder
from hpctrain.nn.gpt import gpt
from hpctrain.run.cluster import child_env

T = 8   # the context length of the seeded models


def seeded(dtype, vocab=11, seed=3):
    model = gpt(vocab, T, layers=2, heads=2, width=16).build(np, dtype=dtype)
    model.init(seed)
    return model


@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
def test_the_cache_gives_a_full_forwards_logits_at_every_position_and_past_the_context(dtype, tol):
    model = seeded(dtype)
    seq = np.random.default_rng(0).integers(0, 11, 3 * T)
    full = model.run.forward(seq[None, :T], False).copy()   # causal: position i's logits are its prefix's
    decoder = Decoder(model)
    cached = [decoder.feed(seq[None, :3])] + [decoder.feed(seq[None, i:i + 1]) for i in range(3, T)]
    np.testing.assert_allclose(np.concatenate(cached, axis=1), full, rtol=0, atol=tol)
    for i in range(T, 3 * T):   # past T: the logits of the last T tokens
        window = model.run.forward(seq[None, i - T + 1:i + 1], False)
        np.testing.assert_allclose(decoder.feed(seq[None, i:i + 1])[0, -1], window[0, -1], rtol=0, atol=tol)


def test_a_prompt_longer_than_the_context_keeps_its_last_tokens():
    model = seeded(np.float64)
    seq = np.random.default_rng(1).integers(0, 11, T + 5)
    got = Decoder(model).feed(seq[None])
    np.testing.assert_allclose(got, model.run.forward(seq[None, -T:], False), rtol=0, atol=1e-12)


def test_sampling_repeats_for_a_seed_and_greedy_is_top_k_1():
    model = seeded(np.float32)
    def text(**kw):
        return generate.generate(Decoder(model), [1, 2], 3 * T, **kw)
    assert text(temperature=1.0, seed=5) == text(temperature=1.0, seed=5)
    assert text(temperature=1.0, seed=5) != text(temperature=1.0, seed=6)
    greedy = text(temperature=0)
    assert greedy == text(temperature=0, seed=9)   # no draw
    assert text(temperature=1.0, top_k=1, seed=7) == greedy
    logits = np.array([0.0, 3.0, 1.0, 2.0])
    draws = {generate.sample(logits, np.random.default_rng(s), 1.0, top_k=2) for s in range(50)}
    assert draws == {1, 3}
    assert generate.sample(logits, np.random.default_rng(0), 1e-310) == 1   # no overflow to nan


def test_every_vocabulary_comes_back_from_its_record_entry():
    text = "To be, or not to be: that is the question.\n" * 20
    for vocab in (Chars.train(text), Bytes(), Bpe.train(text, 260)):
        back = from_record(json.loads(json.dumps(vocab.record_entry())), "f.h5")
        assert back.vocab_size == vocab.vocab_size
        assert back.decode(back.encode(text)) == text and list(back.encode(text)) == list(vocab.encode(text))
    with pytest.raises(HpctrainError, match="f.h5: damaged vocabulary"):
        from_record({"kind": "bpe", "tokenizer_zlib": "not base64!"}, "f.h5")


@pytest.fixture(scope="module")
def trained_gpt(tmp_path_factory):
    """A small GPT trained 6 steps on 40,000 characters of the plays, on one
    rank: (data dir, --save file, the final record, --checkpoint-dir)."""
    if under_mpirun():
        pytest.skip("launches its own mpirun job: runs in the plain pytest pass")
    root = tmp_path_factory.mktemp("generate")
    source = root / "plays.txt"
    source.write_bytes(Path(data.bundled_text_path()).read_bytes()[:40_000])
    text_dir = root / "chars"
    data.prepare_text(str(source), str(text_dir), "chars", log=lambda *a, **k: None)
    save, metrics, ckpt = root / "gpt.h5", root / "m.jsonl", root / "ckpt"
    r = run_job(1, "--data", text_dir, "--model", "gpt:layers=2,heads=2,width=16", "--block-size", 16,
                "--batch-size", 4, "--steps", 6, "--lr", 1e-2, "--save", save, "--metrics", metrics,
                "--checkpoint-dir", ckpt, "--checkpoint-every", 6)
    assert r.returncode == 0, r.stderr
    return str(text_dir), str(save), json.loads(metrics.read_text().splitlines()[-1]), str(ckpt)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "hpctrain", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=child_env())


def test_the_saved_model_generates_without_its_data_the_same_text_for_a_seed(trained_gpt, tmp_path):
    text_dir, save, _, ckpt = trained_gpt
    flags = ["--prompt", "ROMEO:", "--tokens", 40, "--top-k", 10]
    a, b, c = (cli("generate", "--params", save, *flags, "--seed", s) for s in (1, 1, 2))
    assert a.returncode == 0 and a.stderr == "", a.stderr
    assert a.stdout.startswith("ROMEO:") and a.stdout == b.stdout != c.stdout
    assert cli("generate", "--checkpoint", ckpt, *flags, "--seed", 1).stdout == a.stdout
    # an empty prompt starts from a newline, printed
    assert cli("generate", "--params", save, "--tokens", 5).stdout.startswith("\n")
    # a file without its vocabulary (an older hpctrain's) takes --data's, or says so in one line
    old = tmp_path / "old.h5"
    with h5py.File(save, "r") as f, h5py.File(old, "w") as g:
        for name in f:
            f.copy(name, g)
        g.attrs.update({k: v for k, v in f.attrs.items() if k != ATTR})
        g.attrs[ATTR] = json.dumps({**json.loads(f.attrs[ATTR]), "text": None})
    assert cli("generate", "--params", old, *flags, "--seed", 1, "--data", text_dir).stdout == a.stdout
    r = cli("generate", "--params", old, *flags)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"hpctrain: error: {old}: records no vocabulary (saved by an older hpctrain, or too large for its record); "
        f"give --data DIR, the prepared text it was trained on"]


@pytest.mark.parametrize("args, message", [
    (["--params", "nowhere.h5"], "nowhere.h5: no such file"),
    (["--temperature", "-0.5"], "argument --temperature: must be >= 0"),
    (["--top-k", "0"], "argument --top-k: must be >= 1, got 0"),
    (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["--prompt", "ROMEO\u2603"], "the character '\u2603' is not in this"),
])
def test_bad_flags_are_one_line(trained_gpt, args, message):
    params = [] if "--params" in args else ["--params", trained_gpt[1]]
    r = cli("generate", *params, *args)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("hpctrain: error: ") and message in r.stderr, \
        r.stderr


def test_an_image_classifier_is_refused_in_one_line(tmp_path):
    if under_mpirun():
        pytest.skip("launches its own mpirun job: runs in the plain pytest pass")
    r = run_job(1, "--steps", 1, "--hidden", 8, "--save", tmp_path / "mlp.h5")
    assert r.returncode == 0, r.stderr
    r = cli("generate", "--params", tmp_path / "mlp.h5")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"hpctrain: error: {tmp_path / 'mlp.h5'}: model mlp takes images, not token ids: generate samples a "
        f"language model (--model gpt:...)"]


def test_evaluate_gives_the_final_records_loss_and_its_perplexity(trained_gpt):
    text_dir, save, final, _ = trained_gpt
    r = cli("evaluate", "--params", save, "--data", text_dir, "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["loss"] == final["test_loss"] and result["block_size"] == 16
    assert result["perplexity"] == pytest.approx(math.exp(final["test_loss"]), rel=1e-5)
    line = cli("evaluate", "--params", save, "--data", text_dir).stdout
    assert line.startswith(f"test loss {final['test_loss']:.4f} per token  perplexity "), line
    model = trained.load(save)
    assert evaluate.evaluate_text(model, text_dir, data.load_manifest(text_dir), "test")["loss"] == final["test_loss"]


def test_a_language_model_on_text_of_another_size_says_what_it_takes():
    # Issue 54, 10: "takes tokenss of 65 classes".
    from types import SimpleNamespace
    model = SimpleNamespace(spec=SimpleNamespace(input_kind="tokens", classes=65), source="gpt.h5")
    with pytest.raises(HpctrainError, match=r"^text: text of 67 tokens, but the model in gpt.h5 takes text of 65 "
                                            r"tokens: another model's file"):
        evaluate.evaluate_text(model, "text", {"vocab_size": 67}, "test")


def test_a_wide_vocabulary_travels_in_the_record(tmp_path):
    """20,000 distinct characters (JSON escapes them: 120 KB, past an HDF5
    object header's 64 KiB) stay in the record, a variable-length string in
    the global heap: generate needs no --data, and gives what it gives with it."""
    if under_mpirun():
        pytest.skip("launches its own mpirun job: runs in the plain pytest pass")
    chars = "".join(map(chr, range(0x4E00, 0x4E00 + 20_000)))
    (tmp_path / "wide.txt").write_text(chars * 3, encoding="utf-8")
    data.prepare_text(str(tmp_path / "wide.txt"), str(tmp_path / "wide"), "chars", log=lambda *a, **k: None)
    save = tmp_path / "wide.h5"
    r = run_job(1, "--data", tmp_path / "wide", "--model", "gpt:layers=1,heads=1,width=8", "--block-size", 8,
                "--batch-size", 2, "--steps", 1, "--save", save)
    assert r.returncode == 0, r.stderr
    with h5py.File(save, "r") as f:
        text = f.attrs[ATTR]
    rec = json.loads(text)
    assert len(text) > 65536 and rec["classes"] == 20_000 and rec["text"]["kind"] == "chars"
    flags = ("--prompt", chars[:3], "--tokens", 4, "--seed", 3)
    r = cli("generate", "--params", save, *flags)
    assert r.returncode == 0 and r.stdout.startswith(chars[:3]) and len(r.stdout) == 3 + 4 + 1, r.stderr
    assert cli("generate", "--params", save, *flags, "--data", tmp_path / "wide").stdout == r.stdout


def test_a_record_past_its_cap_leaves_the_vocabulary_out(tmp_path, monkeypatch):
    """Past model_record.MAX_RECORD the class names go, then the vocabulary
    (generate then takes --data's, or says so in one line: above)."""
    from types import SimpleNamespace

    from hpctrain.checkpoints import model_record
    (tmp_path / "t.txt").write_text("abcdefgh" * 50, encoding="utf-8")
    data.prepare_text(str(tmp_path / "t.txt"), str(tmp_path / "t"), "chars", log=lambda *a, **k: None)
    spec = SimpleNamespace(identity="gpt", input_shape=(8,), classes=8)
    plan = SimpleNamespace(model="gpt:layers=1,heads=1,width=8", hidden=(), data=SimpleNamespace(dir=tmp_path / "t"))
    whole = json.loads(model_record.record(spec, plan)[ATTR])
    assert whole["text"]["kind"] == "chars"
    monkeypatch.setattr(model_record, "MAX_RECORD", len(json.dumps(whole)) - 1)
    cut = json.loads(model_record.record(spec, plan)[ATTR])
    assert cut["text"] is None and cut["model"] == whole["model"] and cut["classes"] == 8


