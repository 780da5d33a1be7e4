"""A pretrained model's tensors, by hpctrain's names, from what `hpctrain
train --init-from PATH`, `generate --params PATH` and `evaluate --params
PATH` take:

- a Hugging Face GPT-2 folder: config.json + model.safetensors (GPT-2's
  names, interop/gpt2.py; a pytorch_model.bin alone is refused: loading it
  is unpickling, which runs whatever code the file names);
- a .safetensors file that `hpctrain export --format safetensors` wrote
  (hpctrain's names, the model's record in its metadata);
- an hpctrain --save file (HDF5, whole tensors by name, the record beside).

`open_source(path)` gives a `Source`: the model's --model name, vocabulary
size and positions (the rows of its position table), its record (the
vocabulary it was trained on) where it carries one, and `read(name, box)`:
one box of one tensor, read from the file alone (a memory map; an HDF5
slice), so that each rank of any layout reads only its pieces through
state/consumers.restore. Nothing is allocated before the names and shapes
are checked (`check(spec)`): every bad file is one line.

    python -c "from hpctrain.interop.pretrained import open_source; s = open_source('gpt2-folder'); print(s.model)"
    python -m pytest -q tests/test_interop_hf.py
"""
import json
import os

import numpy as np

from ..base.errors import HpctrainError
from ..checkpoints.model_record import ATTR
from . import gpt2
from .safetensors import SafeTensors

SUFFIX = ".safetensors"


def is_pretrained(path):
    """PATH names a model this module reads rather than an hpctrain --save file
    or checkpoint: a Hugging Face folder (its config or weights), a .safetensors file."""
    path = str(path)
    if os.path.isdir(path):
        return any(os.path.exists(os.path.join(path, name)) for name in (gpt2.CONFIG, gpt2.WEIGHTS, gpt2.PICKLED))
    return path.endswith(SUFFIX)


class Source:
    """One pretrained model's tensors by hpctrain's names (module docstring).
    model: the --model name; vocab, positions: its token count and
    position rows; record: the inference record (checkpoints/model_record.py)
    or None; `names`: hpctrain name -> the file's (None until check())."""

    def __init__(self, path, model, vocab, positions, record, shapes, reader, close, gpt2_names):
        self.path, self.model, self.vocab, self.positions, self.record = path, model, vocab, positions, record
        self._shapes, self._read, self._close, self._gpt2 = shapes, reader, close, gpt2_names
        self.names = None

    def check(self, spec):
        """Every tensor of the (whole) spec held, of its shape (the position
        table: at least the spec's rows, its first ones taken); one line for
        the first that is not. Then read() takes the spec's names."""
        try:
            as_gpt2 = gpt2.names(spec)
        except HpctrainError:   # not a GPT: its own names only (a --save file's, an export's)
            as_gpt2 = {}
        table = next((name for name, theirs in as_gpt2.items() if theirs.endswith("wpe.weight")), None)
        in_file = spec.name_in_file(self._shapes)   # an older --save file's or export's positional names too
        mine = gpt2.names(spec) if self._gpt2 else {name: in_file(name) for name, _, _, _ in spec.full.tensors}
        shapes = {name: shape for name, shape, _, _ in spec.full.tensors}
        for name, theirs in mine.items():
            have, want = self._shapes.get(theirs), tuple(shapes[name])
            if have is None:
                raise HpctrainError(f"{self.path}: no tensor {theirs}, which model {self.model} needs")
            # a GPT's position table may hold more positions than the run's --block-size takes
            rows_ok = name == table and len(have) == 2 and have[1] == want[1] and have[0] >= want[0]
            if tuple(have) != want and not rows_ok:
                raise HpctrainError(f"{self.path}: {theirs} is {'x'.join(map(str, have))}, model {self.model} "
                                    f"needs {'x'.join(map(str, want))}")
        self.names, self._shapes_wanted = mine, shapes

    def read(self, name, box=None):
        """Box `box` of hpctrain's tensor `name` (whole: None), float32."""
        if box is None:   # the whole tensor as the spec has it (a position table: its first rows)
            box = tuple((0, n) for n in self._shapes_wanted[name])
        return self._read(self.names[name], box)

    def text(self):
        """The vocabulary (data/vocab.py record_entry) its record carries, else
        a Hugging Face folder's tokenizer.json (as `prepare --text
        tokenizer:PATH` records one: a BPE's), else None."""
        entry = (self.record or {}).get("text")
        if isinstance(entry, dict):
            return entry
        tokenizer = os.path.join(self.path, gpt2.TOKENIZER)
        if self._gpt2 and os.path.isfile(tokenizer):
            from ..data.vocab import Bpe
            return Bpe.load(tokenizer).record_entry()
        return None

    def close(self):
        self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _record(text, where):
    if text is None:
        return None
    try:
        rec = json.loads(text)
    except (ValueError, RecursionError):
        rec = None
    if not isinstance(rec, dict) or not isinstance(rec.get("model"), str):
        raise HpctrainError(f"{where}: damaged '{ATTR}' record in its metadata; export the model again")
    return rec


