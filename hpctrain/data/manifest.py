"""The shard directory's contract: where it lives, what manifest.json must hold.

prepare.py (images) and prepare_text.py (tokens, `"kind": "tokens"`) write a
directory of HDF5 shards plus manifest.json; reader.py and tokens.py open
it. This module is what they agree on: the format constants, the paths
(default_data_dir, bundled_sample_dir, shard_name), and load_manifest, which
checks the manifest's structure before any file it names is opened.

    python -c "from hpctrain.data import load_manifest; print(load_manifest('data/mnist'))"

No MPI here (house rule).
"""

import hashlib
import json
import shlex
from pathlib import Path

from hpctrain.base.errors import HpctrainError

FORMAT = "hpctrain-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# Token ids are stored in the narrowest of uint8, uint16 and uint32 that holds them
# (a vocabulary over 65,536 tokens, Llama 3's 128k, takes uint32).
MAX_VOCAB = 1 << 32
TEXT_KINDS = ("chars", "bytes", "bpe")


# ---------------------------------------------------------------------------
# Paths

def repo_root():
    # hpctrain/data/manifest.py -> the repository holding hpctrain/.
    return Path(__file__).resolve().parent.parent.parent


def default_data_dir():
    """Where training looks for shards unless told otherwise: <repo>/data/mnist."""
    return repo_root() / "data" / "mnist"


def bundled_sample_dir():
    """The real 5,000-image MNIST sample shipped with the repository."""
    return repo_root() / "data" / "mnist-5k"


def bundled_text_path():
    """The 1 MB of Shakespeare shipped with the repository (data/shakespeare/README.md)."""
    return repo_root() / "data" / "shakespeare" / "input.txt"


def is_prepared(data_dir):
    return (Path(data_dir) / MANIFEST).is_file()


def shard_name(split, index, count):
    return f"{split}-{index:05d}-of-{count:05d}.h5"


def _prepare_hint(data_dir):
    """The command that prepares data_dir: MNIST's only for MNIST's default
    place (whatever else the directory was meant to hold, MNIST is a wrong guess)."""
    out = shlex.quote(str(data_dir))
    if Path(data_dir).resolve() == default_data_dir().resolve():
        return f"hpctrain data prepare --out {out} (the bundled MNIST sample)"
    return (f"hpctrain data prepare --source SOURCE --out {out} (SOURCE: your image folder, arrays or "
            f"downloaded files; hpctrain data prepare --help)")


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------
# manifest.json

def load_manifest(data_dir):
    """The manifest of a prepared directory, with a clear error if there is none."""
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST
    if not data_dir.is_dir():
        raise HpctrainError(f"{data_dir}: no such directory; prepare shards first: "
                            f"{_prepare_hint(data_dir)}")
    if not path.is_file():
        raise HpctrainError(f"{path}: missing, {data_dir} is not a prepared shard directory; "
                            f"prepare it: {_prepare_hint(data_dir)}")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise HpctrainError(f"{path}: unreadable ({e}); prepare again with --force") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise HpctrainError(f"{path}: not an hpctrain shard manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise HpctrainError(f"{path}: manifest version {manifest.get('version')}, this "
                            f"hpctrain reads version {FORMAT_VERSION}; prepare again with --force")
    problem = _manifest_problem(manifest)
    if problem:
        raise HpctrainError(f"{path}: bad manifest: {problem}; prepare again with --force")
    return manifest


