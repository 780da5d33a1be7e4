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
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import checkpoint_path, run_job, under_mpirun
from hpctrain import data, evaluate, generate
from hpctrain.checkpoints import trained
from hpctrain.checkpoints.model_record import ATTR
from hpctrain.data.vocab import Bpe, Bytes, Chars, describe, from_record, load_vocabulary
from hpctrain.base.errors import HpctrainError
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


def test_a_users_subclass_of_a_tokenwise_layer_decodes_and_keeps_its_kernel():
    """What a layer is (tokenwise, its compiled kernel) is declared on its
    class and inherited (issue 55, 3): a GPT whose final LayerNorm is a
    user's subclass decodes as the plain one, and a user's ReLU subclass
    still runs ReLU's compiled kernel by the start-up line."""
    from hpctrain.base import vector_width
    from hpctrain.nn import Dense, Flatten, LayerNorm, ModelSpec, ReLU, compiled
    from hpctrain.nn.gpt import gpt_layers
    from hpctrain.nn.kernels_used import layers_line

    class MyNorm(LayerNorm):
        pass
    layers, loss = gpt_layers(11, T, layers=1, heads=2, width=16)
    layers[-2] = MyNorm()
    spec = ModelSpec(layers, (T,), 11, loss=loss)
    model = spec.build(np, dtype=np.float64)
    model.init(3)
    seq = np.random.default_rng(1).integers(0, 11, T)
    np.testing.assert_allclose(Decoder(model).feed(seq[None]), model.run.forward(seq[None], False), rtol=0,
                               atol=1e-12)

    class MyReLU(ReLU):
        pass
    was = compiled.on()
    try:
        compiled.use(True)
        assert layers_line(ModelSpec([Flatten(), Dense(4), MyReLU(), Dense(2)], (3,), 2)) == \
            "layers: compiled (nn/compiled.py: ReLU" + ("; 512-bit vectors" if vector_width.wide() else "") + ")"
    finally:
        compiled.use(was)


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
    rank: (data dir, --save file, the final record, --checkpoint-dir); its
    --keep-best file is best.h5 beside the --save file."""
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
                "--checkpoint-dir", ckpt, "--checkpoint-every", 6, "--eval-every", 6, "--keep-best", root / "best.h5")
    assert r.returncode == 0, r.stderr
    return str(text_dir), str(save), json.loads(metrics.read_text().splitlines()[-1]), str(ckpt)


def cli(*args, env=None):
    # (an argument's surrogate escapes reach the child as the bytes they stand for: subprocess fsencodes)
    return subprocess.run([sys.executable, "-m", "hpctrain", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=env or child_env())


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
    # issue 54, 4: a byte that is not UTF-8 (the shell's $'ROMEO:\\xff': a surrogate escape in sys.argv)
    (["--prompt", "ROMEO:\udcff"], "--prompt: byte 0xff at offset 6 is not UTF-8; a chars vocabulary takes UTF-8"),
    # issue 54, N4
    (["--top-p", "0"], "argument --top-p: must be in (0, 1], got 0"),
    (["--top-p", "1.5"], "argument --top-p: must be in (0, 1], got 1.5"),
    (["--num-samples", "0"], "argument --num-samples: must be >= 1, got 0"),
    (["--prompt-file", "nowhere.txt"], "--prompt-file nowhere.txt: No such file or directory"),
    (["--stop", ""], "argument --stop: an empty string would end every sample"),
])
def test_bad_flags_are_one_line(trained_gpt, args, message, capsys):
    params = [] if "--params" in args else ["--params", trained_gpt[1]]
    if any("\udcff" in arg for arg in args):   # the shell's byte, through a real argv (subprocess fsencodes it)
        r = cli("generate", *params, *args)
        code, out, err = r.returncode, r.stdout, r.stderr
    else:   # the parser's and main's refusals: main's one_line_errors in this process (a python a case took seconds)
        code = generate.main([str(a) for a in (*params, *args)])
        out, err = capsys.readouterr()
    assert code == 2 and out == "", out
    assert len(err.splitlines()) == 1 and err.startswith("hpctrain: error: ") and message in err, err


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




def test_a_model_meeting_other_data_is_one_line_in_every_command(trained_gpt, tmp_path, capsys):
    """Issue 54, items 1 and 5: the GPT's files (--save, --keep-best, a
    checkpoint) meeting the plays with one character made another (a
    vocabulary of the same size: evaluate once scored it, rc 0), or images
    (a KeyError, an IndexError once), and a resume on that text, fine-tuning
    (--resume-other-data) included: one line naming both sides, exit 2."""
    from PIL import Image

    from hpctrain import predict
    text_dir, save, _, ckpt = trained_gpt
    best = str(Path(save).parent / "best.h5")
    plays = Path(data.bundled_text_path()).read_text(encoding="utf-8")[:40_000]
    assert "z" in plays and "@" not in plays
    (tmp_path / "other.txt").write_text(plays.replace("z", "@"), encoding="utf-8")
    other = tmp_path / "other"
    data.prepare_text(str(tmp_path / "other.txt"), str(other), "chars", log=lambda *a, **k: None)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "images.npz", x=rng.integers(0, 256, (40, 6, 6), np.uint8), y=np.arange(40) % 4)
    images = tmp_path / "images"
    data.prepare(str(tmp_path / "images.npz"), str(images), log=lambda *a, **k: None)
    Image.fromarray(rng.integers(0, 256, (6, 6), np.uint8)).save(tmp_path / "one.png")
    mine, have = (describe(load_vocabulary(d)) for d in (text_dir, other))
    assert mine.split(" ")[0] == have.split(" ")[0] and mine != have   # chars:N both, another digest

    def one_line(command, *args):
        code = {"evaluate": evaluate, "predict": predict, "generate": generate}[command].main(list(map(str, args)))
        out, err = capsys.readouterr()
        assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("hpctrain: error: "), err
        return err.rstrip("\n").removeprefix("hpctrain: error: ")

    other_vocab = f"was trained on vocabulary {mine} but data {other} holds {have}: another model's file, or other data"
    assert one_line("evaluate", "--params", save, "--data", other) == f"model {save} {other_vocab}"
    assert one_line("evaluate", "--params", best, "--data", other) == f"model {best} {other_vocab}"
    assert one_line("generate", "--params", save, "--data", other) == f"model {save} {other_vocab}"
    assert one_line("evaluate", "--checkpoint", ckpt, "--data", other).endswith(other_vocab)
    on_images = f"is a language model and data {images} holds images: a language model cannot read images"
    assert one_line("evaluate", "--params", save, "--data", images) == f"model {save} {on_images}"
    assert one_line("predict", "--params", save, "--data", images) == f"model {save} {on_images}"
    assert one_line("generate", "--params", save, "--data", images) == f"model {save} {on_images}"
    assert one_line("predict", "--params", save, tmp_path / "one.png") == (
        f"model {save} is a language model and {tmp_path / 'one.png'} holds images: a language model cannot "
        f"read images")
    assert one_line("predict", "--params", save, "--data", text_dir).startswith(
        f"model {save} is a language model: predict classifies images")
    # a resume on the other text, fine-tuning included: the same ids would be other characters
    shutil.copytree(ckpt, tmp_path / "ckpt")
    r = run_job(1, "--data", other, "--model", "gpt:layers=2,heads=2,width=16", "--block-size", 16,
                "--batch-size", 4, "--steps", 8, "--lr", 1e-2, "--checkpoint-dir", tmp_path / "ckpt",
                "--resume-other-data")
    assert r.returncode == 2 and r.stderr.splitlines()[-1].startswith(
        f"hpctrain: error: checkpoint {checkpoint_path(tmp_path / 'ckpt', 6)} was trained on vocabulary {mine} but "
        f"data {other} holds {have}: resume on text of its vocabulary"), r.stderr
    assert "Traceback" not in r.stderr
def test_top_p_samples_from_the_nucleus_only():
    # p = softmax([0, 3, 1, 2]) = .032 .644 .087 .237: the nucleus of .5 is {1}, of .7 {1, 3}, of .9 {1, 3, 2}
    logits = np.array([0.0, 3.0, 1.0, 2.0])
    for top_p, nucleus in ((0.5, {1}), (0.7, {1, 3}), (0.9, {1, 2, 3}), (1.0, {0, 1, 2, 3})):
        assert {generate.sample(logits, np.random.default_rng(s), 1.0, top_p=top_p) for s in range(200)} == nucleus
    model = seeded(np.float32)
    a, b = (generate.generate(Decoder(model), [1, 2], 2 * T, 1.0, seed=5, top_p=0.8) for _ in range(2))
    assert a == b


def test_a_bytes_vocabulary_takes_a_prompts_bytes_the_others_name_the_byte(tmp_path):
    # issue 54, 4: $'ROMEO:\xff' reaches sys.argv as 'ROMEO:\udcff' (a surrogate escape)
    assert generate.prompt_text(Bytes(), "ROMEO:\udcff", None) == b"ROMEO:\xff"
    assert list(Bytes().encode(generate.prompt_text(Bytes(), "ROMEO:\udcff", None)))[-1] == 0xff
    (tmp_path / "p.txt").write_bytes(b"ROMEO:\xff")
    assert generate.prompt_text(Bytes(), "", str(tmp_path / "p.txt")) == b"ROMEO:\xff"
    assert generate.prompt_text(Chars.train("ROMEO:"), "ROMEO:", None) == "ROMEO:"
    with pytest.raises(HpctrainError, match=r"^--prompt: byte 0xff at offset 6 is not UTF-8; a chars vocabulary"):
        generate.prompt_text(Chars.train("ROMEO:"), "ROMEO:\udcff", None)
    with pytest.raises(HpctrainError, match=r"^--prompt-file .*p.txt: byte 0xff at offset 6 is not UTF-8"):
        generate.prompt_text(Chars.train("ROMEO:"), "", str(tmp_path / "p.txt"))


class Recorded:
    """A stdout that keeps each write and where flushes fell."""

    def __init__(self):
        self.events = []

    def write(self, text):
        self.events.append(text)

    def flush(self):
        self.events.append(None)

    def pieces(self):
        return [e for e in self.events if e is not None]


def test_text_comes_out_in_whole_characters_each_flushed():
    # issue 54, N1: a bytes (or BPE) vocabulary splits a character over tokens; what is written is whole
    out = Recorded()
    text = generate.TextOut(Bytes(), out)
    for b in "é€x".encode() + b"\xffa":
        text.write(b)
    text.close()
    assert out.events == ["é", None, "€", None, "x", None, "\ufffda", None]
    out = Recorded()
    text = generate.TextOut(Bytes(), out, flush=False)
    for b in "ab€".encode()[:-1]:   # ends mid-character: written at the end, as decode gives it
        text.write(b)
    text.close()
    assert "".join(out.pieces()) == Bytes().decode(list("ab€".encode()[:-1])) and None not in out.events


def test_a_stop_string_ends_the_sample_where_it_ends():
    vocab = Chars.train("abcdef")
    out = Recorded()
    text = generate.TextOut(vocab, out, stop=["zz", "cd"])
    for i in vocab.encode("abcdef"):
        text.write(int(i))
        if text.done:
            break
    assert "".join(out.pieces()) == "abcd" and text.done
    text = generate.TextOut(Bytes(), Recorded(), stop=["€"])   # a stop string inside a multi-byte character
    for b in "a€b".encode():
        text.write(b)
        if text.done:
            break
    assert text.text == "a€"


def test_the_new_flags_give_the_same_text_for_a_seed(trained_gpt, tmp_path, monkeypatch):
    """Issue 54, N4/N1: --prompt-file = --prompt, --max-new-tokens = --tokens,
    the first of --num-samples 2 = --num-samples 1, --stream off = on; the
    streamed text flushed token by token (the main run in this process)."""
    _, save, _, _ = trained_gpt
    (tmp_path / "p.txt").write_text("ROMEO:", encoding="utf-8")
    flags = ["--params", save, "--top-k", "10", "--seed", "1"]

    def run(*more):
        out = Recorded()
        monkeypatch.setattr(sys, "stdout", out)
        assert generate.main([*flags, *more]) == 0
        monkeypatch.undo()
        return out
    one = run("--prompt", "ROMEO:", "--tokens", "40")
    assert one.events[:2] == ["ROMEO:", None] and one.events.count(None) >= 40   # the prompt, then each token
    whole = "".join(one.pieces())
    assert whole.startswith("ROMEO:") and len(whole) == 6 + 40 + 1
    two = run("--prompt-file", str(tmp_path / "p.txt"), "--max-new-tokens", "40", "--num-samples", "2",
              "--stream", "off")
    assert None not in two.events and len(two.pieces()) == 1   # written once, at the end
    first, second = two.pieces()[0].split("-" * 15 + "\n")
    assert first == whole and second.startswith("ROMEO:") and second != first
    generated = whole[6:-1]
    stop = generated[10:12]
    cut = run("--prompt", "ROMEO:", "--tokens", "40", "--stop", stop)
    assert "".join(cut.pieces()) == "ROMEO:" + generated[:generated.index(stop) + 2] + "\n"


PROBE = """
import ctypes, os, sys
{run}
from hpctrain.nn import threads
with open("/proc/self/maps") as f:
    libs = sorted({{line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line}})
