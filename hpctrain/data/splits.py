"""Which reader reads a prepared directory: its images (reader.py) or its
text as tokens (tokens.py), chosen by the manifest's kind, so the run's
code above asks for "the training reader" and "the held-out part" once.
A sample is an image, or a window of block_size + 1 tokens (--block-size).
No MPI here (house rule): callers pass worker numbers, not ranks.

    python -c "from hpctrain.data.splits import held_out; print(held_out('data/mnist', 0, 4)[1].shape)"
"""
from ..base.chunks import chunk_parts
from .manifest import load_manifest
from .reader import ShardReader, load_test
from .tokens import TokenReader, eval_windows, load_test_windows


def is_text(manifest):
    return manifest.get("kind") == "tokens"


def training_reader(data_dir, worker, num_workers, batch_size, seed, block_size, augment=None, dtype=None,
                    **arrays):
    """Worker `worker` of `num_workers`' reader of training batches:
    ShardReader (images as `dtype`, augmented) or TokenReader (int64 windows
    of block_size tokens; augment and dtype do not apply)."""
    if is_text(load_manifest(data_dir)):
        return TokenReader(data_dir, worker, num_workers, batch_size, seed, block_size, **arrays)
    return ShardReader(data_dir, worker, num_workers, batch_size, seed, augment=augment,
                       **({} if dtype is None else {"dtype": dtype}), **arrays)


def held_out(data_dir, part, parts, block_size, split="test", eval_tokens=None):
    """Contiguous part `part` of `parts` of the test (or "val") split:
    (uint8 pixels, labels) for images (raw: scaled per batch by the model),
    (int64 windows, int64 next tokens) for text. The one place every layout's
    evaluation takes its held-out samples from: eval_tokens (text only,
    --eval-tokens: run/plan.Data.eval_tokens) keeps the windows of
    tokens.eval_windows' sample, the same on any number of parts."""
    if is_text(load_manifest(data_dir)):
        return load_test_windows(data_dir, block_size, part, parts, split=split, eval_tokens=eval_tokens)
    return load_test(data_dir, part, parts, raw=True, split=split)


def held_out_count(manifest, part, parts, block_size, split="test", eval_tokens=None):
    """The samples held_out gives part `part` of `parts`, from the manifest alone."""
    if is_text(manifest):
        total = len(eval_windows((int(manifest[split]["num_tokens"]) - 1) // int(block_size), int(block_size),
                                 eval_tokens))
    else:
        total = int(manifest[split]["num_samples"])
    lo, hi = chunk_parts(total, parts)[part]
    return hi - lo


def held_out_tokens(manifest, block_size, eval_tokens=None, split="test"):
    """The tokens an evaluation of text's `split` scores (its windows', with
    eval_tokens the sample's: held_out); eval_tokens None: all of them."""
    return held_out_count(manifest, 0, 1, block_size, split, eval_tokens) * int(block_size)
