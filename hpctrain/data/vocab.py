"""The vocabularies of `prepare --text`: what turns text into token ids and
back, the same for training, evaluation and generation.

    chars   the sorted set of the corpus's characters; id i is the i-th
            (the manifest's "vocabulary" lists them)
    bytes   the 256 byte values; id b is byte b (any bytes, UTF-8 or not)
    bpe:N   a byte-level BPE of N tokens (GPT-2's pre-tokenization) trained
            on the corpus with Hugging Face `tokenizers`, offline, saved as
            tokenizer.json beside the shards
    tokenizer:PATH
            a Hugging Face tokenizer.json (or a folder holding one: GPT-2's
            byte-level BPE, any `tokenizers` model) as it is: ids are its
            `Tokenizer.from_file(PATH).encode(text).ids`, its size (added
            tokens counted) the vocabulary's; kept as bpe:N's is (a copy as
            tokenizer.json beside the shards, recorded as kind "bpe"), so
            what reads a bpe:N vocabulary reads it (load_tokenizer)

    from hpctrain.data.vocab import load_vocabulary
    vocab = load_vocabulary("data/shakespeare-chars")
    ids = vocab.encode("To be, or not to be")      # int64 ids
    vocab.decode(ids)                               # the text again

Every vocabulary round-trips: decode(encode(text)) == text for any text
it was trained on (chars: of its characters; bytes and bpe: any UTF-8; a
given tokenizer as its own decoder does: GPT-2's round-trips).
A trained model carries its vocabulary (`record_entry()`, read back by
`from_record`: the characters, or the BPE's tokenizer.json compressed),
so generation needs no data directory (checkpoints/model_record.py);
`same(a, b)` compares two whole vocabularies (ids and their strings, not
just their size) and `describe` names one in a line, "chars:65 (digest
...)": data/fit.py holds a model's against its data's.
No MPI here (house rule).
"""

import base64
import hashlib
import json
import zlib
from pathlib import Path

import numpy as np

from hpctrain.base.errors import HpctrainError

from .manifest import MANIFEST, MAX_VOCAB, TEXT_KINDS, _sha256, load_manifest

TOKENIZER = "tokenizer.json"   # a BPE's file in the data directory
BYTE_ALPHABET = 256            # a byte-level BPE starts from the 256 byte symbols
EOT = "<|endoftext|>"          # GPT-2's end of a document (--eot)


def parse_text(spec):
    """("chars" | "bytes" | "bpe" | "tokenizer", N, a path or None) of a --text value."""
    kind, _, size = str(spec).partition(":")
    if kind == "tokenizer":
        if not size:
            raise HpctrainError(f"--text tokenizer:PATH needs the path of a tokenizer.json or of a folder holding one, "
                                f"got {spec!r}")
        return kind, size
    if kind not in TEXT_KINDS or (kind == "bpe") != bool(size):
        raise HpctrainError(f"--text must be chars, bytes, bpe:N (N tokens) or tokenizer:PATH, got {spec!r}")
    if kind != "bpe":
        return kind, None
    try:
        n = int(size)
    except ValueError:
        raise HpctrainError(f"--text bpe:N needs a whole number of tokens, got {spec!r}") from None
    if not BYTE_ALPHABET <= n <= MAX_VOCAB:
        raise HpctrainError(f"--text bpe:{n}: N must be in {BYTE_ALPHABET}..{MAX_VOCAB} (the 256 bytes "
                            f"at least; token ids are stored as uint32 at most)")
    return kind, n


class Chars:
    """Id i is vocabulary[i]; text with a character outside it is refused."""
    kind = "chars"

    def __init__(self, vocabulary):
        self.vocabulary = list(vocabulary)
        self.vocab_size = len(self.vocabulary)
        # code points in vocabulary order (sorted, as train makes it): encoding is a search
        self._points = np.array([ord(c) for c in self.vocabulary], np.int64)

    @classmethod
    def train(cls, text):
        return cls(sorted(set(text)))   # Unicode's code points are fewer than uint32's ids

    def encode(self, text):
        points = np.frombuffer(text.encode("utf-32-le"), np.uint32).astype(np.int64)
        ids = np.minimum(np.searchsorted(self._points, points), self.vocab_size - 1)
        unknown = np.flatnonzero(self._points[ids] != points)
        if len(unknown):
            raise HpctrainError(f"the character {text[unknown[0]]!r} is not in this {self.vocab_size}-character "
                                f"vocabulary")
        return ids

    def decode(self, ids):
        return "".join(self.vocabulary[i] for i in np.asarray(ids).tolist())

    def manifest_entry(self):
        return {"vocabulary": self.vocabulary}

    def record_entry(self):
        return {"kind": self.kind, "vocabulary": "".join(self.vocabulary)}

    def content(self):
        return "".join(self.vocabulary)


