"""A trained model outside training: the model loaded back from a --save
file or a checkpoint (`load`), for predict.py and evaluate.py, rebuilt from
the record training wrote beside its parameters (checkpoints/model_record.py:
the model as named, its shapes, the data's class names and preparation).
Files written before the record existed still load where the data names the
shapes (`--data DIR`: an MLP's, or a zoo model's).

    python -c "from hpctrain.checkpoints import trained; m = trained.load(params='p.h5'); print(m.describe())"

No MPI here: predict and evaluate are one process.
"""
import json
import math
import os
import sys
import types
from dataclasses import dataclass

import numpy as np

from .. import data as data_mod
from ..base.errors import HpctrainError
from ..data.arrays import memory_available
from ..data.fit import check_fit, check_kind
from .trust import Corrupt, Refused, hard_linked, stored_inside
from ..nn import LayerError, spec_for
from ..nn.user import UserModelError
from ..flags.model_names import gpt_options, input_kind_of, is_model_file
from ..nn.zoo import MODELS
from .model_record import ATTR
from ..base.files import printable
from ..state.parts import box_slices

_ZOO = tuple(MODELS)
# The largest input (values per sample: 16384 x 16384 pixels of one channel)
# and class count a record may name: far above any image classifier's, far
# below what the arithmetic of a model's shapes could not hold.
MAX_INPUT = 2 ** 28
MAX_CLASSES = 2 ** 20


@dataclass
class Trained:
    """A model rebuilt from a file, on NumPy, its parameters loaded."""
    model: object            # nn Sequential
    spec: object             # nn ModelSpec
    source: str              # the file it came from
    step: int
    class_names: list        # index -> name (the numbers as text when the data had none)
    preprocess: dict         # prepare's record of how the training images were made, or None
    text: dict = None        # a language model's vocabulary (data/vocab.py record_entry), or None
    record: dict = None      # the whole record it was rebuilt from (checkpoints/model_record.py), for an export

    @property
    def input_shape(self):
        return self.spec.input_shape

    def logits(self, x, batch=128):
        """Logits of images x (uint8 pixels, scaled by 1/255 as in training,
        or floats) in the model's dtype, batch by batch as
        Sequential.evaluate runs them."""
        out = np.empty((len(x), self.spec.classes), self.model.dtype)
        for lo in range(0, len(x), batch):
            a = x[lo:lo + batch]
            if a.dtype == np.uint8:
                a = a.astype(self.model.dtype)
                a /= 255
            out[lo:lo + batch] = self.model.run.forward(a, False)
        return out

    def describe(self):
        return (f"{self.source}: step {self.step}, model {self.spec.name}, input "
                f"{'x'.join(map(str, self.input_shape))}, {self.spec.classes} classes")

    def check_data(self, data_dir):
        """data_dir's manifest, once this model can read it: the same kind of
        input (images or text) and, for a language model, the same whole
        vocabulary as its record's (data/fit.py, the check every command
        makes); for images, their shape, class count and class names.
        Otherwise one line."""
        manifest = check_fit(f"model {self.source}", self.spec.input_kind, data_dir, classes=self.spec.classes,
                             text=self.text)
        if self.spec.input_kind == "tokens":
            return manifest
        shape, classes = data_mod.model_shape(manifest)
        if tuple(shape) != tuple(self.input_shape) or classes != self.spec.classes:
            raise HpctrainError(
                f"{data_dir}: {'x'.join(map(str, shape))} images of {classes} classes, but the model in "
                f"{self.source} takes {'x'.join(map(str, self.input_shape))} images of {self.spec.classes} "
                f"classes: another model's file, or other data")
        names = manifest.get("class_names")
        if names and names != self.class_names and self.class_names != [str(i) for i in range(classes)]:
            raise HpctrainError(f"{data_dir}: classes {', '.join(map(printable, names))}, but the model in "
                                f"{self.source} was trained on {', '.join(map(printable, self.class_names))}")
        return manifest


