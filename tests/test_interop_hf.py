"""Hugging Face GPT-2 in and out (issue 56; hpctrain/interop/), held to
`transformers` itself: a random GPT2LMHeadModel saved by save_pretrained
evaluates in hpctrain to transformers' loss; fine-tuned from it at 2 ranks
(`train --init-from`), exported (`hpctrain export --format hf`), it loads in
transformers with no missing or unexpected key and gives hpctrain's loss,
logits and greedy tokens; its tokenizer encodes as hpctrain's vocabulary
(chars, bytes, bpe); the .safetensors and --save files start runs at
--tensor-parallel 2 and --zero 3 from the same parameters; every bad input
is one line. Tiny models (width 32, 2 layers, 16 positions), a few steps.

    .venv/bin/python -m pytest -q tests/test_interop_hf.py
"""
import json
import os
import shutil

import numpy as np
import pytest

from conftest import run_job, under_mpirun
from hpctrain import evaluate, generate
from hpctrain.base.errors import HpctrainError
from hpctrain.data.tokens import load_test_windows
from hpctrain.data.vocab import Bpe, Bytes, Chars
from hpctrain.flags import cli
from hpctrain.interop import export, gpt2, pretrained, safetensors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BLOCK = 64        # the fine-tune's context: room for a prompt and 50 greedy tokens
POSITIONS = 128   # the pretrained model's: its table longer than the fine-tune takes
STEPS = 100       # the fine-tune's
LINE = "ROMEO:\nBut soft, what light through yonder window breaks?"

pytestmark = pytest.mark.skipif(under_mpirun(), reason="launches its own mpirun jobs: runs in the plain pytest pass")


def hf_model(vocab, positions=POSITIONS, seed=0, **config):
    torch.manual_seed(seed)
    config = {"activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, **config}   # GPT-2's
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                                  eos_token_id=None, **config)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():   # larger than the 0.02 initialisation, so that the tokens' losses differ
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def torch_loss(model, data_dir, block):
    """transformers' mean per-token loss over the held-out windows hpctrain evaluates."""
    x, y = load_test_windows(str(data_dir), block)
    with torch.no_grad():
        logits = model(torch.from_numpy(x)).logits
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       torch.from_numpy(y).reshape(-1)))


def final(metrics):
    return json.loads(open(metrics).read().splitlines()[-1])


def gpt2_folder(text, folder):
    """What a user brings: a byte-level BPE trained (by `tokenizers`) on the
    text, and a random GPT2LMHeadModel of its vocabulary with GPT-2's own
    GELU (gelu_new), both saved by transformers' save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
    model = hf_model(tok.get_vocab_size())
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Issue 56's scenario: the plays prepared with a pretrained model's
    tokenizer (`--text tokenizer:FOLDER`), the model fine-tuned from its
    folder at 2 ranks for 100 steps (--save, --metrics, checkpoints), and
    the run exported."""
    from hpctrain import data as data_mod
    root = tmp_path_factory.mktemp("hf")
    text = open(data_mod.bundled_text_path(), encoding="utf-8").read()[:20000]
    (root / "plays.txt").write_text(text, encoding="utf-8")
    source = gpt2_folder(text, root / "gpt2")
    data = root / "plays"
    data_mod.prepare_text(str(root / "plays.txt"), str(data), f"tokenizer:{root / 'gpt2'}", log=None)
    r = run_job(2, "--init-from", root / "gpt2", "--data", data, "--block-size", BLOCK, "--steps", STEPS,
                "--batch-size", 4, "--save", root / "ft.h5", "--metrics", root / "ft.jsonl",
                "--checkpoint-dir", root / "ckpt", module="hpctrain.train")
    assert r.returncode == 0, r.stderr
    assert "parameters from --init-from" in r.stdout and "gpt:layers=2,heads=2,width=32,act=gelu_tanh" in r.stdout
    # the folder from the run's last checkpoint (each rank's parts), the file from its --save
    assert export.main(["--params", str(root / "ckpt"), "--format", "hf", "--to", str(root / "ft-hf")]) == 0
    assert export.main(["--params", str(root / "ft.h5"), "--format", "safetensors",
                        "--to", str(root / "ft.safetensors")]) == 0
    return {"data": data, "root": root, "source": source, "ft": final(root / "ft.jsonl")}


