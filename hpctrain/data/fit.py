"""Whether a model can read a prepared data directory: the one check made
wherever a model meets data (`hpctrain evaluate`, `predict`, `generate
--data`, training's start-up, a resume, `--resume-other-data`), so that
every command refuses the same things in the same words, exit 2.

- The kind: an image model reads images, a language model token ids; one
  meeting the other kind of data (a GPT's file on an image set, LeNet on
  prepared text) is refused in plain words (`check_kind`).
- For a language model, the vocabulary: the one its record carries
  (checkpoints/model_record.py; data/vocab.py record_entry) against the
  data's, whole (ids and their strings: a `bytes` model and `bpe:256` data
  both have 256 ids, and two `chars` vocabularies of 65 characters may
  differ in one), never just their size (`check_fit`). A file from before
  the record carried a vocabulary is held to the size alone.

    python -c "from hpctrain.data.fit import check_fit; check_fit('model gpt.h5', 'tokens', 'data/shakespeare-chars', text={'kind': 'bytes'})"

No MPI here (house rule): the callers make the line one for the whole job.
"""
from hpctrain.base.errors import HpctrainError

from .manifest import input_kind, load_manifest
from .vocab import describe, from_record, load_vocabulary, same

# input kind -> (the model that reads it, what data of it holds)
_WORDS = {"image": ("an image model", "images"), "tokens": ("a language model", "text")}
# What training says beside the refusal: the model that would train on that data.
_TRAIN_HINT = {"image": "; for text, a language model is --model gpt:layers=L,heads=H,width=E",
               "tokens": "; a language model trains on text prepared with `hpctrain data prepare --text`"}


def check_kind(model, kind, data_kind, data, verb="read"):
    """One line unless a model that takes `kind` inputs can read data of
    `data_kind` (nn/spec.INPUT_KINDS, "image" or "tokens"). model: the model
    in words ("model gpt.h5", "--model lenet"); data: where the data is
    ("data DIR", an image file); verb: what it would do with it ("read";
    training says "train on", and adds which model would)."""
    if kind == data_kind or kind not in _WORDS or data_kind not in _WORDS:
        return
    reader, held = _WORDS[kind][0], _WORDS[data_kind][1]
    raise HpctrainError(f"{model} is {reader} and {data} holds {held}: {reader} cannot {verb} {held}"
                        + (_TRAIN_HINT[kind] if verb == "train on" else ""))


def check_fit(model, kind, data_dir, classes=None, text=None, manifest=None, verb="read",
              advice="another model's file, or other data"):
    """The manifest of data_dir, once a model can read it (module docstring);
    else one line naming both sides. model, verb: check_kind's; kind: the
    model's input kind; classes: a language model's token count (None: not
    compared); text: the vocabulary its record carries (record_entry's
    dict), or None where it carries none; manifest: data_dir's, if read;
    advice: what the line about two vocabularies ends with."""
    manifest = load_manifest(data_dir) if manifest is None else manifest
    data = f"data {data_dir}"
    check_kind(model, kind, input_kind(manifest), data, verb)
    if kind != "tokens":
        return manifest
    have = load_vocabulary(data_dir, manifest)
    mine = from_record(text, model)
    if mine is not None and classes is not None and mine.vocab_size != classes:
        raise HpctrainError(f"{model}: a model of {classes} token ids, but its record's vocabulary has "
                            f"{mine.vocab_size}: a damaged file; save the model again")
    if mine is not None and not same(mine, have):
        raise HpctrainError(f"{model} was trained on vocabulary {describe(mine)} but {data} holds "
                            f"{describe(have)}: {advice}")
    if mine is None and classes is not None and classes != have.vocab_size:
        raise HpctrainError(f"{model} reads {classes} token ids (it records no vocabulary: saved by an older "
                            f"hpctrain) but {data} holds {describe(have)}: {advice}")
    return manifest
