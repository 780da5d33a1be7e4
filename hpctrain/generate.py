"""Text from a trained GPT: the prompt, then N sampled tokens.

    hpctrain generate --params gpt.h5 --prompt "ROMEO:" --tokens 200
    hpctrain generate --params gpt.h5 --prompt "ROMEO:" --tokens 500 --temperature 0.8 --top-k 20 --seed 7
    hpctrain generate --checkpoint ckpt/ --tokens 100 --temperature 0        # greedy
    hpctrain generate --params gpt.h5 --prompt-file p.txt --max-new-tokens 300 --top-p 0.9 --num-samples 3
    hpctrain generate --params gpt.h5 --prompt "ROMEO:" --stop "JULIET:" --stream off > out.txt
    python -m hpctrain.generate --params gpt.h5 --device gpu

The model and its vocabulary come from the --save file (or a checkpoint):
training records the vocabulary beside the parameters (checkpoints/
model_record.py), so no data directory is needed; a file that lacks it
takes it from --data DIR (the prepared text it was trained on). A --data
DIR given is held to the model as every command holds it (data/fit.py):
images, or text of another vocabulary than the record's, are one line. The prompt
(--prompt, or --prompt-file FILE) is encoded with that vocabulary (a
character outside a `chars` vocabulary is one line, exit 2). A `bytes`
vocabulary takes a prompt's bytes as they are, UTF-8 or not (a byte the
shell passes that is not UTF-8 reaches sys.argv as a surrogate escape:
os.fsencode gives it back); `chars` and `bpe:N` refuse such a byte in one
line naming it. An empty prompt starts from a newline, as nanoGPT's
sample.py does (token 0 where the vocabulary has no newline), and that
newline is printed. The prompt is fed once, then each token is one step
over the key/value cache (nn/decode.py; past the context length the last
--block-size tokens, the cache recomputed for them).

Sampling: the logits of the next token divided by --temperature, all but
the --top-k largest (and those equal to the k-th) set to -inf, softmax,
then --top-p P (nucleus sampling, as Hugging Face's TopPLogitsWarper):
the fewest most likely tokens whose probabilities sum to at least P kept,
the rest 0, renormalised; one draw of a NumPy Generator seeded with
--seed: the same flags give the same text, on the CPU and, up to the
device's rounding of the logits, on a GPU (the draws are made on the
host, from float64 probabilities). --temperature 0 is greedy: the largest
logit, no draw. --num-samples N: N texts from the same prompt, one after
the other from the one Generator (as nanoGPT's sample.py), so the first is
the text of --num-samples 1; a line of dashes between them.
--stop STR (repeatable; Hugging Face's stop_strings): a sample ends once
its generated text (not the prompt) contains STR, printed up to and
including it.

Output: streamed, each token's text written and flushed as it is sampled;
a byte or BPE vocabulary may split a character over tokens, so the bytes
of an unfinished UTF-8 character are held until it is whole (incremental
decoding: what is printed never changes). --stream off prints all at the
end (for a file).

BLAS's threads are training's for a rank alone on the node (run/cluster.py
one_process, set before numpy loads): OpenBLAS's default made 300
characters take 40-67 s on a busy 2-core machine.

No MPI here: one process.
"""
import argparse
import os
import sys

if __name__ == "__main__":   # python -m hpctrain.generate: BLAS's threads before numpy loads (command.py's ONE_PROCESS)
    from .run.cluster import one_process
    one_process()

import numpy as np

from .flags.arguments import Parser
from .flags.arguments import finite_float, nonneg_float, nonneg_int, positive_int
from .flags.cli import trained_flags
from .base.errors import HpctrainError, one_line_errors


def sample(logits, rng, temperature, top_k=None, top_p=1.0):
    """One token id from a row of logits (host floats): argmax at
    temperature 0, else a draw of rng from softmax(logits / temperature)
    over the top_k largest (None: all), then over the nucleus of top_p
    (1: all)."""
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
    if top_p < 1:
        # The most likely first (a stable sort: ties keep their id order, the
        # same nucleus every run); a token is kept while the mass before it
        # is short of top_p, so the most likely one always is.
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        p[order[before >= top_p]] = 0
        p /= p.sum()
    return int(rng.choice(z.size, p=p))