def model_inputs(params=None, checkpoint=None, model=None):
    """The files and folders a model is read from (overwrites.Input): the
    --params file, the --checkpoint file or folder, a --model FILE.py: what
    predict's and evaluate's outputs must not replace."""
    from ..base.overwrites import Input
    inputs = [Input(params, "the --params file")]
    if checkpoint:
        inputs.append(Input(checkpoint, "the --checkpoint folder" if os.path.isdir(checkpoint)
                            else "the --checkpoint file"))
    if model and is_model_file(model):
        inputs.append(Input(model.rpartition(":")[0], "the --model file"))
    return [i for i in inputs if i.path]


def _plain(value):
    if isinstance(value, bytes):
        return value.decode(errors="replace")   # damaged bytes: a record that does not parse
    return value.item() if isinstance(value, np.generic) else value


def _record_of(attrs, source, data_dir, model):
    """The inference record: the file's, or for a file from before it, what
    --data and the file's own attributes say; `model` (--model) in place of
    the model it names. A user's model file is run only where --model names
    it: the path a record holds is anyone's who wrote the file."""
    text = attrs.get(ATTR)
    if text is not None:
        try:
            rec = _checked(json.loads(text if isinstance(text, str) else ""), source)
        except (ValueError, RecursionError):   # RecursionError: arrays nested past what json parses
            raise HpctrainError(f"{source}: damaged '{ATTR}' attribute; save the model again") from None
        if model is None and is_model_file(rec["model"]):
            raise HpctrainError(f"{source}: was trained from a user's model file, {printable(rec['model'])}; "
                                f"predict and evaluate run no code that a saved file names: pass --model "
                                f"{printable(rec['model'])} to rebuild it with that file (it runs as Python: "
                                f"a file you trust)")
    else:
        identity = str(attrs.get("model", "mlp"))
        name = identity.split(" ", 1)[0]
        if data_dir is None or (not _in_zoo(name) and model is None):
            raise HpctrainError(f"{source}: written by an hpctrain that did not record how to rebuild the model; "
                                f"give --data DIR (the data it was trained on)"
                                + ("" if _in_zoo(name) else " and --model FILE.py:FUNCTION"))
        manifest = data_mod.load_manifest(data_dir)
        # images or text, in every command's words (data/fit.py), before the shapes are read
        check_kind(f"model {source}", input_kind_of(name) or "image", data_mod.input_kind(manifest),
                   f"data {data_dir}")
        shape, classes = data_mod.model_shape(manifest)
        hidden = [int(w) for w in str(attrs.get("hidden", "")).split(",") if w.strip().isdigit()]
        rec = {"model": name, "hidden": hidden, "identity": identity, "input_shape": list(shape),
               "classes": classes, "class_names": manifest.get("class_names")}
    if model is not None:
        if not (_in_zoo(model) or is_model_file(model)):
            raise HpctrainError(f"--model {model}: not a model of the zoo ({', '.join(_ZOO)}) nor FILE.py:FUNCTION")
        rec["model"] = model
    return rec


def _in_zoo(name):
    """A model hpctrain builds by name: the zoo's, or gpt:... with its options."""
    try:
        return name in _ZOO or gpt_options(name) is not None
    except ValueError:
        return False


def _checked(rec, source):
    """The record, once its fields have the types and ranges record() writes
    (a damaged or crafted one would otherwise end in a traceback, or in an
    attempt to allocate terabytes), or one line naming the first that has not."""
    def damaged(what):
        return HpctrainError(f"{source}: damaged '{ATTR}' record ({what}); save the model again")
    if not isinstance(rec, dict):
        raise damaged(f"a JSON {type(rec).__name__}, not an object")
    name = rec.get("model")
    if not isinstance(name, str) or not (_in_zoo(name) or is_model_file(name)):
        raise damaged(f"'model' is {_short(name)}, not a model of the zoo nor FILE.py:FUNCTION")
    if not _whole_numbers(rec.get("hidden") or [], 1, MAX_INPUT):
        raise damaged(f"'hidden' is {_short(rec.get('hidden'))}, not a list of layer widths")
    shape = rec.get("input_shape")
    if not (isinstance(shape, list) and 1 <= len(shape) <= 3 and _whole_numbers(shape, 1, MAX_INPUT)
            and math.prod(shape) <= MAX_INPUT):
        raise damaged(f"'input_shape' is {_short(shape)}, not the shape of an image (up to {MAX_INPUT} values)")
    if not _whole_numbers([rec.get("classes")], 1, MAX_CLASSES):
        raise damaged(f"'classes' is {_short(rec.get('classes'))}, not a class count (1..{MAX_CLASSES})")
    names = rec.get("class_names")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise damaged("'class_names' is not a list of names")
    for key, kind in (("identity", str), ("preprocess", dict), ("text", dict)):
        if rec.get(key) is not None and not isinstance(rec[key], kind):
            raise damaged(f"'{key}' is {_short(rec[key])}")
    return rec