def open_source(path):
    """The Source of a pretrained model at path (module docstring); one line for what is not one."""
    path = str(path)
    if os.path.isdir(path):
        return _folder(path)
    if not os.path.exists(path):
        raise HpctrainError(f"{path}: no such file or folder")
    if path.endswith(SUFFIX):
        return _safetensors(path)
    return _saved(path)


def _folder(path):
    weights = os.path.join(path, gpt2.WEIGHTS)
    if not os.path.isfile(weights):
        if os.path.isfile(os.path.join(path, gpt2.PICKLED)):
            raise HpctrainError(f"{path}: holds {gpt2.PICKLED} only, a pickle (loading it runs whatever code it "
                                f"names), which hpctrain refuses; convert it: AutoModelForCausalLM.from_pretrained"
                                f"(PATH).save_pretrained(OUT, safe_serialization=True)")
        raise HpctrainError(f"{path}: no {gpt2.WEIGHTS} (a Hugging Face model folder's weights)")
    config = gpt2.read_config(path)
    model, vocab, positions = gpt2.model_of(config, os.path.join(path, gpt2.CONFIG))
    st = SafeTensors(weights)
    # GPT2LMHeadModel's names start transformer.; GPT2Model's do not (the head is wte in both)
    prefix = "" if any(n.startswith("transformer.") for n in st.names) else "transformer."
    shapes = {prefix + n: st.shape(n) for n in st.names}
    record = _record(st.metadata.get(ATTR), weights)

    def reader(name, box):
        return st.read(name[len(prefix):], box)
    return Source(path, model, vocab, positions, record, shapes, reader, st.close, True)


def _shape_of_record(rec):
    shape = rec.get("input_shape") or [0]
    return int(rec.get("classes") or 0), int(shape[0])


def _safetensors(path):
    st = SafeTensors(path)
    record = _record(st.metadata.get(ATTR), path)
    if record is None:
        st.close()
        raise HpctrainError(f"{path}: no '{ATTR}' record in its metadata (hpctrain export writes one); for a Hugging "
                            f"Face model give its folder, with config.json")
    vocab, positions = _shape_of_record(record)
    shapes = {n: st.shape(n) for n in st.names}
    return Source(path, record["model"], vocab, positions, record, shapes, st.read, st.close,
                 "transformer.wte.weight" in shapes)


def _saved(path):
    """An hpctrain --save file (HDF5): its record and datasets, read as
    predict and evaluate read it (checkpoints/trained.Saved)."""
    from ..checkpoints.trained import Saved
    saved = Saved(path)
    record = _record(saved.attrs.get(ATTR), path)
    if record is None:
        saved.close()
        raise HpctrainError(f"{path}: records no model ('{ATTR}' attribute): not a --save file of this hpctrain")
    vocab, positions = _shape_of_record(record)
    return Source(path, record["model"], vocab, positions, record, saved.shapes, saved.read, saved.close, False)


# --- generate and evaluate: --params PATH ----------------------------------------------