def test_an_imported_gpt2_evaluates_to_transformers_loss(world, capsys):
    assert evaluate.main(["--params", str(world["root"] / "gpt2"), "--data", str(world["data"]), "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)
    assert ours["block_size"] == POSITIONS
    assert abs(ours["loss"] - torch_loss(world["source"], world["data"], POSITIONS)) < 1e-4


def test_the_export_loads_in_transformers_with_hpctrains_loss_logits_and_greedy_tokens(world, capsys):
    from hpctrain.checkpoints import trained
    folder = world["root"] / "ft-hf"
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.config.activation_function == "gelu_new" and model.config.n_positions == BLOCK
    assert abs(torch_loss(model, world["data"], BLOCK) - world["ft"]["test_loss"]) < 1e-4
    ours = trained.load(params=str(world["root"] / "ft.h5"))
    x = np.random.default_rng(1).integers(0, ours.spec.classes, (2, BLOCK))
    with torch.no_grad():
        theirs = model(torch.from_numpy(x)).logits.numpy()
    np.testing.assert_allclose(theirs, ours.model.run.forward(x, False), rtol=0, atol=1e-4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = "ROMEO:"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    greedy = model.generate(ids, max_new_tokens=50, do_sample=False)
    assert greedy.shape[1] == ids.shape[1] + 50
    assert generate.main(["--params", str(world["root"] / "ft.h5"), "--prompt", prompt, "--tokens", "50",
                          "--top-k", "1"]) == 0
    assert capsys.readouterr().out == tokenizer.decode(greedy[0]) + "\n"   # generate prints the text and one newline


@pytest.mark.parametrize("source, flags", [("ft.h5", ["--zero", "3"]), ("ft-hf", ["--tensor-parallel", "2"]),
                                           ("ft.safetensors", []), ("ft-hf", ["--pipeline-stages", "2"]),
                                           ("ft.h5", ["--mode", "ps"])])
def test_a_fine_tune_starts_from_the_files_parameters_at_any_layout(world, source, flags):
    """Each file the fine-tune was saved or exported as starts a run from its
    parameters: at a learning rate too small to move them, the run's held-out
    loss is the fine-tune's final one."""
    root = world["root"]
    metrics = root / f"{source}.jsonl"
    r = run_job(2, "--init-from", root / source, "--data", world["data"], "--steps", 1, "--batch-size", 4,
                "--lr", "1e-12", "--metrics", metrics, *flags, module="hpctrain.train")
    assert r.returncode == 0, r.stderr
    assert abs(final(metrics)["test_loss"] - world["ft"]["test_loss"]) < 1e-4


@pytest.mark.parametrize("kind", ["chars", "bytes", "bpe"])
def test_the_exported_tokenizer_encodes_as_hpctrains_vocabulary(tmp_path, kind):
    text = open(os.path.join(os.path.dirname(__file__), "..", "data", "shakespeare", "input.txt"),
                encoding="utf-8").read()[:20000]
    vocab = {"chars": lambda: Chars.train(text), "bytes": Bytes, "bpe": lambda: Bpe.train(text, 300)}[kind]()
    (tmp_path / gpt2.TOKENIZER).write_text(gpt2.tokenizer_json(vocab))
    (tmp_path / gpt2.TOKENIZER_CONFIG).write_text(json.dumps(gpt2.tokenizer_config(BLOCK)))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer(LINE)["input_ids"]
    assert ids == vocab.encode(LINE).tolist()
    assert tokenizer.decode(ids) == LINE


# --- bad input: one line each ---------------------------------------------------------------


def folder_with(tmp_path, config=None, tensors=None, pickled=False):
    out = tmp_path / "model"
    out.mkdir(parents=True)
    if config is not None:
        (out / gpt2.CONFIG).write_text(json.dumps(config))
    if tensors is not None:
        safetensors.write(out / gpt2.WEIGHTS, tensors, {"format": "pt"})
    if pickled:
        (out / gpt2.PICKLED).write_bytes(b"\x80\x04")
    return out


def hf_tensors(model, drop=None):
    """A GPT2LMHeadModel's tensors as save_pretrained stores them, but one (`drop`)."""
    return [(k, v.numpy()) for k, v in model.state_dict().items() if k not in (drop, "lm_head.weight")]


def gpt2_config(**changes):
    return dict(hf_model(65).config.to_dict(), **changes)


@pytest.mark.parametrize("config, line", [
    (dict(model_type="llama"), "a llama model (model_type); hpctrain's GPT imports GPT-2 (model_type gpt2) only"),
    (dict(model_type="bert"), "a bert model (model_type)"),
    (dict(activation_function="relu"), "activation_function 'relu'; hpctrain's GPT computes gelu, gelu_new"),
    (dict(n_inner=64), "n_inner 64; hpctrain's GPT has an MLP of 4 x n_embd (128)"),
    (dict(tie_word_embeddings=False), "tie_word_embeddings is false"),
])
def test_a_config_hpctrain_does_not_build_is_one_line(tmp_path, config, line):
    folder = folder_with(tmp_path, gpt2_config(**config), hf_tensors(hf_model(65)))
    with pytest.raises(HpctrainError, match=line.replace("(", r"\(").replace(")", r"\)")):
        pretrained.open_source(folder)


def test_a_pickle_alone_is_refused_and_missing_or_misshapen_tensors_named(tmp_path):
    with pytest.raises(HpctrainError, match=r"holds pytorch_model.bin only, a pickle .* refuses; convert it: "
                                            r".*save_pretrained\(OUT, safe_serialization=True\)"):
        pretrained.open_source(folder_with(tmp_path, gpt2_config(), pickled=True))
    model = hf_model(65)
    for i, (tensors, line) in enumerate([
            (hf_tensors(model, drop="transformer.h.1.mlp.c_fc.bias"),
             "no tensor transformer.h.1.mlp.c_fc.bias, which model gpt:layers=2,heads=2,width=32,act=gelu_tanh needs"),
            ([(k, v.T if k == "transformer.h.0.attn.c_attn.weight" else v) for k, v in hf_tensors(model)],
             "transformer.h.0.attn.c_attn.weight is 96x32, model gpt:layers=2,heads=2,width=32,act=gelu_tanh needs 32x96")]):
        with pytest.raises(HpctrainError, match=line):   # the loader generate and evaluate use
            pretrained.load_trained(folder_with(tmp_path / str(i), gpt2_config(), tensors))


def test_init_from_takes_the_model_and_refuses_one_that_contradicts_it(world):
    hf = str(world["root"] / "gpt2")
    args = pretrained.init_args(cli.parse(["--init-from", hf], quiet=True))
    assert args.model == "gpt:layers=2,heads=2,width=32,act=gelu_tanh" and args.block_size == POSITIONS
    args = cli.parse(["--init-from", hf, "--model", "gpt:layers=2,heads=2,width=32,act=gelu_tanh,dropout=0.1",
                      "--block-size", "8"],
                     quiet=True)
    assert "dropout=0.1" in pretrained.init_args(args).model   # the same model, dropout its own
    with pytest.raises(HpctrainError, match=f"--model gpt:layers=4,heads=2,width=32 contradicts --init-from {hf}, "
                                            f"which holds model gpt:layers=2,heads=2,width=32,act=gelu_tanh"):
        pretrained.init_args(cli.parse(["--init-from", hf, "--model", "gpt:layers=4,heads=2,width=32"], quiet=True))
    for given in ("512", "256"):   # 256, the default's value, typed: still given, still too long
        with pytest.raises(HpctrainError, match=f"--block-size {given}: --init-from {hf} has 128 positions"):
            pretrained.init_args(cli.parse(["--init-from", hf, "--block-size", given], quiet=True))
    with pytest.raises(HpctrainError, match=f"--model mlp contradicts --init-from {hf}"):
        pretrained.init_args(cli.parse(["--init-from", hf, "--model", "mlp"], quiet=True))


def test_data_of_another_vocabulary_is_one_line(world, tmp_path):
    from hpctrain import data
    (tmp_path / "t.txt").write_text("hello there\n" * 300)
    data.prepare_text(str(tmp_path / "t.txt"), str(tmp_path / "bytes"), "bytes", log=lambda *a, **k: None)
    # a folder without its tokenizer: all it can tell is its size
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in (gpt2.CONFIG, gpt2.WEIGHTS):
        shutil.copy(world["root"] / "gpt2" / name, bare / name)
    with pytest.raises(HpctrainError, match=f"--init-from {bare}: a model of 300 token ids, but data .* holds "
                                            f"bytes:256 .*: prepare the text with the model's tokenizer"):
        pretrained.check_init_data(str(bare), 256, str(tmp_path / "bytes"))
    # a folder with its tokenizer, and data of another tokenizer of the same size: held whole, not by its size
    text = open(world["root"] / "plays.txt", encoding="utf-8").read()
    other = tmp_path / "other-tokenizer"
    gpt2_folder(text[::-1], other)
    data.prepare_text(str(world["root"] / "plays.txt"), str(tmp_path / "other"), f"tokenizer:{other}", log=None)
    with pytest.raises(HpctrainError, match=f"--init-from {world['root'] / 'gpt2'}.* vocabulary bpe:300 .*digest"):
        pretrained.check_init_data(str(world["root"] / "gpt2"), 300, str(tmp_path / "other"))
    pretrained.check_init_data(str(world["root"] / "gpt2"), 300, str(world["data"]))   # its own tokenizer's data
    # an export records the vocabulary it was trained on
    with pytest.raises(HpctrainError, match="was trained on vocabulary bpe:300"):
        pretrained.check_init_data(str(world["root"] / "ft.safetensors"), 256, str(tmp_path / "bytes"))


def test_bad_exports_are_one_line_and_write_nothing(world, tmp_path, capsys):
    root = world["root"]
    cases = [(["--params", str(root / "ft.h5"), "--format", "hf", "--to", str(root / "ft-hf")],
              f"--to {root / 'ft-hf'}: exists; name a new folder"),
             (["--params", str(root / "ft-hf"), "--format", "safetensors", "--to", str(root / "ft-hf" / "x")],
              "would write inside the run's input")]
    for argv, line in cases:
        assert export.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("hpctrain: error: ") and line in err and err.count("\n") == 1, err
    from hpctrain.nn.zoo import mlp
    with pytest.raises(HpctrainError, match="model mlp is not hpctrain's GPT"):
        gpt2.names(mlp((4,), 3, [8]))
    assert not (root / "ft-hf" / "x").exists()
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_shorter_block_takes_the_tables_first_rows_and_no_output_replaces_the_model(world):
    from hpctrain.base.overwrites import Output, check_not_inputs
    from hpctrain.nn.gpt import gpt
    from hpctrain.run.outputs import run_inputs
    root, vocab = world["root"], world["source"].config.vocab_size
    for path in (root / "ft.h5", root / "gpt2"):
        with pretrained.open_source(path) as source:
            source.check(gpt(vocab, 8, 2, 2, 32))   # 8 of its 64 (128) positions
            assert source.read("position/P").shape == (8, 32)
            with pytest.raises(HpctrainError, match=r"position/P is 64x32, model .* needs 256x32|wpe.weight is 128x32"):
                source.check(gpt(vocab, 256, 2, 2, 32))
    args = cli.parse(["--init-from", str(root / "ft.h5"), "--save", str(root / "ft.h5")], quiet=True)
    with pytest.raises(HpctrainError, match=r"--save .* would overwrite the run's input .* \(the --init-from model\)"):
        check_not_inputs([Output(args.save, "--save")], run_inputs(args, str(world["data"])))