def _whole_numbers(values, lo, hi):
    return isinstance(values, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi for v in values)


def _short(value):
    """A value of a damaged record, in a line: its JSON, cut short."""
    text = printable(json.dumps(value, default=str))
    return text if len(text) <= 40 else text[:37] + "..."


def _build(rec, source, stored_bytes):
    """The model's spec, once what building it allocates fits in the file
    it comes from (4 bytes a parameter) and in memory."""
    args = types.SimpleNamespace(model=rec["model"], hidden=rec.get("hidden") or [])
    try:
        spec = spec_for(args, tuple(rec["input_shape"]), rec["classes"])
    except (LayerError, UserModelError) as e:
        raise HpctrainError(f"{source}: cannot rebuild model {printable(rec['model'])}: {e}") from None
    want = rec.get("identity")
    # The digest of the layers and shapes, not the file's name: a moved model file is the same model.
    if want and spec.identity.split(" ")[-1] != want.split(" ")[-1]:
        raise HpctrainError(f"{source}: was saved from model {printable(want)!r}; {printable(rec['model'])} now "
                            f"builds {spec.identity!r} (the model file changed? give --model FILE.py:FUNCTION of "
                            f"the one it was trained with)")
    values = spec.num_params + spec.num_state
    if 4 * values > stored_bytes:
        raise HpctrainError(f"{source}: model {spec.name} of {'x'.join(map(str, spec.input_shape))} inputs has "
                            f"{values:,} parameters, more than the file's {stored_bytes:,} bytes hold: not the "
                            f"parameters of this model (a damaged record?)")
    need, have = 4 * (2 * spec.num_params + spec.num_state), memory_available()   # build(): params, grads, state
    if have is not None and need > have:
        raise HpctrainError(f"{source}: model {spec.name} needs {need / 2**30:.1f} GiB of memory to rebuild, this "
                            f"machine has {have / 2**30:.1f} GiB available")
    return spec


def _trained(spec, model, source, step, rec):
    names = rec.get("class_names") or [str(i) for i in range(spec.classes)]
    if len(names) != spec.classes:
        raise HpctrainError(f"{source}: {len(names)} class names for {spec.classes} classes")
    return Trained(model, spec, source, step, list(names), rec.get("preprocess"), rec.get("text"), rec)


