"""A trained model on a prepared test set: accuracy, loss, per-class accuracy
and the confusion matrix (a PNG with --plot); for a language model (a GPT
on text prepared with `prepare --text`), the per-token loss and perplexity.

    python -m hpctrain.evaluate --params model.h5 --data data/photos
    python -m hpctrain.evaluate --checkpoint ckpt/ --data data/photos --plot confusion.png
    python -m hpctrain.evaluate --params model.h5 --data data/photos --json     # one JSON object
    hpctrain evaluate --params model.h5 --data data/photos --split val

The loss and accuracy are computed as the training run's final evaluation
computes them (the whole split through Sequential.evaluate, sums of 128
images at a time run forward --batch-size at a time, the chief's way: report.Report.evaluate_alone), so for the --save file
of a run `accuracy` and `loss` are the final record's `test_accuracy` and
`test_loss` (with --split val, `val_accuracy` and `val_loss`), to the
digits it records (bit for bit where that run had one worker; with more, each
worker summed its own part, and the loss may differ in the 7th digit). A
model file and data that do not match (another image shape or class count,
other class names; text for an image model or images for a language model;
text of another vocabulary than the one the model was trained on, even of
the same size: data/fit.py) is one line, exit 2; so is a --plot that is one of the
inputs (the model's file, anything in --data), a device or FIFO, or in a
folder that takes no file, refused before the model is read. The picture
written adds a line that names it.

A language model reads the held-out text as training's final evaluation
does (data/tokens.py load_test_windows: consecutive windows of its
--block-size, from the record's input shape, each token predicted once;
past --eval-tokens N, training's default cap too, the same evenly spaced
sample of N tokens' windows a run's evaluations take):
`loss` is the mean per-token cross-entropy in nats, the final record's
`test_loss` (where the run had the same --eval-tokens), and `perplexity`
is exp(loss); `num_tokens` the tokens scored, `held_out_tokens` all the
windows'; --plot does not apply.

No MPI here: one process.
"""
import json
import math
import sys

if __name__ == "__main__":   # python -m hpctrain.evaluate: BLAS's threads before numpy loads (command.py's ONE_PROCESS)
    from .run.cluster import one_process
    one_process()

import numpy as np

from .flags.arguments import Parser, positive_int
from .flags.cli import DEFAULT_BATCH_SIZE, DEFAULT_EVAL_TOKENS, eval_tokens, trained_flags
from .base.errors import HpctrainError, one_line_errors
from .base.files import printable
from .nn.sequential import eval_forward
from .run.outputs import check_output_file


def evaluate(model, x, y, batch_size=DEFAULT_BATCH_SIZE):
    """{accuracy, loss, num_samples, per_class_accuracy, confusion, ...}: the
    loss and accuracy from the model's loss's sums (Sequential.evaluate:
    the loss per item it counts), the rest from the same logits; run
    forward as a training step of `batch_size` would (eval_forward)."""
    forward = eval_forward(model.spec, batch_size)
    sums = model.model.evaluate(x, y, forward=forward)
    loss_sum, correct = sums["loss"], sums["correct"]
    n = max(len(y), 1)
    k = model.spec.classes
    predicted = model.logits(x, forward).argmax(axis=1)
    confusion = np.zeros((k, k), np.int64)
    np.add.at(confusion, (y, predicted), 1)
    counts = confusion.sum(axis=1)
    per_class = {name: (round(float(confusion[c, c] / counts[c]), 6) if counts[c] else None)
                 for c, name in enumerate(model.class_names)}
    return {"accuracy": round(correct / n, 6), "loss": round(loss_sum / max(sums["count"], 1), 6), "num_samples": len(y),
            "class_names": model.class_names, "per_class_accuracy": per_class,
            "per_class_count": {name: int(counts[c]) for c, name in enumerate(model.class_names)},
            "confusion": confusion.tolist(), "step": model.step, "source": model.source}


def evaluate_text(model, data_dir, manifest, split, eval_tokens=None, batch_size=DEFAULT_BATCH_SIZE):
    """{loss, perplexity, accuracy, num_tokens, ...} of a language model on
    a split of prepared text, windows of its block size."""
    from . import data
    model.check_data(data_dir)   # text, and the vocabulary the model was trained on (data/fit.py)
    block_size = model.input_shape[0]
    x, y = data.load_test_windows(data_dir, block_size, split=split, eval_tokens=eval_tokens)
    sums = model.model.evaluate(x, y, forward=eval_forward(model.spec, batch_size))
    count = max(sums["count"], 1)
    loss = sums["loss"] / count
    from .data.splits import held_out_tokens
    return {"loss": round(loss, 6), "perplexity": round(math.exp(loss), 6),
            "accuracy": round(sums["correct"] / count, 6), "num_tokens": sums["count"],
            "held_out_tokens": held_out_tokens(manifest, block_size, split=split),
            "block_size": block_size, "step": model.step, "source": model.source}


def text_line(result, split):
    return (f"{split} loss {result['loss']:.4f} per token  perplexity {result['perplexity']:.4f}  {split} accuracy "
            f"{result['accuracy']:.4f}  (on {result['num_tokens']:,} of {result['held_out_tokens']:,} held-out tokens"
            f"{', an evenly spaced sample (--eval-tokens)' if result['num_tokens'] < result['held_out_tokens'] else ''}"
            f" in windows of {result['block_size']}; "
            f"{result['source']}, step {result['step']})")