def load(params=None, checkpoint=None, data_dir=None, model=None):
    """The model generate and evaluate read (checkpoints/trained.Trained):
    a Hugging Face folder or a .safetensors file here, anything else as
    checkpoints/trained.load reads it."""
    from ..checkpoints import trained
    if params is not None and is_pretrained(params):
        return load_trained(params, model)
    return trained.load(params, checkpoint, data_dir=data_dir, model=model)


def load_trained(path, model=None):
    """The model of a Hugging Face GPT-2 folder or a .safetensors export:
    its architecture from the folder's config.json or the file's record,
    its context the position table's rows, its vocabulary the record's,
    else the folder's tokenizer.json (as `prepare --text tokenizer:PATH`
    records one: a BPE's)."""
    from ..checkpoints.trained import rebuilt
    path = str(path)
    with open_source(path) as source:
        if model is not None and model != source.model:
            raise HpctrainError(f"--model {model}: {path} holds model {source.model}")
        rec = dict(source.record or {})
        # a config's name need not spell the record's (dropout); the tensors' shapes are what is checked
        rec.pop("identity", None)
        rec.update({"model": source.model, "hidden": [], "input_shape": [source.positions], "classes": source.vocab,
                    "text": source.text()})
        return rebuilt(rec, path, source.read, source.check)


# --- hpctrain train --init-from PATH ---------------------------------------------------


def init_args(args):
    """The flags of a run with --init-from PATH, the model's from PATH: a copy
    of `args` whose --model is PATH's (a --model that names another model is
    one line; one that names the same with dropout= keeps its dropout) and
    whose --block-size fits PATH's position table (left out, it is the
    default or the table's rows where they are fewer; given larger, one line).
    flags/cli.parse leaves both None where not given."""
    from argparse import Namespace
    from ..flags.cli import PRETRAINED_DEFAULTS
    from ..flags.model_names import gpt_options
    with open_source(args.init_from) as source:
        model, positions = source.model, source.positions
    out = Namespace(**vars(args))
    if args.model is not None:   # --model given
        try:
            given, theirs = gpt_options(args.model), gpt_options(model)
        except ValueError:
            given = theirs = None
        same = given is not None and theirs is not None and \
            {k: v for k, v in given.items() if k != "dropout"} == {k: v for k, v in theirs.items() if k != "dropout"}
        if not same and args.model != model:
            raise HpctrainError(f"--model {args.model} contradicts --init-from {args.init_from}, which holds model "
                                f"{model}; leave --model out (the model is PATH's)")
        if same and given.get("dropout"):
            model = args.model
    out.model = model
    if args.block_size is None:
        out.block_size = min(PRETRAINED_DEFAULTS["block_size"], positions or PRETRAINED_DEFAULTS["block_size"])
    elif positions and args.block_size > positions:
        raise HpctrainError(f"--block-size {args.block_size}: --init-from {args.init_from} has {positions} "
                            f"positions; give --block-size {positions} or less")
    return out


def check_init_data(path, classes, data_dir):
    """The data's vocabulary is the pretrained model's: where PATH records the
    vocabulary it was trained on (an hpctrain export or --save file) or holds
    its tokenizer.json (a Hugging Face folder), the same one (data/fit.py);
    else the same size (all a folder without a tokenizer can tell); else one line."""
    from ..data.fit import check_fit
    from ..data.vocab import describe, load_vocabulary
    with open_source(path) as source:
        vocab, text = source.vocab, source.text()
    if text is None and vocab != classes:
        raise HpctrainError(f"--init-from {path}: a model of {vocab} token ids, but data {data_dir} holds "
                            f"{describe(load_vocabulary(data_dir))}: prepare the text with the model's tokenizer "
                            f"(hpctrain data prepare --text tokenizer:{path})")
    check_fit(f"--init-from {path}", "tokens", data_dir, classes=vocab, text=text, verb="fine-tune on",
              advice="prepare the text with the model's vocabulary")


def initialize(path, spec, parts, xp=np):
    """The parameters' parts of this rank (state/consumers.parameters) from
    PATH's tensors, each part its box alone (whatever the layout); the
    optimizer's state and the non-trainable state stay as made."""
    from ..state.consumers import parameters, restore
    with open_source(path) as source:
        source.check(spec)
        restore(parameters(parts, spec), source.read, xp)