def sampled(decoder, prompt_ids, tokens, temperature, top_k=None, rng=None, host=np.asarray, top_p=1.0):
    """Up to `tokens` token ids sampled after prompt_ids (a list of at least
    one id), one at a time as they are drawn: the prompt fed at once, then
    one token a step (none after the last, nor after the caller stops
    asking); host(a): an xp array on the host (device.to_host on a GPU)."""
    logits = decoder.feed(np.asarray(prompt_ids, np.int64)[None])
    for i in range(tokens):
        token = sample(host(logits[0, -1]), rng, temperature, top_k, top_p)
        yield token
        if i + 1 < tokens:
            logits = decoder.feed([[token]])


def generate(decoder, prompt_ids, tokens, temperature, top_k=None, seed=0, host=np.asarray, top_p=1.0):
    """The ids of `tokens` tokens sampled after prompt_ids, drawn by a
    Generator seeded with `seed`."""
    return list(sampled(decoder, prompt_ids, tokens, temperature, top_k, np.random.default_rng(seed), host, top_p))


class TextOut:
    """A sample's text written as its tokens come (write(id)), whole
    characters only: the text of the ids not yet written is decoded again
    with each new id and held while it ends in U+FFFD, an unfinished UTF-8
    character of a bytes or BPE vocabulary (UTF-8 resynchronises, so text
    once written never changes; a byte that is no UTF-8 at all comes out as
    U+FFFD with the next whole character, or at the end). `stop`: strings
    that end the sample once its text contains one (done is then True, the
    text written up to and including it). Each piece is flushed where
    `flush` (streaming)."""

    def __init__(self, vocab, out, stop=(), flush=True):
        self.vocab, self.out, self.stop, self.flush = vocab, out, list(stop), flush
        self.pending, self.text, self.done = [], "", False

    def say(self, text):
        """Text not sampled (the prompt, a line between samples): written
        as it is, never a stop."""
        self._out(text)

    def write(self, token):
        self.pending.append(token)
        piece = self.vocab.decode(self.pending)
        if not piece.endswith("\ufffd"):
            self._emit(piece)

    def close(self):
        if self.pending and not self.done:
            self._emit(self.vocab.decode(self.pending))

    def _emit(self, piece):
        self.pending = []
        text = self.text + piece
        # A stop string that ends in this piece starts at most len(stop) - 1 characters before it.
        ends = [i + len(s) for s in self.stop
                for i in [text.find(s, max(0, len(self.text) - len(s) + 1))] if i >= 0]
        if ends:
            piece, self.done = piece[:min(ends) - len(self.text)], True
        self.text += piece
        self._out(piece)

    def _out(self, text):
        self.out.write(text)
        if self.flush:
            self.out.flush()


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


def prompt_text(vocab, prompt, prompt_file):
    """The prompt as the vocabulary takes it: bytes for a `bytes` vocabulary
    (--prompt's surrogate escapes turned back into the bytes the shell
    passed, --prompt-file's bytes as they are), else text, a byte that is
    not UTF-8 refused in one line naming it."""
    if prompt_file is not None:
        try:
            with open(prompt_file, "rb") as f:
                data = f.read()
        except OSError as e:
            raise HpctrainError(f"--prompt-file {prompt_file}: {e.strerror or e}") from None
        where = f"--prompt-file {prompt_file}"
    else:
        if vocab.kind == "bytes":
            return os.fsencode(prompt)
        try:
            prompt.encode("utf-8")
            return prompt
        except UnicodeEncodeError:   # a surrogate escape: a byte that is not UTF-8
            data, where = os.fsencode(prompt), "--prompt"
    if vocab.kind == "bytes":
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HpctrainError(f"{where}: byte 0x{data[e.start]:02x} at offset {e.start} is not UTF-8; a "
                            f"{vocab.kind} vocabulary takes UTF-8 text (a model trained with --text bytes "
                            f"takes any bytes)") from None


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
    from .base import device as dev
    xp, _, _ = dev.select(device)
    if xp is np:
        return model.model, np.asarray
    return model.spec.build(xp, params=xp.asarray(model.model.params), dtype=model.model.dtype), dev.to_host