class Bytes:
    """Id b is byte b. Text is encoded as UTF-8; decode replaces what is not
    UTF-8 (a sampled sequence may end mid-character)."""
    kind = "bytes"
    vocab_size = 256

    def encode(self, text):
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, np.uint8).astype(np.int64)

    def decode(self, ids):
        return np.asarray(ids, np.uint8).tobytes().decode("utf-8", errors="replace")

    def manifest_entry(self):
        return {}

    def record_entry(self):
        return {"kind": self.kind}

    def content(self):
        return ""


def _tokenizers():
    # Imported only for a BPE: every rank imports hpctrain.data, few need this.
    try:
        import tokenizers
    except ImportError:
        raise HpctrainError("--text bpe:N and tokenizer:PATH need Hugging Face tokenizers: pip install tokenizers") \
            from None
    return tokenizers


class Bpe:
    """A tokenizers.Tokenizer: one trained here (a byte-level BPE, GPT-2's
    pre-tokenization, no prefix space, no special tokens, so
    decode(encode(text)) == text) or a user's (load_tokenizer)."""
    kind = "bpe"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def train(cls, text, size, special=()):
        """special: tokens added whole (--eot's EOT), ids before the merges'."""
        tk = _tokenizers()
        tokenizer = tk.Tokenizer(tk.models.BPE())
        tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(vocab_size=size, show_progress=False,
                                         initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                         special_tokens=list(special))
        tokenizer.train_from_iterator([text], trainer=trainer)
        return cls(tokenizer)

    @classmethod
    def load(cls, path):
        tk = _tokenizers()
        try:
            return cls(tk.Tokenizer.from_file(str(path)))
        except Exception as e:   # tokenizers raises plain Exceptions for a bad file
            raise HpctrainError(f"{path}: not a tokenizers JSON file ({e}); prepare again with --force") from None

    def encode(self, text):
        return np.asarray(self.tokenizer.encode(text).ids, np.int64)

    def decode(self, ids):
        return self.tokenizer.decode(np.asarray(ids).tolist())

    def save(self, path):
        self.tokenizer.save(str(path))

    def manifest_entry(self):
        return {}

    def record_entry(self):
        # zlib and base64: half the JSON's size in the record (checkpoints/model_record.py)
        packed = base64.b64encode(zlib.compress(self.tokenizer.to_str().encode(), 9)).decode()
        return {"kind": self.kind, "tokenizer_zlib": packed}

    def content(self):
        # The tokenizer's JSON with its keys sorted: the same whether it was
        # read from the data's tokenizer.json (written pretty-printed) or
        # rebuilt from a model's record (compact); the merges keep their order.
        return json.dumps(json.loads(self.tokenizer.to_str()), sort_keys=True)

    @classmethod
    def from_str(cls, text):
        tk = _tokenizers()
        return cls(tk.Tokenizer.from_str(text))


def same(a, b):
    """Whether two vocabularies give every id the same string: their whole
    content compared, not their size (a `bytes` and a `bpe:256` vocabulary
    both have 256 ids)."""
    return a.kind == b.kind and a.content() == b.content()


def describe(vocab):
    """A vocabulary in a line: kind:size and a digest of its whole content
    (ids and their strings), which tells apart two of one kind and size."""
    digest = hashlib.sha256(f"{vocab.kind}\n{vocab.content()}".encode("utf-8", "surrogatepass")).hexdigest()
    return f"{vocab.kind}:{vocab.vocab_size} (digest {digest[:12]})"


