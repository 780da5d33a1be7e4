"""Training nanoGPT's model (`--model gpt:...`, nn/gpt.py) on prepared text
(`prepare --text`, data/splits.py) through the runner: every distributed
path against a simpler one on the same windows (2 ranks against one process
with --accumulate-steps, a pipeline cut between the tied embedding and head
against accumulation bit for bit, sync ps against ring), resume bit for
bit, tokens/s and the per-token held-out loss in the lines and the record,
and bad flags or mismatched data refused in one line.

    .venv/bin/python -m pytest -q tests/test_gpt_training.py
"""
import json
import re

import numpy as np
import pytest

from conftest import checkpoint_path, prepared_plays, remove_checkpoint, saved, same_bytes

GPT = "gpt:layers=2,heads=2,width=16"
FLAGS = ["--model", GPT, "--block-size", 16, "--batch-size", 4, "--steps", 6, "--log-every", 3, "--lr", 1e-3]


def ok(r):
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    return str(prepared_plays(tmp_path_factory, 40_000))


def close(a, b, rtol):
    a, b = saved(a), saved(b)
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=rtol * 1e-2, err_msg=k)


def test_two_ranks_train_the_gpt_of_one_process_with_accumulation(job, text_dir, tmp_path, capsys):
    """The same windows (dealt as images are dealt) on 2 ranks and on 1 with
    --accumulate-steps 2: the same parameters within float32 rounding (the
    embedding's gradient sums over tokens in another order); the line gives
    tokens/s and the final record the per-token test loss and tokens_per_s.
    SGD: Adam would turn the rounding in the keys' bias (its gradient is 0
    but for rounding: softmax ignores a constant added to every key) into
    steps of lr."""
    metrics = tmp_path / "m.jsonl"
    # --eval-tokens 512: 32 of the 249 held-out windows, the same sample on 1 and 2 ranks (issue 54 N2)
    flags = [*FLAGS, "--optimizer", "sgd", "--lr", 0.1, "--eval-tokens", 512]
    r = ok(job(2, "--data", text_dir, *flags, "--save", tmp_path / "two.h5", "--metrics", metrics))
    assert "tokens/s" in r.stdout and "samples/s" not in r.stdout, r.stdout
    assert "a vocabulary of" in r.stdout and "MFLOPs per token" in r.stdout, r.stdout
    # the ZeRO stage in the start line and the end line, with a rank's peak memory (issue 54 N3)
    assert "(2 workers), ZeRO stage 1 (the optimizer state sharded over 2 replicas, the default), " in r.stdout
    assert re.search(r"^memory: at least [\d,]+ MB a rank expected at ZeRO stage 1 \(", r.stdout, re.M), r.stdout
    assert "evaluations: 512 of the 3,984 held-out tokens, 32 windows evenly spaced over them" in r.stdout
    end = [line for line in r.stdout.splitlines() if line.startswith("test loss")]
    assert len(end) == 1 and "per token" in end[0], r.stdout
    assert "(on 512 of 3,984 held-out tokens, an evenly spaced sample (--eval-tokens), 6 steps, " in end[0], end
    assert "; ZeRO stage 1, peak memory " in end[0] and end[0].endswith(" MB (the largest rank's))"), end
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    final = records[-1]
    assert final["tokens_per_s"] == pytest.approx(final["samples_per_s"] * 16, rel=1e-3)
    assert 2.5 < final["test_loss"] < 5, final   # ln(vocabulary) ~ 4 at the start, per token
    assert (final["test_tokens"], final["held_out_tokens"]) == (512, 3984), final
    # the model's FLOPs over the ranks' measured SGEMM (report/mfu.py): a fraction of it (issue 60 §2)
    assert 0 < final["mfu"] < 1 and final["sgemm_gflops"] > 0, final
    assert [r["lr"] for r in records[:-1]] == [0.1, 0.1], records   # the metrics records carry the lr
    ok(job(1, "--data", text_dir, *flags, "--accumulate-steps", 2, "--save", tmp_path / "one.h5",
           "--metrics", tmp_path / "one.jsonl"))
    close(tmp_path / "two.h5", tmp_path / "one.h5", 1e-5)
    alone = json.loads((tmp_path / "one.jsonl").read_text().splitlines()[-1])
    assert alone["test_tokens"] == 512 and alone["test_loss"] == pytest.approx(final["test_loss"], rel=1e-5)
    # hpctrain evaluate --eval-tokens 512 scores the same windows: the final record's loss, one process's bits
    from hpctrain import evaluate
    assert evaluate.main(["--params", str(tmp_path / "one.h5"), "--data", text_dir, "--eval-tokens", "512",
                          "--json"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert (scored["loss"], scored["num_tokens"], scored["held_out_tokens"]) == (alone["test_loss"], 512, 3984)


def test_final_eval_off_skips_the_final_evaluation_and_says_so(job, text_dir, tmp_path):
    """--final-eval off: --eval-every's evaluations run, the one after the
    last step does not; the final record's test_loss and test_accuracy are
    null and final_eval says "off"; the end line says so."""
    metrics = tmp_path / "m.jsonl"
    r = ok(job(1, "--data", text_dir, *FLAGS, "--eval-every", 3, "--eval-tokens", 256, "--final-eval", "off",
               "--metrics", metrics))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [e["step"] for e in records if e.get("event") == "eval"] == [3], records
    final = records[-1]
    assert (final["test_loss"], final["test_accuracy"], final["final_eval"]) == (None, None, "off"), final
    assert "test_tokens" not in final and "val_loss" not in final, final
    assert "no final evaluation (--final-eval off)  (6 steps, " in r.stdout, r.stdout
    assert "test loss" not in r.stdout.split("step      6/6")[1], r.stdout


@pytest.mark.parametrize("schedule, micro, virtual", [("1f1b", 2, []), ("gpipe", 2, []),
                                                      ("interleaved", 4, ["--virtual-stages", 2])])
def test_a_pipeline_cut_between_embedding_and_head_equals_accumulation(job, once, text_dir, tmp_path, schedule, micro,
                                                                       virtual):
    """2 stages, the token embedding on the first and the head tied to it on
    the second (the tied tensor's gradient summed across the cut; with
    --virtual-stages 2 between the first chunk and the last): the bits of
    --accumulate-steps M on one rank, dropout on in every block."""
    flags = [*FLAGS[:1], GPT + ",dropout=0.1", *FLAGS[2:], "--eval-tokens", 512]
    r = ok(job(2, "--data", text_dir, *flags, "--pipeline-stages", 2, "--micro-batches", micro,
               "--pipeline-schedule", schedule, *virtual, "--save", tmp_path / "pipe.h5",
               "--metrics", tmp_path / "pipe.jsonl"))
    assert "Traceback" not in r.stderr
    def accumulated(out):   # one run for the schedules of the same M
        ok(job(1, "--data", text_dir, *flags, "--accumulate-steps", micro, "--save", out / "acc.h5",
               "--metrics", out / "acc.jsonl"))
        return out
    alone = once(("test_gpt_training accumulated", text_dir, micro), accumulated)
    assert same_bytes(tmp_path / "pipe.h5", alone / "acc.h5")
    # the stages' final evaluation scores the sample the one process scores (--eval-tokens: issue 54 N2)
    pipe, acc = (json.loads(path.read_text().splitlines()[-1]) for path in (tmp_path / "pipe.jsonl",
                                                                            alone / "acc.jsonl"))
    assert pipe["test_tokens"] == acc["test_tokens"] == 512
    assert pipe["test_loss"] == pytest.approx(acc["test_loss"], rel=1e-6), (pipe, acc)


def test_two_chunks_of_one_stage_using_a_tied_tensor_are_one_line(job, text_dir, tmp_path):
    """--virtual-stages 2 on 2 stages with a tied use in chunk 2, on the
    owner's stage (chunk 0's): refused before the first step. (The GPT's
    head is its last layer, on the last stage: it cannot be cut so.)"""
    model = tmp_path / "mid_tie.py"
    model.write_text(
        "from hpctrain.nn import Embedding\n"
        "from hpctrain.nn.linear import Linear\n"
        "from hpctrain.nn.losses import TokenCrossEntropy\n"
        "from hpctrain.nn.norm import LayerNorm\n\n\n"
        "def build(input_shape, vocab):\n"
        "    emb = Embedding(vocab, 4)\n"
        "    return [emb, Linear(4), Linear(vocab, bias=False).tie('W', emb, 'E', transposed=True), LayerNorm(),\n"
        "            Linear(8), Linear(vocab)], TokenCrossEntropy()\n")
    r = job(2, "--data", text_dir, "--model", f"{model}:build", *FLAGS[2:], "--pipeline-stages", 2,
            "--micro-batches", 4, "--pipeline-schedule", "interleaved", "--virtual-stages", 2,
            "--pipeline-split", "1,2,4")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "chunks 0 and 2, both on stage 0, use layer 0's tied 'E'" in r.stderr, r.stderr


def test_sync_ps_trains_the_gpt_as_the_ring_does(job, text_dir, tmp_path):
    flags = ["--data", text_dir, *FLAGS, "--optimizer", "sgd", "--lr", 0.1]
    ok(job(3, "--mode", "ps", *flags, "--save", tmp_path / "ps.h5"))
    ok(job(2, *flags, "--save", tmp_path / "ring.h5"))
    close(tmp_path / "ps.h5", tmp_path / "ring.h5", 1e-5)


def positional(spec):
    """name -> the name an hpctrain before path names gave it (layer{k}/...), an optimizer's state's too;
    the test's own (not ModelSpec.name_in_file's), so a broken reader cannot write what it reads."""
    def old(name):
        head, _, rest = name.partition("/")
        return spec.positional.get(name) or f"{head}/{spec.positional[rest]}"
    return old


def rewritten_with_positional_names(path, spec):
    """The checkpoint at `path` written again as an older hpctrain wrote it:
    positional names, no aliases."""
    from mpi4py import MPI
    from hpctrain.checkpoints.named import open_checkpoint, write_checkpoint
    old = positional(spec)
    with open_checkpoint(path) as c:
        step, attrs, small = c.step, c.attrs, {n: c.small(n) for n in c.smalls}
        tensors = {old(n): (shape, dtype, []) for n, (shape, dtype) in c.tensors.items()}
        pieces = [(old(n), tuple((0, d) for d in shape), c.read(n)) for n, (shape, _) in c.tensors.items()]
    remove_checkpoint(path)
    write_checkpoint(path.parent, step, MPI.COMM_SELF, 0, pieces, tensors, attrs, small)


def test_a_resumed_gpt_run_ends_with_the_bits_of_one_run_through(job, text_dir, tmp_path, capsys):
    """Its tensors named by their paths, the head's tie recorded; a
    checkpoint and a --save file of an older hpctrain's positional names
    (layer0/E) resume and load."""
    from hpctrain import checkpoint as checkpoint_command
    from hpctrain.checkpoints.named import open_checkpoint
    from hpctrain.checkpoints.trained import load_params
    from hpctrain.nn.gpt import gpt
    flags = ["--data", text_dir, *FLAGS[:-4], "--lr", 1e-3, "--log-every", 4]
    ck = ["--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", 4]
    # the run through writes the checkpoints the resume starts from (one job, not two)
    ok(job(2, *flags, "--steps", 8, *ck, "--save", tmp_path / "through.h5"))
    four = checkpoint_path(tmp_path / "ck", 4)
    with open_checkpoint(four) as c:
        assert c.aliases == {"head/W": ("embedding/E", True)}   # tied: written once, read transposed
        assert np.array_equal(c.read("head/W", ((0, 16), (3, 9))), c.read("embedding/E")[3:9].T)
        assert {"position/P", "blocks.1/attn.Wqkv", "adam.m/blocks.1/attn.Wqkv", "ln_f/gamma"} <= set(c.tensors)
    assert checkpoint_command.main([str(tmp_path / "ck")]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["head/W", "->", "embedding/E", "(transposed)"] in lines, lines
    remove_checkpoint(checkpoint_path(tmp_path / "ck", 8))
    r = ok(job(2, *flags, "--steps", 8, *ck, "--save", tmp_path / "resumed.h5"))
    assert "resumed from" in r.stdout, r.stdout
    assert same_bytes(tmp_path / "through.h5", tmp_path / "resumed.h5")
    # an older hpctrain's checkpoint: the same bits
    spec = gpt(2, 16, 2, 2, 16)   # the vocabulary names nothing
    remove_checkpoint(checkpoint_path(tmp_path / "ck", 8))
    rewritten_with_positional_names(four, spec)
    r = ok(job(2, *flags, "--steps", 8, *ck, "--save", tmp_path / "old.h5"))
    assert "resumed from" in r.stdout and "at step 4" in r.stdout, r.stdout
    assert same_bytes(tmp_path / "through.h5", tmp_path / "old.h5")
    # and its --save file: the same model
    import h5py
    layers = {new.split("/")[0]: was.split("/")[0] for new, was in spec.positional.items()}
    with h5py.File(tmp_path / "old.h5", "a") as f:
        for path in [g for g in f if g in layers]:
            f.move(path, layers[path])
    assert {"layer0/E", "layer4/gamma"} <= set(saved(tmp_path / "old.h5"))
    through, old = load_params(tmp_path / "through.h5"), load_params(tmp_path / "old.h5")
    assert through.model.params.tobytes() == old.model.params.tobytes()


@pytest.mark.parametrize("flags, line", [
    (["--model", "gpt:layers=2,heads=3,width=16"],
     "argument --model: --model gpt:layers=L,heads=H,width=E[,dropout=P]: the width 16 is not a multiple of the "
     "heads (3)"),
    (["--model", "gpt:layers=2,width=16"], "heads= missing"),
    (["--model", "gpt:layers=2,heads=2,width=16,depth=3"], "'depth=3' is not one of layers=, heads=, width="),
    (["--model", "gpt:layers=2,heads=2,width=16,dropout=1"], "dropout=1 is not in [0, 1)"),
    # lenet once said it "does not fit the data (256, 67 classes)" (issue 54, item 10)
    (["--model", "lenet"], "holds text: an image model cannot train on text; for text, a language model is --model "
                           "gpt:layers=L,heads=H,width=E"),
    (["--model", GPT, "--block-size", 16, "--batch-size", 20_000],
     "35,984 training windows of --block-size 16 + 1 tokens, fewer than one step takes (2 workers x --batch-size "
     "20000 = 40,000); use a smaller --block-size, --batch-size or fewer workers"),
])
def test_bad_gpt_flags_and_models_that_do_not_take_text_are_one_line(job, text_dir, flags, line):
    if flags[1].startswith("gpt:") and len(flags) == 2:
        # the parser's refusals of a gpt spec: in-process (a flag the parser refuses is one line
        # and exit 2 on the whole job the same way for every flag: tests/faults/test_bad_flags.py)
        from hpctrain.base.errors import HpctrainError
        from hpctrain.flags import cli
        with pytest.raises(HpctrainError) as refused:
            cli.parse(["--data", text_dir, "--steps", "2", *flags], quiet=True)
        assert line in str(refused.value) and "\n" not in str(refused.value)
        return
    r = job(2, "--data", text_dir, "--steps", 2, *flags)
    assert r.returncode == 2, r.stdout + r.stderr
    assert line in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("flags, lines", [
    (["--model", GPT], (f"--model {GPT} is a language model and --data ",
                        "holds images: a language model cannot train on images")),
    (["--eval-tokens", 100], ("--eval-tokens samples the held-out windows of text data (prepare --text); ",)),
])
def test_the_gpt_on_images_is_one_line(job, flags, lines):
    r = job(1, "--steps", 2, *flags)
    assert r.returncode == 2, r.stderr
    assert all(line in r.stderr for line in lines), r.stderr


def test_keep_best_keeps_the_lowest_val_loss_and_resumes_it(job, text_dir, tmp_path):
    """A language model's best is its lowest validation loss (nanoGPT's
    rule), not its next-token accuracy: at lr 0.1 the accuracy peaks first
    at step 4, the loss is lowest at step 10. A checkpoint records it and a
    resumed run keeps the file an uninterrupted run keeps."""
    import h5py
    flags = ["--data", text_dir, *FLAGS[:-6], "--lr", 0.1, "--log-every", 4, "--eval-every", 2]
    r = ok(job(2, *flags, "--steps", 12, "--keep-best", tmp_path / "through.h5"))
    losses = [float(line.split("val loss ")[1].split()[0]) for line in r.stdout.splitlines() if "val accuracy" in line]
    assert len(losses) == 6, r.stdout
    assert f"(the parameters after step {2 * (losses.index(min(losses)) + 1)}: the best val loss, " in r.stdout
    with h5py.File(tmp_path / "through.h5") as f:
        assert abs(float(f.attrs["val_loss"]) - min(losses)) < 1e-4, (dict(f.attrs), losses)
    ck = ["--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", 6, "--keep-best", tmp_path / "resumed.h5"]
    ok(job(2, *flags, "--steps", 6, *ck))
    ok(job(2, *flags, "--steps", 12, *ck))
    assert same_bytes(tmp_path / "through.h5", tmp_path / "resumed.h5")


def test_the_gpt_with_compiled_layers_says_which_run_compiled(job, text_dir, tmp_path):
    """--compiled-layers on: the start-up line names the GPT's compiled
    kernels (found inside its blocks), and it trains to the NumPy layers'
    parameters within float32 rounding."""
    pytest.importorskip("numba")
    flags = ["--data", text_dir, *FLAGS, "--optimizer", "sgd", "--lr", 0.1]
    r = ok(job(1, *flags, "--compiled-layers", "on", "--save", tmp_path / "on.h5"))
    layers = [line for line in r.stdout.splitlines() if line.startswith("layers:")]
    # "; 512-bit vectors" where the CPU has AVX-512 (hpctrain/base/vector_width.py)
    want = "layers: compiled (nn/compiled.py: attention's causal softmax, LayerNorm, GELU{})"
    assert layers in ([want.format("")], [want.format("; 512-bit vectors")]), r.stdout
    ok(job(1, *flags, "--compiled-layers", "off", "--save", tmp_path / "off.h5"))
    close(tmp_path / "on.h5", tmp_path / "off.h5", 1e-4)