def lines(result, split):
    # control characters escaped: a class named with a newline stays on its row
    names = [printable(n) for n in result["class_names"]]
    width = max(8, *(len(n) for n in names))
    out = [f"{split} accuracy {result['accuracy']:.4f}  {split} loss {result['loss']:.4f}  "
           f"({result['num_samples']} images; {result['source']}, step {result['step']})",
           "", f"{'class':<{width}}  accuracy  images"]
    for key, name in zip(result["class_names"], names):
        acc = result["per_class_accuracy"][key]
        out.append(f"{name:<{width}}  {'-' if acc is None else f'{acc:.4f}':>8}  {result['per_class_count'][key]:>6}")
    out += ["", "confusion matrix (rows: true class, columns: predicted class)"]
    cell = max(5, len(str(max(max(r) for r in result["confusion"]))) + 1)
    out.append(" " * width + "".join(f"{str(i):>{cell}}" for i in range(len(names))))
    for i, (name, row) in enumerate(zip(names, result["confusion"])):
        out.append(f"{name:<{width}}" + "".join(f"{v:>{cell}}" for v in row) + f"   ({i})")
    return out


def plot_confusion(result, path, title):
    """The confusion matrix as a PNG, each row normalised to the true class's count."""
    from . import plot
    confusion = np.asarray(result["confusion"], float)
    rates = confusion / np.maximum(confusion.sum(axis=1, keepdims=True), 1)
    k = len(rates)
    side = min(14, 3 + 0.45 * k)
    fig, axes = plot._figure((side + 1.5, side), left=0.22, bottom=0.2, right=0.95, top=0.9)
    ax = axes[0][0]
    image = ax.imshow(rates, cmap="Blues", vmin=0, vmax=1)
    names = result["class_names"]
    ax.set_xticks(range(k), names, rotation=90 if k > 6 else 0)
    ax.set_yticks(range(k), names)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(title)
    if k <= 20:
        for i in range(k):
            for j in range(k):
                if confusion[i, j]:
                    ax.text(j, i, int(confusion[i, j]), ha="center", va="center", fontsize=8,
                            color="white" if rates[i, j] > 0.5 else "black")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    plot._save(fig, path)
    return rates


def build_parser(prog="python -m hpctrain.evaluate"):
    p = Parser(prog=prog, description="Accuracy, loss, per-class accuracy and the confusion "
                                "matrix of a model trained by hpctrain, on a prepared data directory.")
    trained_flags(p, pretrained=True)
    p.add_argument("--data", metavar="DIR", required=True, help="a prepared shard directory")
    p.add_argument("--split", choices=["test", "val"], default="test", help="(default: %(default)s)")
    p.add_argument("--eval-tokens", type=eval_tokens, default=None, metavar="N|all",
                   help="a language model: score N held-out tokens, the evenly spaced sample of windows training's "
                        "evaluations take with --eval-tokens N; all: every window (default: "
                        f"{DEFAULT_EVAL_TOKENS:,}, training's default)")
    p.add_argument("--batch-size", type=positive_int, default=DEFAULT_BATCH_SIZE, metavar="N",
                   help="samples run forward at once, as a training step of --batch-size N: no more activation "
                        "memory than that step (the result's bits do not depend on it; default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="also draw the confusion matrix")
    return p


@one_line_errors
def main(argv=None, prog="python -m hpctrain.evaluate"):
    args = build_parser(prog).parse_args(argv)
    from . import data
    from .checkpoints import trained
    from .interop import pretrained
    from .nn import blas, threads
    from .run.cluster import threads_per_rank
    threads.configure(threads_per_rank())   # the cores this process has, as training's rank alone (pin_blas)
    blas.configure(args.blas)   # (MKL missing: one line)
    if args.plot:
        from . import plot
        plot.require()
        from .base.overwrites import Input
        inputs = [*trained.model_inputs(args.params, args.checkpoint, args.model),
                  Input(args.data, "the --data folder")]
        check_output_file(args.plot, "--plot", inputs=inputs)
    # a Hugging Face folder or .safetensors file too (interop/pretrained.py), else trained.load's files
    model = pretrained.load(args.params, args.checkpoint, data_dir=args.data, model=args.model)
    # A model meeting the other kind of data, or a language model another
    # vocabulary, is one line here, whatever the command (data/fit.py).
    manifest = model.check_data(args.data)
    if model.spec.input_kind == "tokens":
        return _text(model, args)
    if args.eval_tokens is not None:
        raise HpctrainError("--eval-tokens samples a language model's held-out windows; a classifier's test set "
                            "is evaluated whole")
    if args.split not in manifest:
        raise HpctrainError(f"{args.data}: no {args.split} part (prepare --val-fraction F holds one out)")
    x, y = data.load_test(args.data, raw=True, split=args.split)
    result = dict(evaluate(model, x, y, args.batch_size), split=args.split)
    if args.plot:
        plot_confusion(result, args.plot, f"{args.data} ({args.split}): accuracy {result['accuracy']:.4f}")
    if args.json:
        print(json.dumps(result))
    else:
        print("\n".join(lines(result, args.split)))
    if args.plot:   # after the table; beside --json's one object, on standard error
        print(f"wrote the confusion matrix to {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _text(model, args):
    from . import data
    if args.plot:
        raise HpctrainError("--plot draws a classifier's confusion matrix; a language model has none")
    manifest = data.load_manifest(args.data)
    if args.split not in manifest:
        raise HpctrainError(f"{args.data}: no {args.split} part (prepare --val-fraction F holds one out)")
    cap = None if args.eval_tokens == 0 else args.eval_tokens or DEFAULT_EVAL_TOKENS
    result = dict(evaluate_text(model, args.data, manifest, args.split, eval_tokens=cap, batch_size=args.batch_size),
                  split=args.split)
    print(json.dumps(result) if args.json else text_line(result, args.split))
    return 0


if __name__ == "__main__":
    sys.exit(main())