def _is_count(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _manifest_problem(manifest):
    """What is wrong with a manifest's structure (None if nothing): the keys
    and types the readers use, and shard names confined to the data
    directory. The manifest is input like any other file: a name such as
    ../../etc/passwd or /scratch/other/train.h5 must never be opened."""
    kind = manifest.get("kind", "images")   # image manifests predate the key
    if kind == "tokens":
        return _tokens_problem(manifest)
    if kind != "images":
        return f"kind must be 'images' or 'tokens', got {kind!r}"
    shape = manifest.get("image_shape")
    if not (isinstance(shape, list) and shape and all(_is_count(d) and d > 0 for d in shape)):
        return f"image_shape must be a list of positive integers, got {shape!r}"
    classes = manifest.get("num_classes")
    if not (_is_count(classes) and classes > 0):
        return f"num_classes must be a positive integer, got {classes!r}"
    # "val" is there only when prepare held one out (--val-fraction).
    for split in ("train", "test") + (("val",) if "val" in manifest else ()):
        problem = _split_problem(manifest.get(split), split)
        if problem:
            return problem
    return None


def _tokens_problem(manifest):
    """What is wrong with a token manifest (prepare_text.py; None if nothing):
    the vocabulary its ids index, their dtype, the tokenizer, the splits."""
    size, text = manifest.get("vocab_size"), manifest.get("text")
    if not (_is_count(size) and 0 < size <= MAX_VOCAB):
        return f"vocab_size must be an integer in 1..{MAX_VOCAB}, got {size!r}"
    if manifest.get("dtype") != token_dtype(size):
        return f"dtype must be {token_dtype(size)} for {size} tokens, got {manifest.get('dtype')!r}"
    if text not in TEXT_KINDS:
        return f"text must be one of {', '.join(TEXT_KINDS)}, got {text!r}"
    vocabulary = manifest.get("vocabulary")
    if text == "chars" and not (isinstance(vocabulary, list) and len(vocabulary) == size
                                and all(isinstance(c, str) and len(c) == 1 for c in vocabulary)
                                and vocabulary == sorted(set(vocabulary))):
        return f"vocabulary must list {size} distinct characters in code point order"
    if text == "bytes" and size != 256:
        return f"a byte vocabulary has 256 tokens, not {size}"
    if text == "bpe":
        entry = manifest.get("tokenizer")
        if not (isinstance(entry, dict) and _plain_name(entry.get("file"))
                and isinstance(entry.get("sha256"), str)):
            return "tokenizer must name its file in the data directory and its sha256"
    for split in ("train", "test") + (("val",) if "val" in manifest else ()):
        problem = _split_problem(manifest.get(split), split, count="num_tokens")
        if problem:
            return problem
    return None


def token_dtype(vocab_size):
    """The narrowest dtype that holds ids below vocab_size (<= MAX_VOCAB)."""
    return "uint8" if vocab_size <= 1 << 8 else "uint16" if vocab_size <= 1 << 16 else "uint32"


def _plain_name(name):
    """A plain file name in the data directory: no path, nothing that leaves it."""
    return (isinstance(name, str) and name != "" and name not in (".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name)


def _split_problem(part, split, count="num_samples"):
    """What is wrong with manifest[split] (None if nothing); count: the key
    of a shard's size (samples of images, or tokens)."""
    if not isinstance(part, dict) or not isinstance(part.get("shards"), list):
        return f"'{split}' must hold a list of shards"
    if split == "train" and not part["shards"]:
        return "no training shards"
    for entry in part["shards"]:
        if not isinstance(entry, dict):
            return f"a {split} shard entry is {type(entry).__name__}, not an object"
        name = entry.get("file")
        if not _plain_name(name):
            return f"shard file {name!r} is not a plain file name in the data directory"
        if not _is_count(entry.get(count)):
            return f"{name}: {count} must be a non-negative integer"
        if not isinstance(entry.get("sha256"), str):
            return f"{name}: sha256 missing"
    total = sum(e[count] for e in part["shards"])
    if part.get(count) != total:
        return f"{split} {count} {part.get(count)!r}, its shards hold {total}"
    return None


def input_kind(manifest):
    """What the readers give a model's first layer from this data
    (nn/spec.INPUT_KINDS): "image", uint8 pixels read as float32 in [0, 1]
    (reader.py), or "tokens", integer ids below vocab_size (`prepare --text`,
    tokens.py). The model's spec must take the same (run/startup.py)."""
    return "tokens" if manifest.get("kind") == "tokens" else "image"


def model_shape(manifest, block_size=None):
    """(input shape, classes) of the model that trains on this data: one
    image's shape as stored (28x28; 32x32x3, channels last) and the
    manifest's class count; for text, (block_size,) token ids (--block-size)
    and the vocabulary. The model is built from these (nn/zoo.spec_for),
    so the data and the model cannot disagree; labels past the class count
    are refused by the readers, shard by shard."""
    problem = _manifest_problem(manifest)
    if problem:
        raise HpctrainError(f"bad manifest: {problem}")
    if manifest.get("kind") == "tokens":
        if block_size is None:
            raise HpctrainError(f"holds text as tokens ({manifest['vocab_size']} of them, prepare --text), "
                                f"not images: a model reads it through --block-size (training's)")
        return (int(block_size),), int(manifest["vocab_size"])
    return tuple(manifest["image_shape"]), manifest["num_classes"]


def train_samples(manifest, block_size):
    """The training set's samples: its images, or for text the windows of
    block_size + 1 tokens it holds (one per starting offset, data/tokens.py)."""
    if manifest.get("kind") == "tokens":
        return max(0, int(manifest["train"]["num_tokens"]) - int(block_size))
    return int(manifest["train"]["num_samples"])