def load_tokenizer(path):
    """--text tokenizer:PATH: the Hugging Face tokenizer.json at path, or in
    the folder path (a transformers save_pretrained folder), as a vocabulary;
    one line where there is none, it does not load, or its ids do not fit
    the token shards' uint16."""
    path = Path(path)
    file = path / TOKENIZER if path.is_dir() else path
    if not file.is_file():
        slow = path.is_dir() and (path / "vocab.json").is_file()
        raise HpctrainError(f"--text tokenizer:{path}: " + (
            "no such file or folder" if not path.exists() else
            f"no {TOKENIZER} in this folder" + (" (vocab.json and merges.txt are a slow tokenizer's: save it as a "
                                                "fast one, AutoTokenizer.from_pretrained(PATH).save_pretrained(PATH))"
                                                if slow else "")))
    tk = _tokenizers()
    try:
        tokenizer = tk.Tokenizer.from_file(str(file))
    except Exception as e:   # tokenizers raises plain Exceptions for a bad file
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise HpctrainError(f"--text tokenizer:{path}: {file.name} is not a Hugging Face tokenizer ({why})") from None
    size = tokenizer.get_vocab_size()
    if not 0 < size <= MAX_VOCAB:
        raise HpctrainError(f"--text tokenizer:{path}: {size} tokens; token ids are stored as uint32 at most "
                            f"(1..{MAX_VOCAB} tokens)")
    return Bpe(tokenizer)


def train_vocabulary(kind, size, text, eot=False):
    """The vocabulary of --text kind[:size] for the corpus (str; bytes for
    kind "bytes"); eot: a BPE with the end-of-text token EOT."""
    if kind == "chars":
        return Chars.train(text)
    if kind == "bytes":
        return Bytes()
    return Bpe.train(text, size, (EOT,) if eot else ())


def end_of_text(vocab):
    """The id of the vocabulary's end-of-text token (GPT-2's EOT), or None
    where it has none (chars, bytes: every id is a character or a byte)."""
    if vocab.kind != "bpe":
        return None
    return vocab.tokenizer.token_to_id(EOT)


def load_vocabulary(data_dir, manifest=None):
    """The vocabulary a prepared text directory was encoded with; a BPE's
    tokenizer.json checked against the manifest's sha256 first."""
    manifest = load_manifest(data_dir) if manifest is None else manifest
    if manifest.get("kind") != "tokens":
        raise HpctrainError(f"{data_dir}: holds images, not text (prepare --text)")
    if manifest["text"] == "chars":
        return Chars(manifest["vocabulary"])
    if manifest["text"] == "bytes":
        return Bytes()
    entry = manifest["tokenizer"]
    path = Path(data_dir) / entry["file"]
    try:
        got = _sha256(path)
    except OSError as e:
        raise HpctrainError(f"{path}: missing or unreadable tokenizer ({e.strerror or e}; listed in "
                            f"{MANIFEST}); prepare again with --force") from None
    if got != entry["sha256"]:
        raise HpctrainError(f"{path}: corrupt tokenizer (sha256 {got[:12]}..., manifest says "
                            f"{entry['sha256'][:12]}...); prepare again with --force")
    vocab = Bpe.load(path)
    if vocab.vocab_size != manifest["vocab_size"]:
        raise HpctrainError(f"{path}: {vocab.vocab_size} tokens, the manifest says {manifest['vocab_size']}; "
                            f"prepare again with --force")
    return vocab


def from_record(entry, source):
    """The vocabulary a model's record carries (record_entry's dict), or
    None where it carries none; a damaged entry is one line naming source."""
    if entry is None:
        return None
    try:
        if entry["kind"] == "chars" and isinstance(entry["vocabulary"], str) and entry["vocabulary"]:
            return Chars(entry["vocabulary"])
        if entry["kind"] == "bytes":
            return Bytes()
        if entry["kind"] == "bpe":
            return Bpe.from_str(zlib.decompress(base64.b64decode(entry["tokenizer_zlib"], validate=True)).decode())
    except HpctrainError:
        raise
    except Exception:   # a wrong type, bad base64 or zlib, a tokenizer JSON that does not parse
        pass
    raise HpctrainError(f"{source}: damaged vocabulary in its record; save the model again, or give --data DIR")
