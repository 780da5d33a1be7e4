"""Text from a trained GPT: the prompt, then N sampled tokens.

    hpctrain generate --params gpt.h5 --prompt "ROMEO:" --tokens 200
    hpctrain generate --params gpt.h5 --prompt "ROMEO:" --tokens 500 --temperature 0.8 --top-k 20 --seed 7
    hpctrain generate --checkpoint ckpt/ --tokens 100 --temperature 0        # greedy
    python -m hpctrain.generate --params gpt.h5 --device gpu

The model and its vocabulary come from the --save file (or a checkpoint):
training records the vocabulary beside the parameters (checkpoints/
model_record.py), so no data directory is needed; a file that lacks it
takes it from --data DIR (the prepared text it was trained on). A --data
DIR given is held to the model as every command holds it (data/fit.py):
images, or text of another vocabulary than the record's, are one line. The prompt
is encoded with that vocabulary (a character outside a `chars` vocabulary
is one line, exit 2); an empty prompt starts from a newline, as nanoGPT's
sample.py does (token 0 where the vocabulary has no newline), and that
newline is printed. The prompt is fed once, then each token is one step
over the key/value cache (nn/decode.py; past the context length the last
--block-size tokens, the cache recomputed for them).

Sampling: the logits of the next token divided by --temperature, all but
the --top-k largest (and those equal to the k-th) set to -inf, softmax, one
draw of a NumPy Generator seeded with --seed: the same flags give the same
text, on the CPU and, up to the device's rounding of the logits, on a GPU
(the draws are made on the host, from float64 probabilities).
--temperature 0 is greedy: the largest logit, no draw. The text is printed
whole at the end (a byte or BPE vocabulary may split a character over
tokens).

No MPI here: one process.
"""
import sys

import numpy as np

from .arguments import Parser
from .arguments import nonneg_float, nonneg_int, positive_int
from .errors import HpctrainError, one_line_errors


def sample(logits, rng, temperature, top_k=None):
    """One token id from a row of logits (host floats): argmax at
    temperature 0, else a draw of rng from softmax(logits / temperature)
    over the top_k largest (None: all)."""
    logits = np.asarray(logits, np.float64)
    if temperature == 0:
        return int(np.argmax(logits))
    with np.errstate(over="ignore"):   # the maximum first: a tiny temperature overflows only to -inf, p = 0
        z = (logits - logits.max()) / temperature
    if top_k is not None and top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z)
    p /= p.sum()
    return int(rng.choice(z.size, p=p))


def generate(decoder, prompt_ids, tokens, temperature, top_k=None, seed=0, host=np.asarray):
    """The ids of `tokens` tokens sampled after prompt_ids (a list of at
    least one id): the prompt fed at once, then one token a step; host(a):
    an xp array on the host (device.to_host on a GPU)."""
    rng = np.random.default_rng(seed)
    logits = decoder.feed(np.asarray(prompt_ids, np.int64)[None])
    out = []
    for _ in range(tokens):
        out.append(sample(host(logits[0, -1]), rng, temperature, top_k))
        if len(out) < tokens:
            logits = decoder.feed([[out[-1]]])
    return out


def vocabulary(model, data_dir):
    """The model's vocabulary: its record's, else --data's."""
    from .data.vocab import from_record, load_vocabulary
    if model.spec.input_kind != "tokens":
        raise HpctrainError(f"{model.source}: model {model.spec.name} takes {model.spec.input_kind}s, not token ids: "
                            f"generate samples a language model (--model gpt:...)")
    if data_dir is not None:   # text, of the vocabulary the model records (data/fit.py)
        model.check_data(data_dir)
    vocab = from_record(model.text, model.source)
    if vocab is None and data_dir is None:
        raise HpctrainError(f"{model.source}: records no vocabulary (saved by an older hpctrain, or too large "
                            f"for its record); give --data DIR, the prepared text it was trained on")
    if vocab is None:
        vocab = load_vocabulary(data_dir)
    if vocab.vocab_size != model.spec.classes:
        raise HpctrainError(f"{model.source}: a model of {model.spec.classes} tokens, its vocabulary has "
                            f"{vocab.vocab_size}: " + ("other data" if model.text is None else "a damaged file"))
    return vocab


def prompt_ids(vocab, prompt):
    """The prompt's ids; an empty prompt: a newline (token 0 where there is none)."""
    if prompt:
        return vocab.encode(prompt).tolist()
    try:
        ids = vocab.encode("\n").tolist()
    except HpctrainError:   # a character vocabulary without a newline
        ids = []
    return ids or [0]


def on_device(model, device):
    """The model on --device's array module (a copy of its parameters on a GPU)."""
    from . import device as dev
    xp, _, _ = dev.select(device)
    if xp is np:
        return model.model, np.asarray
    return model.spec.build(xp, params=xp.asarray(model.model.params), dtype=model.model.dtype), dev.to_host


def build_parser(prog="python -m hpctrain.generate"):
    p = Parser(prog=prog, description="Sample text from a GPT trained by hpctrain (--model gpt:...).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", metavar="FILE.h5", help="a --save (or --keep-best) file")
    src.add_argument("--checkpoint", metavar="DIR|FILE", help="a checkpoint file, or the newest valid one in DIR")
    p.add_argument("--prompt", default="", help="the text to continue (default: a newline)")
    p.add_argument("--tokens", type=nonneg_int, default=200, metavar="N",
                   help="tokens to sample (default: %(default)s)")
    p.add_argument("--temperature", type=nonneg_float, default=1.0, metavar="T",
                   help="divides the logits; 0: greedy (default: %(default)s)")
    p.add_argument("--top-k", type=positive_int, default=None, metavar="K",
                   help="sample among the K most likely tokens only (default: all)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="the sampler's seed (default: %(default)s)")
    p.add_argument("--data", metavar="DIR", default=None,
                   help="the prepared text, for the vocabulary of a file that records none")
    p.add_argument("--model", metavar="NAME|FILE.py:FUNCTION", default=None,
                   help="rebuild the model with this instead of what the file records (a model trained from a "
                        "user's FILE.py is rebuilt only from the file named here)")
    p.add_argument("--device", choices=["cpu", "gpu", "auto"], default="cpu", help="(default: %(default)s)")
    return p


@one_line_errors
def main(argv=None, prog="python -m hpctrain.generate"):
    args = build_parser(prog).parse_args(argv)
    from . import trained
    from .nn.decode import Decoder
    model = trained.load(args.params, args.checkpoint, data_dir=args.data, model=args.model)
    vocab = vocabulary(model, args.data)
    ids = prompt_ids(vocab, args.prompt)
    built, host = on_device(model, args.device)
    out = generate(Decoder(built), ids, args.tokens, args.temperature, args.top_k, args.seed, host)
    sys.stdout.write(vocab.decode(ids + out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