names = ("openblas_get_num_threads", "openblas_get_num_threads64_", "scipy_openblas_get_num_threads64_")
blas = [getattr(ctypes.CDLL(p), n) for p in libs for n in names if hasattr(ctypes.CDLL(p), n)]
print("env", os.environ.get("OPENBLAS_NUM_THREADS"), "blas", [f() for f in blas], "compute", threads.count(),
      file=sys.stderr)
"""


@pytest.mark.parametrize("how", ["hpctrain generate", "python -m hpctrain.generate", "hpctrain evaluate",
                                 "hpctrain predict"])
def test_one_process_commands_pin_blas_as_training_does(trained_gpt, how):
    """Issue 54, N1: BLAS at one thread and the cores as compute threads, as
    train gives a rank alone on its node (run/cluster.py pin_blas), not
    OpenBLAS's default of a thread per core. The variable is what counts:
    set before numpy loads, OpenBLAS starts no pool of its own (a pthreads
    OpenBLAS's openblas_set_num_threads_local, which nn/threads calls, sets
    the global count too, so the count alone says less)."""
    from hpctrain.run.cluster import threads_per_rank
    text_dir, save, _, _ = trained_gpt
    more = {"generate": ["--tokens", "2"], "evaluate": ["--data", text_dir],
            "predict": [os.path.join(text_dir, "manifest.json")]}   # (predict refuses it: its threads come first)
    args = ["--params", save] + more[how.split()[-1].split(".")[-1]]
    if how.startswith("python -m"):
        run = (f"import runpy; sys.argv = ['generate'] + {args!r}\ntry:\n"
               f"    runpy.run_module('hpctrain.generate', run_name='__main__')\nexcept SystemExit:\n    pass")
    else:
        run = f"from hpctrain import command; command.main({[how.split()[1], *args]!r})"
    env = {k: v for k, v in child_env().items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                                               "MKL_NUM_THREADS")}
    r = subprocess.run([sys.executable, "-c", PROBE.format(run=run)], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 0, r.stderr
    # (compute threads only where BLAS can hold each to one thread: nn/threads.configure)
    from hpctrain.nn import threads
    compute = threads_per_rank() if threads._blas_local_threads() else 1
    assert r.stderr.splitlines()[-1] == f"env 1 blas [1] compute {compute}", r.stderr
