"""A trained model outside training: what the --save file and checkpoints
record so that it can be rebuilt and fed new images (`record`), and the
model loaded back from either (`load`), for predict.py and evaluate.py.

The record is one attribute, `inference`, a JSON object: the model as the
flags named it (`model`: a zoo name, or a user's FILE.py:FUNCTION made
absolute; `hidden`), the input shape and class count it was built for, and
from the data's manifest the class names (image folders), the record of how
the images were prepared (`preprocess`), `no_flip`, where the data was and
its manifest digest. Files written before it existed still load where the
data names the shapes (`--data DIR`: an MLP's, or a zoo model's).

    python -c "from hpctrain import trained; m = trained.load(params='p.h5'); print(m.describe())"

No MPI here: predict and evaluate are one process.
"""
import functools
import hashlib
import json
import os
import types
from dataclasses import dataclass

import numpy as np

from . import data as data_mod
from .errors import HpctrainError
from .nn import LayerError, spec_for
from .nn.user import UserModelError

ATTR = "inference"
# HDF5 keeps an attribute in the object header, 64 KiB at most: a record
# larger than this leaves its class names out (predict then prints numbers).
_MAX_RECORD = 60_000
_ZOO = ("mlp", "lenet", "cnn", "resnet", "small_cnn")


# ---------------------------------------------------------------------------
# Writing: the chief, at --save, --keep-best and every checkpoint

@functools.lru_cache(maxsize=8)
def _from_manifest(data_dir):
    """What the record takes from a data directory's manifest (read once)."""
    manifest = data_mod.load_manifest(data_dir)
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]
    return json.dumps({"class_names": manifest.get("class_names"), "preprocess": manifest.get("preprocess"),
                       "no_flip": bool(manifest.get("no_flip", False)), "data": str(data_dir),
                       "data_digest": digest})


def record(spec, plan):
    """{"inference": JSON} for the file that holds spec's parameters (plan:
    run/plan.Plan: the model as named, --hidden, the data). Never raises for
    the data: a manifest gone since start-up leaves its part out."""
    model = plan.model
    if ":" in model and model not in _ZOO:
        path, _, function = model.rpartition(":")
        model = f"{os.path.abspath(path)}:{function}"
    out = {"model": model, "hidden": [int(w) for w in plan.hidden], "identity": spec.identity,
           "input_shape": list(spec.input_shape), "classes": int(spec.classes)}
    data_dir = str(plan.data.dir)
    try:
        out.update(json.loads(_from_manifest(data_dir)))
    except HpctrainError:
        pass
    text = json.dumps(out)
    if len(text) > _MAX_RECORD:
        out["class_names"] = None
        text = json.dumps(out)
    return {ATTR: text}


# ---------------------------------------------------------------------------
# Reading: predict and evaluate

@dataclass
class Trained:
    """A model rebuilt from a file, on NumPy, its parameters loaded."""
    model: object            # nn Sequential
    spec: object             # nn ModelSpec
    source: str              # the file it came from
    step: int
    class_names: list        # index -> name (the numbers as text when the data had none)
    preprocess: dict         # prepare's record of how the training images were made, or None

    @property
    def input_shape(self):
        return self.spec.input_shape

    def logits(self, x, batch=128):
        """float32 logits of images x (uint8 pixels, scaled by 1/255 as in
        training, or floats), batch by batch as Sequential.evaluate runs them."""
        out = np.empty((len(x), self.spec.classes), np.float32)
        for lo in range(0, len(x), batch):
            a = x[lo:lo + batch]
            if a.dtype == np.uint8:
                a = a.astype(np.float32)
                a /= 255
            out[lo:lo + batch] = self.model.run.forward(a, False)
        return out

    def describe(self):
        return (f"{self.source}: step {self.step}, model {self.spec.name}, input "
                f"{'x'.join(map(str, self.input_shape))}, {self.spec.classes} classes")

    def check_data(self, data_dir):
        """One line unless data_dir's images have this model's shape and class count."""
        manifest = data_mod.load_manifest(data_dir)
        shape, classes = data_mod.model_shape(manifest)
        if tuple(shape) != tuple(self.input_shape) or classes != self.spec.classes:
            raise HpctrainError(
                f"{data_dir}: {'x'.join(map(str, shape))} images of {classes} classes, but the model in "
                f"{self.source} takes {'x'.join(map(str, self.input_shape))} images of {self.spec.classes} "
                f"classes: another model's file, or other data")
        names = manifest.get("class_names")
        if names and names != self.class_names and self.class_names != [str(i) for i in range(classes)]:
            raise HpctrainError(f"{data_dir}: classes {', '.join(names)}, but the model in {self.source} was "
                                f"trained on {', '.join(self.class_names)}")
        return manifest


def _plain(value):
    if isinstance(value, bytes):
        return value.decode()
    return value.item() if isinstance(value, np.generic) else value