class Saved:
    """An hpctrain --save (or --keep-best) file open for reading, the one
    reader of such a file (load_params here; interop/pretrained's Source
    for --init-from): `attrs` (plain values), `shapes` {dataset: shape}, and
    `read(name, box)`, one box of one dataset as float32, once it is stored
    as write_params stores it (`stored`); one line for what is not. The
    datasets stay unread until read."""

    def __init__(self, path):
        import h5py
        path = str(path)
        if not os.path.isfile(path):
            raise HpctrainError(f"{path}: no such file" if not os.path.exists(path) else f"{path}: not a file")
        self.path, self.size, self.shapes = path, os.path.getsize(path), {}

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                self.shapes[name] = obj.shape
        try:
            self._f = h5py.File(path, "r", locking=False)
            self.attrs = {k: _plain(v) for k, v in self._f.attrs.items()}
            self._f.visititems(visit)
        except OSError as e:
            raise HpctrainError(f"{path}: not a readable --save file ({str(e).splitlines()[0]})") from None

    def stored(self, name, shape=None, model=None):
        """The dataset `name`, unread, once it is stored as write_params
        stores it: through hard links only (a soft or external link would
        read another place or file), of the tensor's shape (where given),
        floating-point, its bytes inside the file (checkpoints/trust.py's rules)."""
        path, f = self.path, self._f
        try:
            stored = hard_linked(f, name)
        except Refused as e:
            raise HpctrainError(f"{path}: {e}; hpctrain writes no such --save file (a crafted one?)") from None
        except Corrupt:
            stored = None
        if stored is None or (shape is not None and stored.shape != tuple(shape)):
            found = stored.shape if stored is not None else "not a dataset" if name in f else "nothing"
            raise HpctrainError(f"{path}: {name} is {found}, model {model} needs {tuple(shape or ())}: not the "
                                f"parameters of this model")
        if stored.dtype.kind != "f":
            raise HpctrainError(f"{path}: {name} holds {stored.dtype} values, not floating-point numbers: not "
                                f"parameters hpctrain saved")
        try:
            return stored_inside(stored, name, self.size)
        except Refused as e:
            raise HpctrainError(f"{path}: {e}; hpctrain writes no such --save file (a crafted one?)") from None

    def check(self, spec, in_file):
        """Every tensor and state of spec stored (by its name in the file:
        in_file, nn/spec.ModelSpec.name_in_file), of its shape: before
        anything of the model's size is allocated."""
        for name, shape, _, _ in spec.tensors + spec.state:
            self.stored(in_file(name), shape, spec.name)

    def read(self, name, box=None):
        stored = self.stored(name)
        try:
            return np.asarray(stored[box_slices(box)] if box else stored[()], np.float32)   # a 0-d tensor's box is ()
        except OSError as e:
            raise HpctrainError(f"{self.path}: not a readable --save file ({str(e).splitlines()[0]})") from None

    def close(self):
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load_params(path, data_dir=None, model=None):
    """The model in a --save (or --keep-best) file: its record and tensors
    checked before anything of their size is allocated (_build, Saved.check)."""
    with Saved(path) as saved:
        rec = _record_of(saved.attrs, saved.path, data_dir, model)
        step = saved.attrs.get("step", 0)
        if not _whole_numbers([step], 0, 2 ** 53):
            raise HpctrainError(f"{saved.path}: attribute step is {_short(step)}, not a step number; save the model "
                                f"again")
        spec = _build(rec, saved.path, saved.size)
        in_file = spec.name_in_file(saved.shapes)   # a file of positional names (an older hpctrain's) too
        saved.check(spec, in_file)
        return _restored(spec, rec, saved.path, lambda name, box: saved.read(in_file(name), box), step)


def _restored(spec, rec, source, read, step, state=True):
    """The model of `spec`, its parameters (and non-trainable state: `state`)
    read whole by name through `read(name, box)`, every value finite."""
    from ..state.consumers import restore
    from ..state.layouts import buffer_parts
    built = spec.build(np)
    parts = buffer_parts(spec, [(0, spec.num_params)], built.params)
    if state:
        parts += buffer_parts(spec, [(0, spec.num_state)], built.state, of="state")
    restore(parts, read)
    _check_finite(built, source)
    return _trained(spec, built, source, step, rec)


def _check_finite(built, source):
    """One line for parameters a diverged run (or damage) left nan or inf:
    they would predict nan for every image, and evaluate's loss would be nan."""
    bad = int(np.count_nonzero(~np.isfinite(built.params))) + int(np.count_nonzero(~np.isfinite(built.state)))
    if bad:
        raise HpctrainError(f"{source}: {bad:,} of its {built.params.size + built.state.size:,} parameters are not "
                            f"finite (nan or inf): saved from a run that diverged, or damaged; use an earlier "
                            f"checkpoint or --keep-best file")


