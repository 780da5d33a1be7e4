"""`hpctrain export`: a trained model out of hpctrain, for the tools that
serve models.

    hpctrain export --params gpt.h5 --format safetensors --to gpt.safetensors [--dtype bf16|fp16]
    hpctrain export --params ckpt/ --format hf --to gpt-hf/
    hpctrain export --params small_cnn.h5 --format onnx --to small_cnn.onnx [--opset 18]
    python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('gpt-hf')"

--params: a --save (or --keep-best) file, a checkpoint folder at any
layout it was written in, or a --checkpoint-dir (its newest valid
checkpoint), read as generate and evaluate read them (checkpoints/trained.py).

- `safetensors`: every tensor by hpctrain's name (docs/models.md), the
  model's record (architecture, vocabulary: checkpoints/model_record.py) as
  the header's `inference` metadata: what `train --init-from`, `generate`
  and `evaluate` read back;
- `hf`: a folder `transformers.AutoModelForCausalLM.from_pretrained` loads
  as a GPT2LMHeadModel (config.json, model.safetensors in GPT-2's names:
  interop/gpt2.py) and `AutoTokenizer.from_pretrained` reads the
  vocabulary from (tokenizer.json, tokenizer_config.json), ids hpctrain's;
- `onnx`: one graph onnxruntime runs, images (or token ids) in, logits out
  (interop/onnx_export.py), for the zoo's models and the GPT.

The output must not exist yet and may not touch the input
(base/overwrites.py); it is written whole or not at all.

    python -m pytest -q tests/test_interop_hf.py tests/test_safetensors.py tests/test_onnx_export.py
"""
import json
import os
import shutil

from ..base.errors import HpctrainError, one_line_errors
from ..base.files import create_new, one_line, temp_name_next_to
from ..flags.arguments import Parser
from . import gpt2, safetensors

FORMATS = ("safetensors", "hf", "onnx")


def build_parser(prog="python -m hpctrain.interop.export"):
    p = Parser(prog=prog, description="Write a model trained by hpctrain as safetensors, as a Hugging Face "
                                      "GPT-2 folder, or as an ONNX graph.")
    p.add_argument("--params", required=True, metavar="FILE.h5|CKPT_DIR",
                   help="a --save (or --keep-best) file, a checkpoint, or a --checkpoint-dir (its newest)")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="safetensors: hpctrain's names and record; hf: a GPT2LMHeadModel folder with its tokenizer; "
                        "onnx: a graph for onnxruntime (float32)")
    p.add_argument("--to", required=True, metavar="PATH", help="the file (safetensors) or folder (hf) to write; "
                                                               "must not exist")
    p.add_argument("--dtype", choices=tuple(safetensors.WRITTEN), default="fp32",
                   help="the tensors' type in the file (default: %(default)s; onnx: fp32 only)")
    p.add_argument("--opset", type=int, default=17, help="onnx: the ONNX opset (default: %(default)s)")
    return p


def load(params):
    """The model in --params (checkpoints/trained.load): a file, or a checkpoint folder."""
    from ..checkpoints import trained
    if os.path.isdir(params) and not os.path.isfile(os.path.join(params, gpt2.CONFIG)):
        return trained.load(checkpoint=params)
    return trained.load(params=params)


def check_output(to, params, folder):
    """--to: new, in a folder that exists, touching no input; else one line."""
    from ..base.overwrites import Input, Output, check_not_inputs
    what = "the --params folder" if os.path.isdir(params) else "the --params file"
    check_not_inputs([Output(to, "--to", folder=folder)], [Input(params, what)])
    if os.path.lexists(to):
        raise HpctrainError(f"--to {to}: exists; name a new {'folder' if folder else 'file'} (export replaces nothing)")
    parent = os.path.dirname(os.path.abspath(to))
    if not os.path.isdir(parent):
        raise HpctrainError(f"--to {to}: no such directory {parent}")


def metadata(model):
    """The header's strings: the model's record (what rebuilding it needs), and
    transformers' `format` (it refuses a file without one)."""
    return {"format": "pt", "inference": json.dumps(model.record)}


def tensors(model, rename=None):
    """[(name, values)] of the model's parameters and state, in its spec's order; rename: name -> the file's."""
    built = dict(model.model.tensors() + model.model.state_tensors())
    names = [name for name, _, _, _ in model.spec.tensors + model.spec.state]
    return [(rename[n] if rename else n, built[n]) for n in names]


def write_hf(model, to, dtype):
    """The Hugging Face folder of a GPT (module docstring), made beside `to` and renamed into place."""
    names = gpt2.names(model.spec)   # one line for a model that is not a GPT, before anything is written
    if model.text is None:
        raise HpctrainError(f"{model.source}: records no vocabulary (saved by an older hpctrain): export it as "
                            f"safetensors, or save it again from a run on its data")
    from ..data.vocab import from_record
    vocab = from_record(model.text, model.source)
    tmp = temp_name_next_to(to)
    try:
        os.mkdir(tmp)
        _write_json(os.path.join(tmp, gpt2.CONFIG), gpt2.config_of(model.spec))
        safetensors.write(os.path.join(tmp, gpt2.WEIGHTS), tensors(model, names), metadata(model), dtype)
        with os.fdopen(create_new(os.path.join(tmp, gpt2.TOKENIZER)), "w", encoding="utf-8") as f:
            f.write(gpt2.tokenizer_json(vocab))
        _write_json(os.path.join(tmp, gpt2.TOKENIZER_CONFIG), gpt2.tokenizer_config(model.spec.input_shape[0]))
        os.rename(tmp, to)
    except BaseException:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_json(path, value):
    with os.fdopen(create_new(path), "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
        f.write("\n")


@one_line_errors
def main(argv=None, prog="python -m hpctrain.interop.export"):
    args = build_parser(prog).parse_args(argv)
    folder = args.format == "hf"
    if args.format == "onnx" and args.dtype != "fp32":
        raise HpctrainError(f"--dtype {args.dtype}: the onnx export writes float32 (give --dtype fp32 or leave it out)")
    check_output(args.to, args.params, folder)
    model = load(args.params)
    try:
        if folder:
            write_hf(model, args.to, args.dtype)
        elif args.format == "onnx":
            from .onnx_export import write_onnx
            write_onnx(model, args.to, opset=args.opset)
        else:
            safetensors.write(args.to, tensors(model), metadata(model), args.dtype)
    except OSError as e:
        raise HpctrainError(f"--to {args.to}: cannot write it ({one_line(e)})") from None
    print(f"wrote {model.spec.name} ({model.spec.num_params:,} parameters, {args.dtype}) from {model.source} "
          f"to {args.to} ({args.format})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