def _record_of(attrs, source, data_dir, model):
    """The inference record: the file's, or for a file from before it, what
    --data and the file's own attributes say."""
    text = attrs.get(ATTR)
    if text:
        try:
            rec = json.loads(text)
        except ValueError:
            raise HpctrainError(f"{source}: damaged '{ATTR}' attribute; save the model again") from None
    else:
        identity = str(attrs.get("model", "mlp"))
        name = identity.split(" ", 1)[0]
        if data_dir is None or (name not in _ZOO and model is None):
            raise HpctrainError(f"{source}: written by an hpctrain that did not record how to rebuild the model; "
                                f"give --data DIR (the data it was trained on)"
                                + ("" if name in _ZOO else " and --model FILE.py:FUNCTION"))
        manifest = data_mod.load_manifest(data_dir)
        shape, classes = data_mod.model_shape(manifest)
        hidden = [int(w) for w in str(attrs.get("hidden", "")).split(",") if w]
        rec = {"model": name, "hidden": hidden, "identity": identity, "input_shape": list(shape),
               "classes": classes, "class_names": manifest.get("class_names")}
    if model is not None:
        rec["model"] = model
    return rec


def _build(rec, source):
    args = types.SimpleNamespace(model=rec["model"], hidden=rec.get("hidden") or [])
    try:
        spec = spec_for(args, tuple(rec["input_shape"]), int(rec["classes"]))
    except (LayerError, UserModelError) as e:
        raise HpctrainError(f"{source}: cannot rebuild model {rec['model']}: {e}") from None
    want = rec.get("identity")
    # The digest of the layers and shapes, not the file's name: a moved model file is the same model.
    if want and spec.identity.split(" ")[-1] != want.split(" ")[-1]:
        raise HpctrainError(f"{source}: was saved from model {want!r}; {rec['model']} now builds {spec.identity!r} "
                            f"(the model file changed? give --model FILE.py:FUNCTION of the one it was trained with)")
    return spec


def _trained(spec, model, source, step, rec):
    names = rec.get("class_names") or [str(i) for i in range(spec.classes)]
    if len(names) != spec.classes:
        raise HpctrainError(f"{source}: {len(names)} class names for {spec.classes} classes")
    return Trained(model, spec, source, step, list(names), rec.get("preprocess"))


def load_params(path, data_dir=None, model=None):
    """The model in a --save (or --keep-best) file."""
    import h5py
    path = str(path)
    if not os.path.isfile(path):
        raise HpctrainError(f"{path}: no such file" if not os.path.exists(path) else f"{path}: not a file")
    try:
        with h5py.File(path, "r", locking=False) as f:
            attrs = {k: _plain(v) for k, v in f.attrs.items()}
            rec = _record_of(attrs, path, data_dir, model)
            spec = _build(rec, path)
            built = spec.build(np)
            for name, view in built.tensors() + built.state_tensors():
                stored = f.get(name)
                if not isinstance(stored, h5py.Dataset) or stored.shape != view.shape:
                    found = "nothing" if stored is None else getattr(stored, "shape", type(stored).__name__)
                    raise HpctrainError(f"{path}: {name} is {found}, model {spec.name} needs {view.shape}: not the "
                                        f"parameters of this model")
                view[...] = stored[()]
    except OSError as e:
        raise HpctrainError(f"{path}: not a readable --save file ({str(e).splitlines()[0]})") from None
    return _trained(spec, built, path, int(attrs.get("step", 0)), rec)


def load_checkpoint(path, data_dir=None, model=None):
    """The model in a checkpoint file, or the newest valid one of a --checkpoint-dir."""
    from .checkpoints import reader
    path = str(path)
    if os.path.isdir(path):
        ckpt = reader.load_latest(path, {})
        if ckpt is None:
            raise HpctrainError(f"{path}: no checkpoint (ckpt-NNNNNNNN.h5) in it")
    elif os.path.isfile(path):
        try:
            ckpt = reader.read(path)
        except reader._Corrupt as e:
            raise HpctrainError(f"{path}: not a valid checkpoint ({e})") from None
    else:
        raise HpctrainError(f"{path}: no such file or directory")
    rec = _record_of(ckpt.attrs, ckpt.path, data_dir, model)
    spec = _build(rec, ckpt.path)
    if ckpt.params.size != spec.num_params or ckpt.model_state.size != spec.num_state:
        raise HpctrainError(f"{ckpt.path}: {ckpt.params.size} parameters, model {spec.name} has {spec.num_params}")
    built = spec.build(np, params=ckpt.params.copy())
    if spec.num_state:
        built.state[...] = ckpt.model_state
    return _trained(spec, built, ckpt.path, ckpt.step, rec)


def load(params=None, checkpoint=None, data_dir=None, model=None):
    if (params is None) == (checkpoint is None):
        raise HpctrainError("give --params FILE.h5 or --checkpoint DIR|FILE (one of them)")
    if params is not None:
        return load_params(params, data_dir, model)
    return load_checkpoint(checkpoint, data_dir, model)