def load_checkpoint(path, data_dir=None, model=None):
    """The model in a checkpoint file, or the newest valid one of a --checkpoint-dir."""
    from . import read_back as reader
    from .named import INDEX, NamedCheckpoint, open_checkpoint
    from .trust import Corrupt, Refused
    path = str(path)
    if os.path.isfile(os.path.join(path, INDEX)):   # one checkpoint of named tensors (a folder)
        try:
            ckpt = open_checkpoint(path)
        except (Corrupt, Refused) as e:
            raise HpctrainError(f"{path}: not a valid checkpoint ({e})") from None
    elif os.path.isdir(path):
        ckpt = _newest_checkpoint(path)
    elif os.path.isfile(path):
        try:
            ckpt = reader.read(path)
        except reader._Corrupt as e:
            raise HpctrainError(f"{path}: not a valid checkpoint ({e})") from None
    else:
        raise HpctrainError(f"{path}: no such file or directory")
    if isinstance(ckpt, NamedCheckpoint):
        with ckpt:
            return _named(ckpt, data_dir, model)
    rec = _record_of(ckpt.attrs, ckpt.path, data_dir, model)
    spec = _build(rec, ckpt.path, os.path.getsize(ckpt.path))
    if ckpt.params.size != spec.num_params or ckpt.model_state.size != spec.num_state:
        raise HpctrainError(f"{ckpt.path}: {ckpt.params.size} parameters, model {spec.name} has {spec.num_params}")
    built = spec.build(np, params=ckpt.params.copy())
    if spec.num_state:
        built.state[...] = ckpt.model_state
    _check_finite(built, ckpt.path)
    return _trained(spec, built, ckpt.path, ckpt.step, rec)


def _named(ckpt, data_dir, model):
    """The model in a checkpoint of named tensors (checkpoints/named.py): each tensor read whole by name."""
    rec = _record_of(ckpt.attrs, ckpt.path, data_dir, model)
    spec = _build(rec, ckpt.path, sum(size for size, _ in ckpt.files.values()))
    in_file = spec.name_in_file(ckpt.tensors)
    for name, shape, _, _ in spec.tensors + spec.state:
        if tuple(ckpt.tensors.get(in_file(name), ((),))[0]) != tuple(shape):
            raise HpctrainError(f"{ckpt.path}: no tensor {name} of shape {tuple(shape)}, as model {spec.name} has")
    return _restored(spec, rec, ckpt.path, ckpt.read_as(spec), ckpt.step)


def _newest_checkpoint(folder):
    """The newest valid checkpoint in folder; the files skipped on the way
    are warned about once one is found, and where none is, the one line
    says why each was skipped (not that there was none)."""
    from . import file, read_back as reader
    skipped = []
    ckpt = reader.load_latest(folder, {}, warn=skipped.append)
    if ckpt is None:
        found = file.list_checkpoints(folder)
        if not found:
            raise HpctrainError(f"{folder}: no checkpoint (ckpt-NNNNNNNN/ or ckpt-NNNNNNNN.h5) in it")
        why = [line.removesuffix(", trying the previous one").removesuffix("; trying the previous one")
               for line in skipped]
        raise HpctrainError(f"{folder}: none of its {len(found)} checkpoint file{'s' if len(found) > 1 else ''} "
                            f"is valid: {'; '.join(why)}")
    for line in skipped:
        print(f"hpctrain: warning: {line}", file=sys.stderr, flush=True)
    return ckpt


def rebuilt(rec, source, read, check=None, step=0):
    """The model of record `rec` (checked as a file's is) whose parameters
    `read(name, box)` gives whole (a pretrained model's files:
    interop/pretrained.py); check(spec): one line for tensors the file lacks
    or holds in another shape, before anything of the model's size is
    allocated. The byte count is not held to 4 a value (bf16 files hold 2)."""
    spec = _build(_checked(rec, source), source, math.inf)
    if check is not None:
        check(spec)
    return _restored(spec, rec, source, read, step, state=False)


def load(params=None, checkpoint=None, data_dir=None, model=None):
    if (params is None) == (checkpoint is None):
        raise HpctrainError("give --params FILE.h5 or --checkpoint DIR|FILE (one of them)")
    if params is not None:
        return load_params(params, data_dir, model)
    return load_checkpoint(checkpoint, data_dir, model)
