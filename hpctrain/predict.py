"""Classify images with a trained model: each input's class name and probability.

    python -m hpctrain.predict --params model.h5 cat.png dog.jpg
    python -m hpctrain.predict --checkpoint ckpt/ photos/*.png --format jsonl --out predictions.jsonl
    python -m hpctrain.predict --params model.h5 --data data/photos            # the test set's images
    hpctrain predict --params model.h5 --top 3 cat.png

The model comes from a --save file (--params) or a checkpoint (--checkpoint:
a file, or the newest valid one in a directory); both record how to rebuild
it and how its training images were prepared (trained.py), and images are
brought to its input the same way (grayscale or RGB after its channels,
EXIF orientation applied, 16-bit grayscale scaled to 0..255, resized
bilinearly to its height and width: data/images.py to_input; an image over
Pillow's decompression-bomb size is one warning line). Output: CSV (input,class,probability[,label],
with --top K the next K-1 classes and probabilities after them) or JSON
Lines, on standard output or into --out (written whole or not at all, then
one line `wrote N predictions to FILE`; an --out that is one of the inputs,
a device or FIFO, or in a folder that takes no file is refused before the
model is read: run/outputs.check_output_file). Every image is read before
anything is written: an unreadable one, a file and data that do not match
(another shape or class count; a language model, or text for an image model:
data/fit.py) is one line, exit 2. A model trained from a
user's FILE.py is rebuilt only with --model naming it (trained.py).

No MPI here: one process.
"""
import csv
import io
import json
import os
import sys

if __name__ == "__main__":   # python -m hpctrain.predict: BLAS's threads before numpy loads (command.py's ONE_PROCESS)
    from .run.cluster import one_process
    one_process()

import numpy as np

from .flags.arguments import Parser
from .flags.cli import trained_flags
from .base.errors import HpctrainError, one_line_errors
from .base.files import one_line, write_atomically
from .run.outputs import check_output_file


def softmax(logits):
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=1, keepdims=True)
    return z


def rows(model, x, names, top, labels=None):
    """One dict per input: name, class, probability (and the next top-1, and
    the true label where known), in input order."""
    probs = softmax(model.logits(x)) if len(x) else np.zeros((0, model.spec.classes))
    order = np.argsort(-probs, axis=1, kind="stable")[:, :top]
    out = []
    for i, name in enumerate(names):
        best = [(model.class_names[c], float(probs[i, c])) for c in order[i]]
        row = {"input": name, "class": best[0][0], "probability": round(best[0][1], 6)}
        if top > 1:
            row["top"] = [[c, round(p, 6)] for c, p in best]
        if labels is not None:
            row["label"] = model.class_names[int(labels[i])]
        out.append(row)
    return out


def render(table, fmt, top):
    buf = io.StringIO()
    if fmt == "jsonl":
        for row in table:
            buf.write(json.dumps(row) + "\n")
        return buf.getvalue()
    labelled = bool(table) and "label" in table[0]
    head = ["input", "class", "probability"] + (["label"] if labelled else [])
    for k in range(2, top + 1):
        head += [f"class_{k}", f"probability_{k}"]
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(head)
    for row in table:
        line = [row["input"], row["class"], f"{row['probability']:.6f}"] + ([row["label"]] if labelled else [])
        for c, p in row.get("top", [])[1:]:
            line += [c, f"{p:.6f}"]
        w.writerow(line)
    return buf.getvalue()


def inputs_from_images(model, paths):
    from .data.images import to_input
    x = np.empty((len(paths), *model.input_shape), np.uint8)
    for i, path in enumerate(paths):
        if not os.path.isfile(path):
            raise HpctrainError(f"{path}: no such file" if not os.path.exists(path) else f"{path}: not a file")
        x[i] = to_input(path, model.input_shape, model.preprocess)
    return x, list(paths)


def inputs_from_data(model, data_dir, split):
    from . import data
    manifest = model.check_data(data_dir)
    if split not in manifest:
        raise HpctrainError(f"{data_dir}: no {split} part")
    x, y = data.load_test(data_dir, raw=True, split=split)
    return x, [f"{split}:{i}" for i in range(len(y))], y


def check_model(model, args):
    """One line unless the model classifies images and can read the inputs:
    an image model given text (--data), a language model given images or
    text, in data/fit.py's words (the check every command makes)."""
    from .data.fit import check_kind
    if args.data:
        model.check_data(args.data)
    else:
        more = len(args.images) - 1
        check_kind(f"model {model.source}", model.spec.input_kind, "image",
                   args.images[0] + (f" (and {more} more)" if more else ""))
    if model.spec.input_kind == "tokens":
        raise HpctrainError(f"model {model.source} is a language model: predict classifies images (hpctrain "
                            f"generate samples text from it, hpctrain evaluate --data DIR scores it on text)")


def check_out(args):
    """--out, before the model is read: a file that can be written and is
    none of the inputs (the model's file, an image, anything under --data)."""
    from .base.overwrites import Input
    from .checkpoints.trained import model_inputs
    if args.out is not None:
        inputs = [*model_inputs(args.params, args.checkpoint, args.model),
                  *(Input(image, "an IMAGE to classify") for image in args.images),
                  Input(args.data, "the --data folder")]
        check_output_file(args.out, "--out", inputs=inputs)


def write_out(path, text):
    try:
        write_atomically(path, lambda f: f.write(text))
    except OSError as e:
        raise HpctrainError(f"--out {path}: cannot write ({one_line(e)})") from None


def build_parser(prog="python -m hpctrain.predict"):
    p = Parser(prog=prog, description="Classify images with a model trained by hpctrain: each "
                                "input's class name and probability, as CSV or JSON Lines.")
    trained_flags(p)
    p.add_argument("images", nargs="*", metavar="IMAGE", help="image files (PNG, JPEG)")
    p.add_argument("--data", metavar="DIR", help="classify a prepared directory's test set instead (its labels too)")
    p.add_argument("--split", choices=["test", "val"], default="test",
                   help="with --data: which part (default: %(default)s)")
    p.add_argument("--format", choices=["csv", "jsonl"], default="csv", help="(default: %(default)s)")
    p.add_argument("--top", type=int, default=1, metavar="K", help="the K most probable classes (default: 1)")
    p.add_argument("--out", metavar="FILE", default=None, help="write here instead of standard output")
    return p


@one_line_errors
def main(argv=None, prog="python -m hpctrain.predict"):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    from .nn import blas, threads
    from .run.cluster import threads_per_rank
    threads.configure(threads_per_rank())   # the cores this process has, as training's rank alone (pin_blas)
    blas.configure(args.blas)   # (MKL missing: one line)
    if bool(args.images) == bool(args.data):
        raise HpctrainError("give IMAGE files or --data DIR (one of them)")
    if args.top < 1:
        raise HpctrainError(f"--top must be at least 1, got {args.top}")
    check_out(args)
    from .checkpoints import trained
    model = trained.load(args.params, args.checkpoint, data_dir=args.data, model=args.model)
    check_model(model, args)
    top = min(args.top, model.spec.classes)
    if args.data:
        x, names, labels = inputs_from_data(model, args.data, args.split)
    else:
        (x, names), labels = inputs_from_images(model, args.images), None
    text = render(rows(model, x, names, top, labels), args.format, top)
    if args.out:
        write_out(args.out, text)
        print(f"wrote {len(names)} predictions to {args.out}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