def build_parser(prog="python -m hpctrain.generate"):
    p = Parser(prog=prog, description="Sample text from a GPT trained by hpctrain (--model gpt:...).")
    trained_flags(p, pretrained=True, products=False)
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="", help="the text to continue (default: a newline)")
    prompt.add_argument("--prompt-file", metavar="FILE", default=None,
                        help="the prompt from FILE (UTF-8; any bytes for a bytes vocabulary)")
    p.add_argument("--tokens", "--max-new-tokens", type=nonneg_int, default=200, metavar="N",
                   help="tokens to sample (default: %(default)s)")
    p.add_argument("--num-samples", type=positive_int, default=1, metavar="N",
                   help="texts to sample from the prompt, one after another (default: %(default)s)")
    p.add_argument("--temperature", type=nonneg_float, default=1.0, metavar="T",
                   help="divides the logits; 0: greedy (default: %(default)s)")
    p.add_argument("--top-k", type=positive_int, default=None, metavar="K",
                   help="sample among the K most likely tokens only (default: all)")
    p.add_argument("--top-p", type=probability, default=1.0, metavar="P",
                   help="nucleus sampling: among the fewest most likely tokens whose probabilities sum to "
                        "at least P, in (0, 1] (default: %(default)s, all)")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="end a sample once its generated text contains STR, printed up to it (repeatable)")
    p.add_argument("--stream", choices=["on", "off"], default="on",
                   help="print each token as it is sampled; off: all at the end, e.g. into a file "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="the sampler's seed (default: %(default)s)")
    p.add_argument("--data", metavar="DIR", default=None,
                   help="the prepared text, for the vocabulary of a file that records none")
    p.add_argument("--device", choices=["cpu", "gpu", "auto"], default="cpu", help="(default: %(default)s)")
    return p


@one_line_errors
def main(argv=None, prog="python -m hpctrain.generate"):
    args = build_parser(prog).parse_args(argv)
    from .interop import pretrained
    from .nn.decode import Decoder
    from .nn import threads
    from .run.cluster import threads_per_rank
    if "" in args.stop:
        raise HpctrainError("argument --stop: an empty string would end every sample before its first token")
    # a Hugging Face folder or .safetensors file too (interop/pretrained.py), else trained.load's files
    model = pretrained.load(args.params, args.checkpoint, data_dir=args.data, model=args.model)
    vocab = vocabulary(model, args.data)
    ids = prompt_ids(vocab, prompt_text(vocab, args.prompt, args.prompt_file))
    built, host = on_device(model, args.device)
    threads.configure(threads_per_rank())   # the cores this process has, as training's rank alone (pin_blas)
    stream = args.stream == "on"
    rng = np.random.default_rng(args.seed)
    texts = []
    for n in range(args.num_samples):
        out = TextOut(vocab, sys.stdout if stream else _Kept(texts), args.stop, flush=stream)
        if n:
            out.say("-" * 15 + "\n")   # nanoGPT's line between samples
        out.say(vocab.decode(ids))
        for token in sampled(Decoder(built), ids, args.tokens, args.temperature, args.top_k, rng, host, args.top_p):
            out.write(token)
            if out.done:
                break
        out.close()
        out.say("\n")
    if not stream:
        sys.stdout.write("".join(texts))
    return 0


class _Kept:
    """--stream off: the pieces kept in a list, written at the end."""

    def __init__(self, pieces):
        self.pieces = pieces

    def write(self, text):
        self.pieces.append(text)

    def flush(self):
        pass


def probability(text):
    """--top-p: a probability in (0, 1]."""
    value = finite_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


if __name__ == "__main__":
    sys.exit(main())
