"""A text corpus -> token shards + manifest.json, atomically (`prepare --text`).

    python -m hpctrain.data prepare --source data/shakespeare/input.txt --out data/shakespeare-chars --text chars
    python -m hpctrain.data prepare --source corpus/ --out data/corpus-bpe --text bpe:4096 --val-fraction 0.05
    python -m hpctrain.data prepare --source corpus/ --out data/corpus-gpt2 --text tokenizer:gpt2/tokenizer.json

or in code `prepare_text(source, out, text="chars")`, which returns the
manifest. The corpus (text.py: a file or a folder's .txt files) is encoded
whole with its vocabulary (vocab.py: chars, bytes, bpe:N, or a given
tokenizer.json, tokenizer:PATH, kept as bpe:N's is); its last
--val-fraction of tokens (default 0.1) is the held-out split, written once
(test-00000-of-00001.h5) and listed as both "test" and "val", so validation
and the final test read text training never saw; the rest is
train-00000-of-00001.h5. Each shard holds one dataset, `tokens`, uint8 when
the vocabulary has at most 256 tokens, else uint16, stored contiguous and
uncompressed, so that the readers read windows at their offset in the file
(tokens.py). The manifest says `"kind": "tokens"` and records the
vocabulary (its characters for chars; the BPE's tokenizer.json, saved
beside the shards, by name and sha256, and for tokenizer:PATH the path it
came from), the token counts, the source files and every file's sha256. As with images
(prepare.py), everything is written to a temporary sibling of --out and
renamed into place: --out is complete or untouched. No MPI here (house rule).
"""

import json
import shutil
from pathlib import Path

import h5py
import numpy as np

from hpctrain.base.errors import HpctrainError

from .manifest import FORMAT, FORMAT_VERSION, MANIFEST, _sha256, shard_name, token_dtype
from .prepare import _check_not_input, _check_out, _install, _make_tmp, _resolve_out, _tmp_name
from .stopping import signals_held, stops_cleanly, sweep_stale_tmps
from .text import decode_utf8, read_corpus
from .vocab import TOKENIZER, load_tokenizer, parse_text, train_vocabulary

def _encode(kind, size, corpus, source, files, vocab=None):
    """(vocabulary, ids) of the corpus (bytes: uint8 as they are, not a copy
    8 times larger); vocab: a given one (tokenizer:PATH), else trained."""
    if kind == "bytes":
        return train_vocabulary(kind, size, corpus), np.frombuffer(corpus, np.uint8)
    text = decode_utf8(corpus, source, files)
    vocab = vocab or train_vocabulary(kind, size, text)
    ids = vocab.encode(text)
    if len(ids) and ids.max() >= vocab.vocab_size:   # a tokenizer whose ids skip some: the model's rows would not
        raise HpctrainError(f"--text {kind}:{size}: id {ids.max()} for a vocabulary of {vocab.vocab_size} "
                            f"tokens; its ids must be 0..{vocab.vocab_size - 1}")
    return vocab, ids


def _split_tail(ids, val_fraction, source):
    """(train ids, held-out ids): the held-out split is the last
    round(F * n) tokens, not interleaved, so its text is unseen in training.
    Each needs 2 tokens at least (one window of one token and its next)."""
    held = int(np.floor(len(ids) * val_fraction + 0.5))
    train, test = ids[:len(ids) - held], ids[len(ids) - held:]
    if len(train) < 2 or len(test) < 2:
        raise HpctrainError(f"{source}: {len(ids)} tokens, too few to hold out --val-fraction {val_fraction:g} "
                            f"({len(train)} to train on, {len(test)} held out; each needs 2 at least)")
    return train, test


def _write_shard(path, ids, dtype, split):
    # Contiguous and uncompressed: the readers read a batch's windows at their
    # offset in the file and read a batch's windows in place (tokens.py).
    with h5py.File(path, "w") as f:
        f.create_dataset("tokens", data=ids.astype(dtype))
        f.attrs["split"] = split
        f.attrs["shard"] = 0
        f.attrs["num_shards"] = 1


def _split_entry(path, ids):
    shard = {"file": path.name, "num_tokens": int(len(ids)), "bytes": path.stat().st_size,
             "sha256": _sha256(path)}
    return {"num_tokens": int(len(ids)), "shards": [shard]}


def _write(tmp, vocab, train, test, dtype):
    """Every file into tmp: the two shards and a BPE's tokenizer.json; their manifest entries."""
    entries = {}
    for split, ids in (("train", train), ("test", test)):
        path = tmp / shard_name(split, 0, 1)
        _write_shard(path, ids, dtype, split)
        entries[split] = _split_entry(path, ids)
    if vocab.kind == "bpe":
        vocab.save(tmp / TOKENIZER)
        entries["tokenizer"] = {"file": TOKENIZER, "sha256": _sha256(tmp / TOKENIZER)}
    return entries


def _build_manifest(source, files, vocab, dtype, val_fraction, entries):
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "kind": "tokens",
        "source": {"dir": str(source), "layout": "text", "files": files},
        "text": vocab.kind,
        "vocab_size": int(vocab.vocab_size),
        "dtype": dtype,
        "val_fraction": float(val_fraction),
        **vocab.manifest_entry(),
    }
    if "tokenizer" in entries:
        manifest["tokenizer"] = entries["tokenizer"]
    manifest["train"] = entries["train"]
    manifest["test"] = entries["test"]
    manifest["val"] = entries["test"]   # one held-out tail: --eval-every and --keep-best read it too
    return manifest


@stops_cleanly
def prepare_text(source, out, text="chars", val_fraction=0.1, force=False, log=print):
    """Encode the corpus at source with --text `text` (chars, bytes, bpe:N,
    tokenizer:PATH) and write its token shards, manifest.json and (bpe,
    tokenizer) tokenizer.json into
    out; return the manifest. Everything is checked before anything is
    written: a binary file, an empty corpus, bytes that are not UTF-8 (chars
    and bpe), a vocabulary past uint16 are one HpctrainError line."""
    log = log or (lambda *a: None)
    kind, size = parse_text(text)
    given = load_tokenizer(size) if kind == "tokenizer" else None   # checked before the corpus is read
    if not 0 < val_fraction < 1:
        raise HpctrainError(f"--val-fraction must be in (0, 1) for text (the held-out tail), got {val_fraction}")
    source, out = Path(source), _resolve_out(out)
    _check_not_input(source, out, images=False)
    _check_out(out, force)
    corpus, files = read_corpus(source)
    vocab, ids = _encode(kind, size, corpus, source, files, given)
    dtype = token_dtype(vocab.vocab_size)
    train, test = _split_tail(ids, val_fraction, source)

    sweep_stale_tmps(out, log)
    tmp = _tmp_name(out)
    try:
        _make_tmp(tmp, out)   # in the try: a stop right after the mkdir removes it too
        entries = _write(tmp, vocab, train, test, dtype)
        if given is not None:   # where the tokenizer came from (its copy is the file beside the shards)
            entries["tokenizer"]["from"] = str(Path(size).resolve())
        manifest = _build_manifest(source, files, vocab, dtype, val_fraction, entries)
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
        with signals_held():
            _install(tmp, out, force)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise HpctrainError(f"{out}: cannot write shards ({e})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tokens = f"{vocab.vocab_size} token{'s' * (vocab.vocab_size != 1)}"   # "1 tokens" of a one-letter text
    log(f"prepared {out}: {len(train)} training tokens, {len(test)} held out (the last {val_fraction:g}), "
        f"{tokens} of --text {text} ({dtype}), from {len(corpus)} bytes in {source}")
    return manifest
